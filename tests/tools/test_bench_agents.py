import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import httpx
import pytest

from backends.sim import SimConfig, create_sim_app
from tools import bench_agents, bench_agents_report
from tools.agent_client import MESSAGES_PATH, RESPONSES_PATH, AgentResult, stream_agent
from tools.agent_workload import (
    CLAUDE_SESSION_HEADER,
    CODEX_SESSION_HEADER,
    AgentSpec,
    build,
    chain_request,
    codex_request,
    messages_request,
)
from tools.bench_agents_report import AgentRecord
from tools.client import StreamResult

SPEC = AgentSpec(sessions=3, turns=3, system_tokens=40, tool_tokens=5, task_tokens=20, result_tokens=30)
ENGINES = ("e1", "e2")


@pytest.fixture
async def sims() -> AsyncIterator[httpx.AsyncClient]:
    mounts = {
        f"http://{name}": httpx.ASGITransport(app=create_sim_app(SimConfig(name=name, time_scale=0)))
        for name in ENGINES
    }
    async with httpx.AsyncClient(mounts=mounts) as client:
        yield client


def test_claude_code_sessions_share_the_head_and_grow_turn_by_turn() -> None:
    head, sessions = build(replace(SPEC, billing=True))
    first = [messages_request(SPEC, head, s, 0, [], "m") for s in sessions]
    assert len({str(b["tools"]) + str(b["system"]) for b, _ in first}) == 1  # billing is off in SPEC
    assert len({h[CLAUDE_SESSION_HEADER] for _, h in first}) == 3
    assert len({str(b["messages"]) for b, _ in first}) == 3  # own tasks
    billing = replace(SPEC, billing=True)
    turns = [messages_request(billing, head, sessions[0], k, ["r1", "r2"], "m")[0] for k in range(3)]
    nonces = {t["system"][0]["text"].rsplit("cch=", 1)[1] for t in turns}
    assert len(nonces) == 3 and all(
        t["system"][0]["text"].startswith("x-anthropic-billing-header: ") for t in turns
    )
    assert turns[2]["messages"][: len(turns[1]["messages"])] == turns[1]["messages"]
    assert [m["role"] for m in turns[2]["messages"]] == ["user", "assistant", "user", "assistant", "user"]
    assert sessions[0].session_id in turns[0]["metadata"]["user_id"]
    shared = build(replace(SPEC, shared_task=True))[1]
    assert len({s.task for s in shared}) == 1 and len({s.session_id for s in shared}) == 3


def test_codex_sends_the_full_input_with_store_off_and_a_cache_key() -> None:
    head, sessions = build(SPEC)
    body1, headers = codex_request(SPEC, head, sessions[1], 0, [], "m")
    body3, _ = codex_request(SPEC, head, sessions[1], 2, ["a", "b"], "m")
    assert body1["store"] is False and body1["prompt_cache_key"] == headers[CODEX_SESSION_HEADER]
    assert body3["input"][:1] == body1["input"] and len(body3["input"]) == 1 + 2 * 3
    assert [i["type"] for i in body3["input"][1:4]] == ["message", "function_call", "function_call_output"]
    chained = chain_request(SPEC, head, sessions[1], 1, "resp_x", "m")
    assert (
        chained["previous_response_id"] == "resp_x"
        and chained["store"] is True
        and len(chained["input"]) == 1
    )


@pytest.mark.anyio
async def test_client_reads_usage_engine_and_response_id(sims: httpx.AsyncClient) -> None:
    head, (session, *_) = build(SPEC)
    body, headers = messages_request(SPEC, head, session, 0, [], "sim-model")
    out = await stream_agent(sims, "http://e1", MESSAGES_PATH, body, headers)
    again = await stream_agent(sims, "http://e1", MESSAGES_PATH, body, headers)
    r = again.result
    assert r.error is None and r.backend == "e1" and r.ttft_s is not None and r.reply
    assert r.prompt_tokens == out.result.prompt_tokens and r.cached_tokens == (r.prompt_tokens - 1) // 16 * 16
    body, headers = codex_request(SPEC, head, session, 0, [], "sim-model")
    codex = await stream_agent(sims, "http://e2", RESPONSES_PATH, body, headers)
    assert (
        codex.result.error is None
        and codex.response_id is not None
        and codex.response_id.startswith("resp_e2")
    )
    missing = await stream_agent(sims, "http://e1", RESPONSES_PATH, {**body, "previous_response_id": "x"}, {})
    assert missing.status == 404 and missing.result.error is not None


