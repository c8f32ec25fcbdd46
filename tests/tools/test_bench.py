"""``warmroute bench`` on a tiny workload (2 simulated engines, fast clock), plus its pure helpers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench_engines import CacheCounters, imbalance
from tools.bench_report import percentile
from tools.workload import WorkloadSpec, build, total_requests


def warmroute() -> list[str]:
    script = Path(sys.executable).parent / "warmroute"
    return [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli"]


def test_tiny_bench_reports_every_policy_and_affinity_keeps_turns_warm(tmp_path: Path) -> None:
    report_path, plot_path = tmp_path / "bench.json", tmp_path / "ttft.png"
    argv = [
        *("bench", "--sims", "2", "--time-scale", "0.1", "--conversations", "4", "--turns", "3"),
        *("--concurrency", "1", "--rounds", "1", "--policies", "affinity,round_robin"),
        *("--system-tokens", "300", "--context-tokens", "600", "--user-tokens", "60", "--max-tokens", "8"),
        *("--json", str(report_path), "--plot", str(plot_path), "--progress-s", "2"),
    ]
    done = subprocess.run([*warmroute(), *argv], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TTFT mean" in done.stdout and "follow-ups on warm engine" in done.stdout
    doc = json.loads(report_path.read_text())
    assert doc["isolation"] == "reset"
    assert set(doc["medians"]) == {"affinity", "round_robin"}
    requests = 3 * 3 + 6  # one of the four conversations is hot: twice the turns
    for policy, stats in doc["medians"].items():
        assert stats["requests"] == requests and stats["errors"] == 0, policy
        assert stats["ttft_mean_ms"] > 0 and stats["streams"] == 1
        assert 0 <= stats["engine_hit_rate"] <= 1 and stats["load_imbalance"] >= 1
        assert len(doc["runs"][policy]) == 1
    aff, rr = doc["medians"]["affinity"], doc["medians"]["round_robin"]
    assert aff["warm_share"] == 1.0 and aff["warm_share"] > rr["warm_share"]  # one stream: RR always moves
    assert aff["engine_hit_rate"] > rr["engine_hit_rate"]
    assert doc["ratios"]["round_robin"]["ttft_mean_vs_round_robin"] == 1.0
    assert len(doc["requests"]) == 2 * requests
    assert plot_path.stat().st_size > 10_000
    again = subprocess.run(
        [*warmroute(), "bench", "--from-json", str(report_path), "--no-plot"], capture_output=True, text=True
    )
    assert again.returncode == 0, again.stderr
    assert _table(again.stdout) == _table(done.stdout)  # the saved requests reproduce the printed table


def _table(out: str) -> str:
    return out[out.index("medians over") : out.index("left out:")]


def test_workload_token_counts_are_predictable_and_salt_changes_only_words() -> None:
    spec = WorkloadSpec(conversations=10, turns=4, system_tokens=100, context_tokens=200, user_tokens=40)
    plain, salted = build(spec), build(spec, salt="~x")
    assert total_requests(plain) == 10 * 4 + 1 * 4  # 10 % hot, twice the turns
    for a, b in zip(plain, salted, strict=True):
        assert len(a.system.split()) == spec.system_tokens
        assert [len(t.split()) for t in a.user_turns] == [len(t.split()) for t in b.user_turns]
        assert 100 <= len(a.user_turns[0].split()) <= 300
        assert a.user_turns != b.user_turns and a.pauses_s == b.pauses_s and a.hot == b.hot
    assert len({c.system for c in plain}) == spec.system_prompts
    messages = plain[0].messages(2, ["r1", "r2"])
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant", "user"]


def test_percentile_ratio_and_hit_rate_helpers() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 95) == 5.0
    assert imbalance({"a": 3.0, "b": 1.0}) == 1.5 and imbalance({"a": 0.0}) is None
    before = CacheCounters({"a": (100.0, 50.0), "b": (0.0, 0.0)})
    after = CacheCounters({"a": (300.0, 200.0), "b": (200.0, 50.0)})
    assert after.hit_rate_since(before) == pytest.approx(200 / 400)
    assert CacheCounters({"a": None}).hit_rate_since(before) is None
