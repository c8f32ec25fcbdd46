"""The fair-share scenario's arithmetic and the gateway configs of its variants (no processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from config.settings import load_settings
from tools import bench_fairness as fair
from tools import bench_neighbours as nn
from tools.launch import Engine


def test_only_streams_finishing_inside_the_window_count_and_shares_add_up() -> None:
    window = fair.Window(10.0, 20.0, {})
    for client, at, tokens in [
        ("heavy", 9.9, 64),  # warm-up: not counted
        ("heavy", 10.0, 64),
        ("light", 15.0, 64),
        ("light", 19.0, 64),
        ("heavy", 20.0, 64),
        ("light", 20.1, 64),  # after the window
    ]:
        window.count(client, at, tokens)
    assert window.tokens == {"heavy": 128, "light": 128}
    out = fair.summarize(window)
    assert (out["heavy_share"], out["light_share"], out["tokens"]) == (0.5, 0.5, 256)
    assert out["tokens_per_s"] == pytest.approx(25.6)
    assert fair.summarize(fair.Window(0.0, 1.0, {}))["heavy_share"] == 0.0


def test_the_two_variants_put_both_clients_in_one_class(tmp_path: Path) -> None:
    configs: list[dict[str, Any]] = []

    class Launch:
        workdir = tmp_path

        def _spawn(self, name: str, port: int, argv: list[str]) -> object:
            configs.append(json.loads(Path(argv[-1]).read_text()))
            return object()

        def _wait(self, *args: object) -> None:
            return None

    for variant in fair.VARIANTS:
        nn.start_gateway(Launch(), Engine("engine-1", "http://127.0.0.1:1"), variant, variant)  # type: ignore[arg-type]
    settings = [load_settings(None, **c) for c in configs]
    assert [s.admission.enabled for s in settings] == [False, True]
    keys = settings[1].auth.keys()
    assert keys["key-heavy"] == "heavy" and keys["key-light"] == "light"
    on = settings[1].admission
    assert on.clients.get("heavy", on.default_class) == on.clients.get("light", on.default_class)
