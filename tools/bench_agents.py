"""``warmroute bench --scenario claude-code,...``: coding-agent sessions on /v1/messages and /v1/responses.

Each scenario starts its own simulated engines (serial prefill), then runs each variant for a few rounds,
order rotating, prefix caches reset between runs; numbers are medians over rounds
(tools/bench_agents_report.py).
Sessions pause between turns (the agent running a tool: ``AgentSpec.pause_s``, times ``--time-scale``).

- ``claude-code``: Claude Code-shaped sessions on ``/v1/messages``, identical heads (one long system prompt
  and the same tools), an ``x-claude-code-session-id`` per session; 2 engines.
- ``claude-code-billing``: the same with the billing-header first system block, a new nonce every request.
- ``claude-code-billing-kept``: the same on engines that keep that block in the prompt (as llama.cpp does;
  the gateway's backends say ``dialect: llamacpp``): a prefix cache misses from token 0 unless the block is
  stripped before forwarding. The oracle strips it (it knows everything), so it stays the reference.
- ``codex``: Codex-shaped sessions on ``/v1/responses``: full input every turn, ``store: false``,
  ``prompt_cache_key`` and a ``session_id`` header; 2 engines.
- ``responses-chain``: SDK-style chains on ``previous_response_id`` through 2 gateway replicas sharing Redis,
  turns alternating between replicas; engines keep responses in their own process (vLLM's store).
- ``agents-16x4``: 16 Claude Code sessions with one identical head (same task too), distinct session ids,
  4 engines: turn-1 load max/mean.

Variants: gateway policies (``affinity``, ``ttft``, ``policy@key=value;...``), ``oracle`` (session i straight
to engine i mod K, chains to the engine that holds their previous response; ``oracle@shift=1``: to engine
(i + 1) mod K, the same grouping with the engines' labels turned: with every engine seeded alike, as
replicas of one model answer alike, it should match ``oracle``) and
``translated`` (``affinity``, or the policy it names as in ``translated@policy=ttft``, against engines with
the native shape turned off: the gateway must translate; compared with its native twin; the variant says so
and is skipped when the gateway cannot serve it). ``policy%NAME`` runs the gateway of the checkout given as
``--tree NAME=PATH``; ``--seed`` draws other sessions (sizes, pauses, text, session ids). Each run lists
where every session's first turn went and why (``turn1_placement``: which sessions share an engine), and
every request (``records``).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from tools import bench_agents_report as report
from tools import procs
from tools.agent_client import MESSAGES_PATH, RESPONSES_PATH, stream_agent
from tools.agent_workload import (
    AgentSession,
    AgentSpec,
    Head,
    build,
    chain_request,
    codex_request,
    messages_request,
)
from tools.bench_agents_report import AgentRecord
from tools.launch import Child, Engine, Launcher, SimProfile
from tools.procs import LOCALHOST, free_port
from tools.redis_server import RedisServer, find_binary

MODEL = "sim-model"
#: ``--seed``: the sessions' sizes, pauses and text (``AgentSpec.seed``); ``--tree NAME=PATH``: a
#: ``policy%NAME`` variant runs that checkout's gateway (both set from the command line).
SEED: list[int] = [0]
TREES: dict[str, Path] = {}
STAGGER_S = 0.05  # sessions start this far apart (unscaled)
TRANSLATED = report.TRANSLATED
#: Each run's gateways share Redis under a key prefix of their own: the variants of a scenario share one
#: Redis, and a run's pins (same sessions, same keys) would otherwise decide the next run's first turns.
_RUN_IDS = itertools.count()
TRANSLATED_TTFT = f"{TRANSLATED}@policy=ttft"
BILLING_PREFIX = "x-anthropic-billing-header"
SHAPE_FLAG = {"messages": "--no-messages-api", "codex": "--no-responses-api", "chain": "--no-responses-api"}
SHAPE_PATH = {"messages": MESSAGES_PATH, "codex": RESPONSES_PATH, "chain": RESPONSES_PATH}
API_SHAPES = ("chat", "completions", "messages", "responses")  # backends[].native_shapes values
SHAPE_OFF = {"messages": "messages", "codex": "responses", "chain": "responses"}  # what SHAPE_FLAG turns off


@dataclass(frozen=True, slots=True)
class AgentScenario:
    shape: str  # "messages" | "codex" | "chain"
    spec: AgentSpec
    engines: int = 2
    variants: tuple[str, ...] = ("affinity", "ttft", "oracle", TRANSLATED, TRANSLATED_TTFT)
    replicas: int = 1
    target: str = "follow-up TTFT <= 1.05x oracle; 0 follow-ups moved except by a spill or failure"
    engine_flags: tuple[str, ...] = ()  # every engine of the scenario, e.g. ("--keep-billing-block",)
    backend: tuple[tuple[str, Any], ...] = ()  # extra keys of each backend in the gateway config


SCENARIOS: dict[str, AgentScenario] = {
    "claude-code": AgentScenario("messages", AgentSpec()),
    "claude-code-billing": AgentScenario("messages", AgentSpec(billing=True)),
    "claude-code-billing-kept": AgentScenario(
        "messages",
        AgentSpec(billing=True),
        engine_flags=("--keep-billing-block",),
        backend=(("dialect", "llamacpp"),),
    ),
    "codex": AgentScenario("codex", AgentSpec()),
    "responses-chain": AgentScenario(
        "chain",
        AgentSpec(),
        variants=("affinity", "ttft", "oracle"),  # no translated variant: chat engines keep no responses
        replicas=2,
        target="100 % of follow-ups reach the owning engine; 0 404s while the owner lives",
    ),
    "agents-16x4": AgentScenario(
        "messages",
        AgentSpec(sessions=16, shared_task=True),
        engines=4,
        target="turn-1 load max/mean <= 1.2; follow-ups <= 1.05x oracle",
    ),
}


# -- processes ----------------------------------------------------------------------------------------------


def start_engines(
    launch: Launcher, count: int, profile: SimProfile, prefix: str, extra: Sequence[str]
) -> list[Engine]:
    started = []
    for index in range(1, count + 1):
        name, port = f"{prefix}-{index}", free_port()
        argv = procs.python("-m", "backends.sim", "--port", str(port), "--name", name, "--model", MODEL)
        # One seed for all: the engines are replicas of one model, so a prompt gets the same reply wherever it
        # goes (seeded per engine, one grouping's TTFT depended on which engine got which half: 1.25x the
        # oracle's on responses-chain for its own grouping with the labels turned).
        argv += [*profile.argv(), "--prefill-serial", "--seed", "0", "--log-level", "warning", *extra]
        started.append(launch._spawn(name, port, argv))
    for child in started:
        launch._wait(child, "/health", procs.ok)
    return [Engine(c.name, c.url) for c in started]


def backend_keys(sc: AgentScenario, translated: bool) -> tuple[tuple[str, Any], ...]:
    """Extra keys of each backend: the shapes it serves, told to the gateway as an operator would, whatever
    the dialect says. The simulator serves every shape; the translated engines lack the scenario's. (The
    default dialect, ``openai``, has no ``/v1/messages``: left to it, the native Messages variants would be
    translated to chat as well.)"""
    shapes = [s for s in API_SHAPES if not translated or s != SHAPE_OFF[sc.shape]]
    return (*sc.backend, ("native_shapes", shapes))


def _all_ready(response: httpx.Response) -> bool:
    backends = response.json().get("backends", {}) if response.status_code == 200 else {}
    return bool(backends) and all(b.get("state") == "ready" for b in backends.values())


def redis_section(url: str | None) -> dict[str, Any]:
    """The gateway config's ``redis``: a fresh key prefix per run (every replica of one run shares it)."""
    return {"url": url, "prefix": f"warmroute-bench-{next(_RUN_IDS)}:"}


