"""tools.bench_proxy: the bodies each path sends (from Python and from wrk's Lua), a tiny full run, and the
summaries it prints."""

from __future__ import annotations

import gc
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from routing.keys import chat_key
from tools.bench_memory import SYSTEM_PROMPT, GcPauses
from tools.bench_proxy import _ANSWER, PATHS, SESSION_HEADER, TOKEN_WIDTH, Scripts, render
from tools.bench_proxy_report import PathResult, Run, TogetherResult, medians, spread, table, targets

from upstreams import serve

needs_wrk = pytest.mark.skipif(
    shutil.which("wrk") is None, reason="wrk is not installed (apt-get install wrk)"
)


def key_of(body: bytes) -> str:
    return chat_key(json.loads(body))


def test_every_path_sends_the_same_size_and_only_new_changes_the_conversation_key() -> None:
    tokens = ["0001000000000001", "0001000000000002"]
    sent = {path: [render(path, t) for t in tokens] for path in PATHS}
    assert len({len(body) for reqs in sent.values() for _, body in reqs}) == 1
    hit_key = key_of(sent["hit"][0][1])
    assert [key_of(b) for _, b in sent["hit"]] == [hit_key, hit_key]
    assert [key_of(b) for _, b in sent["new-session"]] == [hit_key, hit_key]  # the session id keys it
    new_keys = [key_of(b) for _, b in sent["new"]]
    assert len(set(new_keys)) == 2 and hit_key not in new_keys
    assert [h.get(SESSION_HEADER) for h, _ in sent["new-session"]] == tokens
    assert all(SESSION_HEADER not in h for path in ("hit", "new") for h, _ in sent[path])
    body = json.loads(sent["new"][0][1])
    assert body["messages"][0] == {"role": "system", "content": SYSTEM_PROMPT}
    assert body["messages"][1]["content"].endswith(tokens[0]) and body["user"] == tokens[0]
    assert 250 <= len(SYSTEM_PROMPT.encode()) <= 350


