"""The noisy-neighbour scenario's arithmetic and the gateway configs of its variants (no processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from config.settings import load_settings
from tools import bench_neighbours as nn
from tools.client import StreamResult
from tools.launch import Engine


def test_b_percentiles_and_total_tokens_per_second() -> None:
    turns = [StreamResult(ttft_s=t / 1000, completion_tokens=8) for t in range(1, 21)]
    turns.append(StreamResult(error="HTTP 503"))
    out = nn.summarize(nn.Run(turns, flood_tokens=840, wall_s=10.0))
    assert (out["b_turns"], out["b_errors"]) == (20, 1)
    assert (out["b_ttft_p50_ms"], out["b_ttft_p95_ms"]) == pytest.approx((10.5, 19.0))
    assert out["tokens_per_s"] == (840 + 20 * 8) / 10.0  # the failed turn produced nothing


class _Launch:
    def __init__(self, tmp: Path) -> None:
        self.workdir = tmp
        self.configs: list[dict[str, Any]] = []

    def _spawn(self, name: str, port: int, argv: list[str]) -> object:
        self.configs.append(json.loads(Path(argv[-1]).read_text()))
        return object()

    def _wait(self, *args: object) -> None:
        return None


def test_every_variant_is_a_valid_gateway_config(tmp_path: Path) -> None:
    launch = _Launch(tmp_path)
    for variant in nn.VARIANTS:
        nn.start_gateway(launch, Engine("engine-1", "http://127.0.0.1:1"), variant, variant)  # type: ignore[arg-type]
    settings = [load_settings(None, **c) for c in launch.configs]
    assert [s.admission.enabled for s in settings] == [False, True, False, True, True, True, True, True]
    by = dict(zip(nn.VARIANTS, settings, strict=True))
    assert by["flood+admission@headroom"].admission.classes["batch"].headroom == 1
    assert by["flood+admission"].admission.classes["batch"].headroom == 0
    assert by["flood+admission@pause"].admission.classes["batch"].preemptible
    assert not by["flood+admission"].admission.classes["batch"].preemptible
    assert by["flood+admission@one-class"].admission.clients == {}  # one class: A and B both the default
    assert by["flood+admission"].admission.clients == {"flood": "batch", "person": "interactive"}
    ranked = by["flood+engine-priority"].admission  # the engine's queue decides: nothing held back
    assert (ranked.engine_priority, ranked.max_in_flight) == (["engine-1"], nn.FLOOD + 8)
    assert ranked.clients == {"flood": "batch", "person": "interactive"}