def start_gateway(
    launch: Launcher,
    engines: Sequence[Engine],
    routing: dict[str, Any],
    name: str,
    redis: dict[str, Any],
    backend: Sequence[tuple[str, Any]] = (),
    source: Path | None = None,
) -> Child:
    """``redis``: the config's section (``redis_section``); ``source``: the checkout whose gateway runs
    (None: this one)."""
    port = free_port()
    config = {
        "server": {"host": LOCALHOST, "port": port, "log_level": "warning"},
        "backends": [{"id": e.id, "url": e.url, "models": [MODEL], **dict(backend)} for e in engines],
        "routing": routing,
        "health": {"interval_s": 1, "timeout_s": 2, "fail_threshold": 2},
        "redis": redis,
    }
    path = launch.workdir / f"{name}.yaml"
    path.write_text(json.dumps(config))
    argv = procs.python("-m", "gateway.cli", "serve", "--config", str(path))
    child = launch._spawn(name, port, argv, source)
    launch._wait(child, "/readyz", _all_ready)
    return child


# -- one run ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    sc: AgentScenario
    spec: AgentSpec  # pauses already scaled
    head: Head
    targets: tuple[str, ...]  # gateway replicas, or (oracle) the engines
    oracle: bool
    engine_ids: tuple[str, ...]
    time_scale: float
    shift: int = 0  # the oracle's: session i goes to engine (i + shift) mod K (``oracle@shift=1``)