def _run(oracle: bool, shape: str) -> bench_agents.Run:
    head, _ = build(SPEC)
    sc = bench_agents.AgentScenario(shape, SPEC)
    return bench_agents.Run(sc, SPEC, head, tuple(f"http://{e}" for e in ENGINES), oracle, ENGINES, 0.0)


@pytest.mark.anyio
async def test_chains_reach_the_owner_through_the_oracle_and_404_elsewhere(sims: httpx.AsyncClient) -> None:
    _, sessions = build(SPEC)
    oracle = [r for s in sessions for r in await bench_agents._session(sims, _run(True, "chain"), s, 0.0)]
    stats = bench_agents_report.summarize(oracle, ENGINES, 1.0)
    assert stats["requests"] == 9 and stats["not_found"] == 0 and stats["owner_share"] == 1.0
    assert stats["turn1_split"] == [2, 1]  # session i on engine i mod 2
    assert stats["cached_share"] is not None and stats["cached_share"] > 0.5
    # "replicas" that alternate engines blindly: every follow-up lands on the other engine and gets a 404
    blind = [r for s in sessions for r in await bench_agents._session(sims, _run(False, "chain"), s, 0.0)]
    stats = bench_agents_report.summarize(blind, ENGINES, 1.0)
    assert stats["requests"] == 6 and stats["not_found"] == 3 and stats["owner_share"] == 0.0


@pytest.mark.anyio
async def test_messages_sessions_through_the_oracle_stay_put(sims: httpx.AsyncClient) -> None:
    _, sessions = build(SPEC)
    records = [r for s in sessions for r in await bench_agents._session(sims, _run(True, "messages"), s, 0.0)]
    stats = bench_agents_report.summarize(records, ENGINES, 1.0)
    assert (stats["requests"], stats["errors"], stats["moved"], stats["followups"]) == (9, 0, 0, 6)


@pytest.mark.anyio
async def test_the_oracle_strips_a_billing_block_that_the_engines_keep() -> None:
    kept = SimConfig(name="e1", time_scale=0, keep_billing_block=True)
    mounts = {"http://e1": httpx.ASGITransport(app=create_sim_app(kept))}
    head, sessions = build(replace(SPEC, billing=True))
    sc = bench_agents.SCENARIOS["claude-code-billing-kept"]
    async with httpx.AsyncClient(mounts=mounts) as client:
        for oracle, expect_hits in ((False, False), (True, True)):
            run = bench_agents.Run(
                sc, replace(SPEC, billing=True), head, ("http://e1",), oracle, ("e1",), 0.0
            )
            records = await bench_agents._session(client, run, sessions[0], 0.0)
            follow = [r.out.result.cached_tokens or 0 for r in records if r.turn > 1]
            assert len(follow) == 2 and all((c > 0) is expect_hits for c in follow)


def _record(
    session: int, turn: int, backend: str, previous: str | None, route: str = "affinity_hit"
) -> AgentRecord:
    result = StreamResult(
        ttft_s=0.1 * turn, backend=backend, route=route, prompt_tokens=100, cached_tokens=50
    )
    return AgentRecord(session, turn, 0.0, AgentResult(result, 200), previous)


def test_summary_counts_moves_with_reasons_and_turn1_load() -> None:
    records = [
        _record(0, 1, "e1", None),
        _record(0, 2, "e2", "e1", "spill_overload"),
        _record(1, 1, "e1", None),
        _record(1, 2, "e1", "e1"),
        _record(2, 1, "e1", None),
    ]
    stats = bench_agents_report.summarize(records, ("e1", "e2", "e3"), 2.0)
    assert stats["moved"] == 1 and stats["moved_reasons"] == {"spill_overload": 1}
    assert stats["turn1_split"] == [3, 0, 0] and stats["turn1_load_max_mean"] == 3.0
    assert stats["owner_share"] == 0.5 and stats["cached_share"] == 0.5
    assert stats["followup_ttft_ms"] == pytest.approx(200.0)
    # which sessions share an engine, and why each went there
    assert stats["turn1_placement"] == [
        [0, 0, "affinity_hit"],
        [1, 0, "affinity_hit"],
        [2, 0, "affinity_hit"],
    ]
    medians = {"a": bench_agents_report.medians([stats, {**stats, "followup_ttft_ms": 400.0}])}
    medians["oracle"] = bench_agents_report.medians([{**stats, "followup_ttft_ms": 100.0}])
    medians["translated"] = bench_agents_report.medians([{"skipped": "no"}])
    medians["ttft"] = bench_agents_report.medians([{**stats, "followup_ttft_ms": 200.0}])
    medians["translated@policy=ttft"] = bench_agents_report.medians([{**stats, "followup_ttft_ms": 220.0}])
    bench_agents_report.add_ratios(medians)
    assert medians["a"]["vs_oracle"] == pytest.approx(3.0) and medians["a"]["moved_reasons"] == {
        "spill_overload": 2
    }
    assert medians["translated"] == {"skipped": "no"}
    assert medians["translated@policy=ttft"]["vs_native"] == pytest.approx(1.1)  # over its twin, ttft
    assert bench_agents_report.translated_policy("translated") == "affinity"
    assert bench_agents_report.translated_policy("ttft@stay_margin=1") is None