class Recorder:
    """An upstream that keeps (path, headers, body) of every request and answers like the benchmark's."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, str], bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body, more = body + message.get("body", b""), message.get("more_body", False)
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.seen.append((scope["path"], headers, body))
        start = {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json")],
        }
        await send(start)
        await send({"type": "http.response.body", "body": _ANSWER})


@needs_wrk
@pytest.mark.needs("wrk")
def test_lua_script_sends_what_render_describes_with_a_fresh_token_per_request(
    tmp_path: Path,
) -> None:
    recorder = Recorder()
    scripts = Scripts(tmp_path)
    with serve(recorder) as (base, _server), ThreadPoolExecutor(len(PATHS)) as pool:
        runs = dict(zip(PATHS, pool.map(lambda p: scripts.wrk(f"{base}/{p}", p, 1, 1), PATHS), strict=True))
    for path in PATHS:
        seen = [(h, b) for p, h, b in recorder.seen if p == f"/{path}"]
        assert len(seen) >= runs[path].requests > 10, path
        tokens = [json.loads(b)["user"] for _, b in seen]
        assert len(set(tokens)) == len(tokens) and all(len(t) == TOKEN_WIDTH for t in tokens), path
        for (headers, body), token in zip(seen, tokens, strict=True):
            want_headers, want_body = render(path, token)
            assert body == want_body, path
            assert headers.get(SESSION_HEADER) == want_headers.get(SESSION_HEADER), path
    tags = {json.loads(b)["user"][:4] for _, _, b in recorder.seen}
    assert len(tags) == len(PATHS)  # each run tags its tokens: no two runs repeat a conversation


@needs_wrk
@pytest.mark.needs("wrk")
def test_tiny_run_reports_both_paths_and_the_gateway_really_claimed_or_hit(tmp_path: Path) -> None:
    out = tmp_path / "proxy.json"
    argv = [sys.executable, "-m", "tools.bench_proxy", "--seconds", "1", "--rounds", "1", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[hit]" in done.stdout and "[new]" in done.stdout and "gateway after the path" in done.stdout
    doc = json.loads(out.read_text())
    assert list(doc["paths"]) == ["hit", "new"] and doc["wrk"] is True and doc["body_bytes"] > 500
    for path, want in (("hit", "affinity_hit"), ("new", "new_cheapest")):  # the default policy: ttft
        p = doc["paths"][path]
        assert set(p["decisions"]) == {want}, p["decisions"]  # every request took the intended path
        gateway_requests = sum(r["requests"] for w in ("sequential", "concurrent") for r in p[w]["gateway"])
        assert p["decisions"][want] >= gateway_requests  # wrk leaves out what was cut off at the end
        gw, direct = p["medians"]["gateway"], p["medians"]["direct"]
        assert gw["rps"] > 0 and direct["rps"] > 0 and gw["cpu_us_per_request"] > 0
        assert (
            gw["seq_p50_ms"] > 0 and gw["added_p50_ms"] is not None and direct["cpu_us_per_request"] is None
        )
        assert gw["gc_ms_per_s"] is not None and p["concurrent"]["gateway"][0]["gc"]["gen0"]["count"] > 0
        assert p["rss_after_bytes"] > 10 * 2**20 and (p["entries_after"] is None or p["entries_after"] > 0)
    assert doc["paths"]["new"]["claims_so_far"] >= doc["paths"]["new"]["decisions"]["new_cheapest"]
    assert set(doc["targets"]) == {"new", "new_vs_hit"}
    assert set(doc["targets"]["new"]) == {"rps", "cpu_us_per_request", "p99_ms"}


@needs_wrk
@pytest.mark.needs("wrk")
def test_trees_run_one_gateway_per_checkout_each_round_and_compare_their_cpu(tmp_path: Path) -> None:
    out, here = tmp_path / "proxy.json", str(Path(__file__).resolve().parents[2])
    argv = [sys.executable, "-m", "tools.bench_proxy", "--seconds", "1", "--rounds", "2", "--paths", "new"]
    argv += ["--trees", f"a={here},b={here}", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)  # a hang guard only
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== a" in done.stdout and "== b" in done.stdout and "ratio to a" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["trees"] == {"a": here, "b": here} and list(doc["gateways"]) == ["a", "b"]
    a, b = (doc["gateways"][n]["paths"]["new"] for n in ("a", "b"))
    assert a["concurrent"]["direct"] == b["concurrent"]["direct"]  # one direct run per round, shared
    assert len(a["concurrent"]["gateway"]) == len(b["concurrent"]["gateway"]) == 2
    for p in (a, b):  # each gateway served its own runs: every request a new conversation there
        assert set(p["decisions"]) == {"new_cheapest"}
        assert p["decisions"]["new_cheapest"] >= sum(r["requests"] for r in p["concurrent"]["gateway"])


def run(p50: float, p99: float, **kw: Any) -> Run:
    return Run(requests=1000, seconds=2.0, p50_ms=p50, p99_ms=p99, **kw)


def test_medians_pair_rounds_for_added_latency_and_the_table_shows_missing_entries_as_na() -> None:
    gc_stats = {
        "gen0": {"count": 5, "total_ms": 2.0, "max_ms": 1.0},
        "gen2": {"count": 1, "total_ms": 30.0, "max_ms": 30.0},
    }
    r = PathResult(
        "new",
        sequential={
            "direct": [run(0.1, 0.2), run(0.3, 0.4)],
            "gateway": [run(0.4, 1.0), run(0.5, 0.6, cpu_us_per_request=300.0)],
        },
        concurrent={
            "direct": [run(1.0, 2.0)],
            "gateway": [run(5.0, 12.0, cpu_us_per_request=190.0, gc=gc_stats)],
        },
        decisions={"new_cheapest": 1000.0, "new_least_loaded": 990.0, "affinity_hit": 10.0},
        rss_after_bytes=64 * 2**20,
    )
    med = medians(r)
    assert med["gateway"]["added_p50_ms"] == pytest.approx(0.25)  # rounds (0.3, 0.2), not 0.45 - 0.2
    assert med["gateway"]["added_p99_ms"] == pytest.approx(0.5)  # rounds (0.8, 0.2)
    assert med["gateway"]["rps"] == 500.0 and med["gateway"]["gc_max_ms"] == 30.0
    assert med["gateway"]["gc_ms_per_s"] == 16.0 and med["direct"]["gc_max_ms"] is None
    assert r.expected_share == pytest.approx(0.995)
    rows = table([r], 50 * 2**20, 32).splitlines()
    gateway_row = next(line for line in rows if line.startswith("new          gateway"))
    assert gateway_row.split()[-2:] == ["64.0", "n/a"]
    doc, lines = targets({"new": {"medians": med}})
    assert doc["new"]["rps"] == {"value": 500.0, "bound": 6000.0, "ok": False}
    assert doc["new"]["cpu_us_per_request"]["ok"] is True and doc["new"]["p99_ms"]["ok"] is False
    assert "new_vs_hit" not in doc and len(lines) == 1


def test_gc_pauses_counts_a_full_collection_as_generation_two() -> None:
    probe = GcPauses().install()
    try:
        gc.collect()
    finally:
        probe.remove()
    snap = probe.snapshot()
    assert snap["gen2"]["count"] == 1 and snap["gen2"]["max_ms"] > 0
    assert snap["gen2"]["total_ms"] == snap["gen2"]["max_ms"]
    probe.reset()
    assert probe.snapshot()["gen2"] == {"count": 0, "total_ms": 0.0, "max_ms": 0.0}


@needs_wrk
@pytest.mark.needs("wrk")
def test_simultaneous_runs_every_gateway_at_once_and_reports_ratios_to_the_first(tmp_path: Path) -> None:
    out, here = tmp_path / "proxy.json", str(Path(__file__).resolve().parents[2])
    argv = [sys.executable, "-m", "tools.bench_proxy", "--simultaneous", "--seconds", "1", "--rounds", "2"]
    argv += ["--paths", "hit", "--gateways", f"a={here}:affinity,b={here}:ttft", "--json", str(out)]
    if len(os.sched_getaffinity(0)) >= 2:
        argv.append("--pin")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)  # a hang guard only
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ratio median" in done.stdout and "IQR" in done.stdout
    sim = json.loads(out.read_text())["simultaneous"]
    assert sim["base"] == "a" and sim["gateways"]["b"] == {"tree": here, "policy": "ttft"}
    p = sim["paths"]["hit"]
    assert list(p["runs"]) == ["a", "b"] and p["first"] == ["a", "b"]  # the wrk started first rotates
    for name in ("a", "b"):  # a round a busy machine left without answers has no CPU figure, never 0
        runs = p["runs"][name]
        assert len(runs) == 2 and all((r["cpu_us_per_request"] is None) == (r["requests"] == 0) for r in runs)
        assert set(p["decisions"][name]) <= {"affinity_hit"}  # each gateway served its own wrk's requests
        assert p["decisions"][name].get("affinity_hit", 0) >= sum(r["requests"] for r in runs)
    a_runs, b_runs = p["runs"]["a"], p["runs"]["b"]
    paired = sum(1 for a, b in zip(a_runs, b_runs, strict=True) if a["requests"] and b["requests"])
    summary = p["summary"]
    for name in ("a", "b"):
        ratio = summary[name]["ratio"]
        assert (
            ratio is None
            if not paired
            else ratio["q1"] <= ratio["median"] <= ratio["q3"] and ratio["n"] == paired
        )
    assert summary["a"]["ratio"] is None or summary["a"]["ratio"]["median"] == 1.0
    assert len(p["machine"]) == 2 and set(summary["machine"]) == {"user", "nice", "system", "idle", "steal"}
    assert all(0.0 <= v <= 1.0 for m in p["machine"] for v in m.values())


def test_simultaneous_needs_two_gateways_and_gateways_replaces_trees() -> None:
    for extra in (["--policy", "ttft"], ["--gateways", "a=.:affinity", "--trees", "b=."]):
        argv = [sys.executable, "-m", "tools.bench_proxy", "--simultaneous", *extra]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stdout + done.stderr


def test_ratios_pair_each_round_with_the_base_rounds_and_spread_gives_quartiles() -> None:
    r = TogetherResult(
        "hit",
        runs={
            "a": [run(1, 2, cpu_us_per_request=100.0), run(1, 2, cpu_us_per_request=200.0)],
            "b": [run(1, 2, cpu_us_per_request=110.0), run(1, 2, cpu_us_per_request=180.0)],
        },
    )
    assert r.ratios("a") == {"a": [1.0, 1.0], "b": [pytest.approx(1.1), pytest.approx(0.9)]}
    s = spread([1.0, 2.0, 3.0, 4.0, 5.0])
    assert s == {"median": 3.0, "q1": 1.5, "q3": 4.5, "min": 1.0, "max": 5.0, "n": 5}
    one = spread([2.0])
    assert one is not None and one["q1"] == one["q3"] == 2.0 and spread([]) is None