async def _session(client: httpx.AsyncClient, run: Run, s: AgentSession, t0: float) -> list[AgentRecord]:
    await asyncio.sleep(s.index * STAGGER_S * run.time_scale)
    records: list[AgentRecord] = []
    replies: list[str] = []
    previous: str | None = None
    previous_id: str | None = None
    for turn, pause in enumerate(s.pauses_s):
        await asyncio.sleep(pause)
        path = SHAPE_PATH[run.sc.shape]
        if run.sc.shape == "messages":
            body, headers = messages_request(run.spec, run.head, s, turn, replies, MODEL)
        elif run.sc.shape == "codex":
            body, headers = codex_request(run.spec, run.head, s, turn, replies, MODEL)
        else:
            body, headers = chain_request(run.spec, run.head, s, turn, previous_id, MODEL), {}
        url = _target(run, s.index, turn, previous)
        if run.oracle and "--keep-billing-block" in run.sc.engine_flags:
            body = {**body, "system": [b for b in body["system"] if not b["text"].startswith(BILLING_PREFIX)]}
        started = time.monotonic() - t0
        out = await stream_agent(client, url, path, body, headers)
        records.append(AgentRecord(s.index, turn + 1, started, out, previous))
        if out.result.error is not None:
            return records  # without the reply, the session cannot go on
        replies.append(out.result.reply)
        previous, previous_id = out.result.backend, out.response_id
    return records


def _target(run: Run, session: int, turn: int, previous: str | None) -> str:
    if not run.oracle:
        return run.targets[turn % len(run.targets)]  # replicas take turns (one replica: always it)
    if previous is not None:
        return run.targets[run.engine_ids.index(previous)]
    return run.targets[(session + run.shift) % len(run.targets)]


async def _probe(client: httpx.AsyncClient, url: str, shape: str) -> str | None:
    """Why the gateway cannot serve this shape on these engines, or None when it can."""
    spec = AgentSpec(sessions=1, turns=1, system_tokens=4, tool_tokens=4, task_tokens=4, max_tokens=2)
    head, (session,) = build(spec, "~probe")
    if shape == "messages":
        body, headers = messages_request(spec, head, session, 0, [], MODEL)
    else:
        body, headers = codex_request(spec, head, session, 0, [], MODEL)
    out = await stream_agent(client, url, SHAPE_PATH[shape], body, headers)
    if out.result.error is None:
        return None
    return (
        f"the gateway cannot serve {SHAPE_PATH[shape]} on engines without it yet ({out.result.error[:120]})"
    )