def test_every_agent_scenario_is_known_to_the_bench_command() -> None:
    from tools import bench

    args = bench.parse_args(["--scenario", "agents"])
    assert args.scenario == "agents"
    assert set(bench_agents.SCENARIOS) == {"claude-code", "claude-code-billing", "claude-code-billing-kept",
                                           "codex", "responses-chain", "agents-16x4"}  # fmt: skip
    assert all(
        set(sc.variants) <= {"affinity", "ttft", "oracle", "translated", "translated@policy=ttft"}
        for sc in bench_agents.SCENARIOS.values()
    )


def test_engines_are_configured_with_the_shapes_they_serve_translated_ones_without_the_scenario_s() -> None:
    every = ["chat", "completions", "messages", "responses"]
    # Native engines serve every shape, whatever their dialect lists (the default, openai, has no Messages).
    for sc in bench_agents.SCENARIOS.values():
        assert dict(bench_agents.backend_keys(sc, translated=False))["native_shapes"] == every
    kept = bench_agents.SCENARIOS["claude-code-billing-kept"]
    assert bench_agents.backend_keys(kept, translated=False) == (
        ("dialect", "llamacpp"),
        ("native_shapes", every),
    )
    assert dict(bench_agents.backend_keys(kept, translated=True)) == {
        "dialect": "llamacpp",  # whose own list has messages: native_shapes overrides it
        "native_shapes": ["chat", "completions", "responses"],
    }
    codex = dict(bench_agents.backend_keys(bench_agents.SCENARIOS["codex"], translated=True))
    assert codex == {"native_shapes": ["chat", "completions", "messages"]}


def test_the_seed_and_a_tree_reach_the_agent_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--seed`` is the sessions' seed; ``policy%NAME`` without ``--tree NAME=PATH`` is refused."""
    from tools import bench

    monkeypatch.setattr(bench_agents, "SEED", [0])  # restored after: the command line sets it in place
    started: list[str] = []
    monkeypatch.setattr(
        bench_agents, "run_scenario", lambda name, *_: started.append(name) or {"medians": {}}
    )
    assert bench.main(["--scenario", "codex", "--seed", "7", "--no-plot"]) == 0
    assert bench_agents.SEED == [7] and started == ["codex"]
    sc = bench_agents.SCENARIOS["codex"]
    run = bench_agents.run_variant(None, None, {"native": []}, sc, "ttft%main", "1", 1.0, None)  # type: ignore[arg-type]
    with pytest.raises(SystemExit, match="give --tree main=PATH"):
        asyncio.run(run)


def test_each_run_keeps_its_shared_state_under_a_prefix_of_its_own() -> None:
    """The variants of a scenario share one Redis: a run's pins (same sessions, same keys) must not place
    the next run's first turns, so every run's replicas get one fresh key prefix."""
    first, second = bench_agents.redis_section("redis://x"), bench_agents.redis_section("redis://x")
    assert first["url"] == second["url"] == "redis://x"
    assert first["prefix"] != second["prefix"]
    assert bench_agents.redis_section(None)["url"] is None


def test_the_shifted_oracle_turns_the_engines_labels() -> None:
    """``oracle@shift=1``: session i to engine (i + 1) mod K, first turns only (a chain follows its owner)."""
    plain, shifted = _run(True, "codex"), replace(_run(True, "codex"), shift=1)
    assert [bench_agents._target(plain, s, 0, None) for s in range(4)] == ["http://e1", "http://e2"] * 2
    assert [bench_agents._target(shifted, s, 0, None) for s in range(4)] == ["http://e2", "http://e1"] * 2
    assert bench_agents._target(shifted, 0, 1, "e1") == "http://e1"
