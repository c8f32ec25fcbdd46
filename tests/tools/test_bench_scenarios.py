"""The routing scenarios' variant names, a variant's gateway run from another checkout (``--tree``), the
``+admission`` gateway config, and the follow-up and queue counts."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from config.settings import load_settings
from gateway.metrics import AdmissionMetrics
from tools import bench, bench_scenarios
from tools.bench_report import TurnRecord
from tools.bench_run import Target
from tools.client import StreamResult
from tools.launch import Engine, Launcher, SimProfile


@pytest.fixture
def trees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    main = tmp_path / "main"
    monkeypatch.setattr(bench_scenarios, "TREES", {"main": main})
    return {"main": main}


def test_a_variant_names_its_policy_extras_settings_and_tree(trees: dict[str, Path]) -> None:
    parse = bench_scenarios.parse_variant
    assert parse("ttft") == ("ttft", set(), {}, None)
    assert parse("ttft+weights%main") == ("ttft", {"weights"}, {}, trees["main"])
    assert parse("ttft+kv@stay_margin=0.5;load_share=2%main") == (
        "ttft",
        {"kv"},
        {"stay_margin": 0.5, "load_share": 2},
        trees["main"],
    )
    assert bench_scenarios._extras("ttft+weights+kv%main") == {"weights", "kv"}


def test_a_tree_that_was_not_given_is_refused(trees: dict[str, Path]) -> None:
    with pytest.raises(SystemExit, match="--tree old=PATH"):
        bench_scenarios.parse_variant("ttft%old")


def test_a_tree_must_be_a_checkout(tmp_path: Path) -> None:
    (tmp_path / "gateway").mkdir()
    with pytest.raises(SystemExit, match="--tree expects"):
        bench._trees([f"main={tmp_path}"])
    (tmp_path / "gateway" / "cli.py").write_text("")
    assert bench._trees([f"main={tmp_path}"]) == {"main": tmp_path.resolve()}


def test_a_child_from_another_checkout_imports_that_checkout(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "gateway").mkdir(parents=True)
    (tree / "gateway" / "__init__.py").write_text("")
    probe = "import gateway, os; print(gateway.__file__, os.getcwd())"
    with Launcher("warmroute-test-") as launch:
        child = launch._spawn("probe", 1, [sys.executable, "-c", probe], tree)
        assert child.process.wait(timeout=30) == 0
        where, cwd = child.log_path.read_text().split()
    assert Path(where) == tree / "gateway" / "__init__.py" and Path(cwd) == tree


ENGINES = [Engine("engine-1", "http://127.0.0.1:1"), Engine("engine-2", "http://127.0.0.1:2")]


class _Launch:
    def __init__(self, tmp: Path) -> None:
        self.workdir = tmp
        self.configs: list[dict[str, Any]] = []

    def _spawn(self, name: str, port: int, argv: list[str], source: Path | None = None) -> object:
        self.configs.append(json.loads(Path(argv[-1]).read_text()))
        return object()

    def _wait(self, *args: object) -> None:
        return None


def test_the_oracle_with_a_shift_turns_the_engines_labels() -> None:
    """``oracle@shift=1``: conversation i to engine (i + 1) mod K, the same grouping under other labels."""
    four = [Engine(f"engine-{i}", f"http://127.0.0.1:{i}") for i in range(1, 5)]
    assert bench_scenarios.parse_variant("oracle@shift=1")[2] == {"shift": 1}
    assert [e.id for e in bench_scenarios.oracle_engines(four, 0)] == [e.id for e in four]
    turned = bench_scenarios.oracle_engines(four, 1)
    assert [e.id for e in turned] == ["engine-2", "engine-3", "engine-4", "engine-1"]
    target = Target(tuple(e.url for e in turned), tuple(e.id for e in turned))
    assert [target.for_conversation(i)[1] for i in range(5)] == [
        "engine-2", "engine-3", "engine-4", "engine-1", "engine-2"
    ]  # fmt: skip
    assert bench_scenarios.oracle_engines(four, 5) == turned


def test_a_scenarios_engines_answer_one_prompt_alike() -> None:
    """Replicas of one model: a prompt (and the bench's per-conversation ``seed``) gets the same reply on
    every engine of a scenario, whatever its speed, so an oracle's TTFT does not depend on which engine got
    which conversations; different prompts still get different replies."""
    sc = replace(bench_scenarios.SCENARIOS["hetero"], speeds=(1.0, 2.0))
    with Launcher("warmroute-test-") as launch:
        engines = bench_scenarios.start_engines(launch, sc, SimProfile(time_scale=0.0))
        replies = []
        for n in range(4):
            body = {"model": bench_scenarios.MODEL, "max_tokens": 32, "seed": n,
                    "messages": [{"role": "user", "content": f"task {n}: " + "word " * 40}]}  # fmt: skip
            answers = [
                httpx.post(f"{e.url}/v1/chat/completions", json=body, timeout=30).json() for e in engines
            ]
            texts = {a["choices"][0]["message"]["content"] for a in answers}
            lengths = {a["usage"]["completion_tokens"] for a in answers}
            assert len(texts) == 1 and len(lengths) == 1, answers
            replies.append(texts.pop())
    assert len(set(replies)) == len(replies)


def test_variant_extras_are_parsed_and_unknown_ones_refused() -> None:
    assert bench_scenarios._extras("ttft") == set()
    assert bench_scenarios._extras("affinity+admission") == {"admission"}
    assert bench_scenarios._extras("ttft+kv+admission@stay_margin=0.5") == {"kv", "admission"}
    with pytest.raises(SystemExit, match="admision"):
        bench_scenarios._extras("ttft+admision")  # a typo must not run as plain ttft


def test_admission_variant_bounds_every_backend_by_its_engines_batch(tmp_path: Path) -> None:
    launch = _Launch(tmp_path)
    bench_scenarios.start_gateway(launch, ENGINES, "ttft", None, 1.0, "plain")  # type: ignore[arg-type]
    bench_scenarios.start_gateway(launch, ENGINES, "ttft", None, 1.0, "admitted", admission=4)  # type: ignore[arg-type]
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
    assert bench_scenarios._missed(turns) == 2


def test_queued_counts_admitted_waits_from_the_gateways_histogram() -> None:
    registry = CollectorRegistry()
    metrics = AdmissionMetrics(registry, ["standard"])
    for seconds in (0.0001, 0.0002, 0.3, 0.1):
        metrics.waited("standard", "", seconds, "admitted")
    metrics.waited("standard", "", 9.0, "timeout")  # refused: not an admitted request's wait
    out = bench_scenarios.queued_from_metrics(generate_latest(registry).decode())
    assert (out["admitted"], out["queued"]) == (4, 2)
    assert out["queued_ms_mean"] == pytest.approx(1000 * 0.4003 / 4)


def test_the_trace_names_each_turns_engine_and_the_grouping() -> None:
    engines = [Engine("engine-1", "http://a"), Engine("engine-2", "http://b")]

    def turn(
        conversation: int, turn: int, backend: str | None, started: float, route: str | None
    ) -> TurnRecord:
        result = StreamResult(ttft_s=0.25, backend=backend, route=route)
        return TurnRecord("ttft", 1, conversation, turn, False, started, result, None if turn == 1 else True)

    records = [
        turn(1, 1, "engine-2", 0.0, "new_cheapest"),
        turn(0, 1, "engine-2", 0.5, "new_cheapest"),
        turn(1, 2, "engine-1", 1.0, "move_cheaper"),
        turn(0, 2, "engine-2", 1.5, "affinity_hit"),
        turn(2, 1, None, 2.0, None),  # an error: no engine
    ]
    out = bench_scenarios.trace(records, engines)
    assert out["grouping"] == [[], [1, 0]]  # in the order they started
    assert out["turns"] == [
        {"conversation": 0, "start_s": [0.5, 1.5], "engines": [2, 2],
         "routes": ["new_cheapest", "affinity_hit"], "ttft_ms": [250.0, 250.0]},
        {"conversation": 1, "start_s": [0.0, 1.0], "engines": [2, 1],
         "routes": ["new_cheapest", "move_cheaper"], "ttft_ms": [250.0, 250.0]},
        {"conversation": 2, "start_s": [2.0], "engines": [0], "routes": [""], "ttft_ms": [250.0]},
    ]  # fmt: skip