async def run_variant(
    client: httpx.AsyncClient,
    launch: Launcher,
    engine_sets: dict[str, list[Engine]],
    sc: AgentScenario,
    variant: str,
    label: str,
    time_scale: float,
    redis_url: str | None,
) -> dict[str, Any]:
    rest, _, tree = variant.partition("%")
    if tree and tree not in TREES:
        raise SystemExit(f"warmroute bench: variant {variant!r} names tree {tree!r}; give --tree {tree}=PATH")
    name, _, settings = rest.partition("@")
    policy = report.translated_policy(rest) or name
    engines = engine_sets[TRANSLATED if name == TRANSLATED else "native"]
    for e in engines:
        (await client.post(f"{e.url}/reset_prefix_cache")).raise_for_status()
    routing: dict[str, Any] = {"policy": policy, "active_window_s": 10.0 * time_scale,
                               "speed_half_life_s": 15.0 * time_scale}  # fmt: skip
    routing.update({k: yaml.safe_load(v) for k, _, v in (s.partition("=") for s in settings.split(";") if s)})
    backend = backend_keys(sc, translated=name == TRANSLATED)
    gateways = []
    try:
        if policy != report.ORACLE:
            redis = redis_section(redis_url)  # one prefix for this run's replicas
            gateways = [
                start_gateway(launch, engines, routing, f"gw-{label}-{i}", redis, backend, TREES.get(tree))
                for i in range(sc.replicas)
            ]
            if name == TRANSLATED and (why := await _probe(client, gateways[0].url, sc.shape)) is not None:
                return {"skipped": why}
        spec = replace(sc.spec, pause_s=sc.spec.pause_s * time_scale, seed=SEED[0])
        head, sessions = build(spec)
        urls = tuple(g.url for g in gateways) or tuple(e.url for e in engines)
        shift = int(routing.get("shift", 0)) if policy == report.ORACLE else 0
        run = Run(sc, spec, head, urls, not gateways, tuple(e.id for e in engines), time_scale, shift)
        t0 = time.monotonic()
        batches = await asyncio.gather(*(_session(client, run, s, t0) for s in sessions))
        wall = time.monotonic() - t0
    finally:
        for gateway in gateways:
            launch.stop(gateway)
    return report.summarize([r for batch in batches for r in batch], run.engine_ids, wall)


# -- all runs -----------------------------------------------------------------------------------------------


async def _rounds(
    launch: Launcher, sc: AgentScenario, variants: Sequence[str], rounds: int, time_scale: float,
    engine_sets: dict[str, list[Engine]], redis_url: str | None, name: str,
) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    limits = httpx.Limits(max_connections=4 * sc.spec.sessions + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0), trust_env=False) as client:
        for round_ in range(1, rounds + 1):
            shift = (round_ - 1) % len(variants)
            for variant in [*variants[shift:], *variants[:shift]]:
                if runs[variant] and "skipped" in runs[variant][-1]:
                    continue
                label = f"{round_}-{len(runs[variant])}"
                result = await run_variant(
                    client, launch, engine_sets, sc, variant, label, time_scale, redis_url
                )
                print(f"  {name} {variant} round {round_}: {report.brief(result)}", flush=True)
                runs[variant].append(result)
    return runs


def run_scenario(
    name: str, rounds: int, time_scale: float, profile: SimProfile, variants: Sequence[str] = ()
) -> dict[str, Any]:
    sc = SCENARIOS[name]
    chosen = tuple(variants) or sc.variants
    with Launcher(f"warmroute-{name}-") as launch:
        engine_sets = {"native": start_engines(launch, sc.engines, profile, "engine", sc.engine_flags)}
        if any(report.translated_policy(v) for v in chosen):
            engine_sets[TRANSLATED] = start_engines(
                launch, sc.engines, profile, "plain", (SHAPE_FLAG[sc.shape], *sc.engine_flags)
            )
        redis = None
        if sc.replicas > 1:
            binary = find_binary()
            if binary is None:
                raise SystemExit(
                    f"warmroute bench: scenario {name} needs redis-server (replicas share Redis)"
                )
            redis = RedisServer(binary)
            redis.start()
        try:
            url = redis.url if redis else None
            runs = asyncio.run(_rounds(launch, sc, chosen, rounds, time_scale, engine_sets, url, name))
        finally:
            if redis is not None:
                redis.close()
    by_variant = {v: report.medians(rs) for v, rs in runs.items()}
    report.add_ratios(by_variant)
    return {"scenario": name, "target": sc.target, "rounds": rounds, "time_scale": time_scale,
            "spec": str(replace(sc.spec, seed=SEED[0])), "runs": runs, "medians": by_variant}  # fmt: skip
