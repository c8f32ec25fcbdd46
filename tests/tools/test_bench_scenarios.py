"""The routing scenarios' variant extras, gateway configs and follow-up and queue counts (no processes)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from config.settings import load_settings
from gateway.metrics import AdmissionMetrics
from tools import bench_scenarios as bs
from tools.bench_report import TurnRecord
from tools.client import StreamResult
from tools.launch import Engine

ENGINES = [Engine("engine-1", "http://127.0.0.1:1"), Engine("engine-2", "http://127.0.0.1:2")]


class _Launch:
    def __init__(self, tmp: Path) -> None:
        self.workdir = tmp
        self.configs: list[dict[str, Any]] = []

    def _spawn(self, name: str, port: int, argv: list[str]) -> object:
        self.configs.append(json.loads(Path(argv[-1]).read_text()))
        return object()

    def _wait(self, *args: object) -> None:
        return None


def test_variant_extras_are_parsed_and_unknown_ones_refused() -> None:
    assert bs._extras("ttft") == set()
    assert bs._extras("affinity+admission") == {"admission"}
    assert bs._extras("ttft+kv+admission@stay_margin=0.5") == {"kv", "admission"}
    with pytest.raises(SystemExit, match="admision"):
        bs._extras("ttft+admision")  # a typo must not run as plain ttft


def test_admission_variant_bounds_every_backend_by_its_engines_batch(tmp_path: Path) -> None:
    launch = _Launch(tmp_path)
    bs.start_gateway(launch, ENGINES, "ttft", None, 1.0, "plain")  # type: ignore[arg-type]
    bs.start_gateway(launch, ENGINES, "ttft", None, 1.0, "admitted", admission=4)  # type: ignore[arg-type]
    plain, admitted = (load_settings(None, **c) for c in launch.configs)
    assert not plain.admission.enabled
    assert admitted.admission.enabled and admitted.admission.max_in_flight == 4
    assert admitted.admission.backends == {}  # the same bound on every backend
    assert not admitted.auth.client_keys and admitted.admission.clients == {}  # one client, one class
    assert admitted.routing.policy == "ttft"


def _turn(conversation: int, turn: int, backend: str, prompt: int, cached: int) -> TurnRecord:
    result = StreamResult(ttft_s=0.1, prompt_tokens=prompt, cached_tokens=cached, backend=backend)
    return TurnRecord("ttft", 1, conversation, turn, False, 0.0, result, None if turn == 1 else True)


def test_missed_followups_count_re_reads_wherever_served() -> None:
    turns = [
        _turn(0, 1, "engine-1", 2500, 0),
        _turn(0, 2, "engine-1", 3100, 2496),  # the previous prompt cached, to the block: warm
        _turn(0, 3, "engine-2", 3700, 2496),  # elsewhere, holding only the head: a re-read
        _turn(1, 1, "engine-2", 2500, 0),
        _turn(1, 2, "engine-2", 3100, 1000),  # at home, evicted: a re-read
    ]
    assert bs._missed(turns) == 2


def test_queued_counts_admitted_waits_from_the_gateways_histogram() -> None:
    registry = CollectorRegistry()
    metrics = AdmissionMetrics(registry, ["standard"])
    for seconds in (0.0001, 0.0002, 0.3, 0.1):
        metrics.waited("standard", "", seconds, "admitted")
    metrics.waited("standard", "", 9.0, "timeout")  # refused: not an admitted request's wait
    out = bs.queued_from_metrics(generate_latest(registry).decode())
    assert (out["admitted"], out["queued"]) == (4, 2)
    assert out["queued_ms_mean"] == pytest.approx(1000 * 0.4003 / 4)
