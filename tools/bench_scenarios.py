"""``warmroute bench --scenario NAME``: routing v2's scenarios on simulated engines, against their targets.

Every scenario starts its own simulated engines (serial prefill: a queue is real there), then runs each
variant (a policy, optionally given the engines' true speeds as weights (``+weights``), subscribed to
the engines' KV cache events (``+kv``: ``--kv-events`` adds ``ttft+kv`` to every scenario), or with
admission on (``+admission``: every backend admits as many requests as the simulated engine runs at once,
``--max-running``, the rest waiting in the gateway; no client keys, so one class and one client);
``oracle`` sends conversation i straight to engine i mod K; ``oracle@shift=1``: to engine (i + 1) mod K, the
same grouping with the engines' labels turned) for a few rounds, order rotating, caches reset
between runs. Numbers are medians over rounds; ratios compare variants of the same round set on the same
machine. ``cold_followups`` counts follow-ups served by another engine than the conversation's previous
turn (moved); ``missed_followups`` those whose engine had less than ``MISSED_SHARE`` of the previous turn's
prompt cached (a re-prefill, wherever served); with admission on, ``queued`` counts requests that waited
in the gateway's queue longer than 5 ms and ``queued_ms_mean`` the mean wait over all admitted requests
(the gateway's ``warmroute_admission_wait_seconds``).
``policy@key=value;…`` adds routing settings; ``policy%NAME`` runs the gateway from the checkout given as
``--tree NAME=PATH``, so two versions of the routing code are compared within one run.

- ``identical-GxN``: G groups of N conversations sharing system prompt *and* first user message (N = 4, 8,
  16, 32); each later turn adds ~600 tokens, ~3000 in the ``-long`` twins.
- ``sessions``: 16 agent sessions of one identical head, each with its own session id (its own key).
- ``pressure``: engines whose caches together hold about half of the active conversations (two small, two
  large): placement must weigh what each engine can keep.
- ``fleet``: one shared system prompt, own task; ``distinct``: own system prompts.
- ``hetero``: engines with prefill/decode speeds 1:1:2:4; no weights vs the true ones.
- ``join``: the last engine is down at the start and comes back empty a third of the way in.
- ``slow``: the first engine slows 4x a third of the way in.
- ``noisy-neighbour``: admission on one engine, a flood and a person (tools/bench_neighbours.py).
- ``fair-share``: two clients of one class, demand 4:1, admission off and on (tools/bench_fairness.py).
- ``claude-code``, ``claude-code-billing``, ``claude-code-billing-kept``, ``codex``, ``responses-chain``,
  ``agents-16x4`` (or ``agents`` for all six): coding-agent sessions on /v1/messages and /v1/responses
  (tools/bench_agents.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import yaml

from tools import bench_agents, bench_agents_report, bench_fairness, bench_neighbours, procs
from tools.bench_report import TurnRecord
from tools.bench_run import Plan, Tally, Target, play
from tools.launch import Child, Engine, Launcher, SimProfile
from tools.procs import LOCALHOST, free_port
from tools.workload import WorkloadSpec, build, total_requests

MODEL = "sim-model"
SESSION_HEADER = "x-session-id"  # the gateway's default session header
JOIN_WINDOW_S = 60.0  # "the following minute", in unscaled time
SLOW_WINDOW_S = 30.0
EVENT_AT_S = float(os.environ.get("WARMROUTE_BENCH_EVENT_AT_S", "8"))  # the join or slow-down (unscaled s)
ROUTING_OVERRIDES: dict[str, Any] = {}  # ``--routing KEY=VALUE`` of the command line, for every gateway
VARIANTS: list[str] = []  # ``--variants``: replaces every scenario's own list
KV_EVENTS: list[bool] = [False]  # ``--kv-events``: every scenario also runs ``ttft+kv``
MISSED_SHARE = 0.9  # a follow-up whose engine had less of the previous turn's prompt cached re-read it
TREES: dict[str, Path] = {}  # ``--tree NAME=PATH``: ``policy%NAME`` runs that checkout's gateway
gateways_started: list[str] = []


@dataclass(frozen=True, slots=True)
class Scenario:
    spec: WorkloadSpec
    variants: tuple[str, ...] = ("affinity", "ttft", "oracle")
    speeds: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)
    event: str | None = None  # "join" | "slow"
    target: str = ""
    caches: tuple[int, ...] | None = None  # each engine's prefix cache (tokens); None: the profile's
    sessions: bool = False  # each conversation sends its own session id


_BASE = WorkloadSpec(
    conversations=32,
    turns=4,
    system_tokens=1000,
    context_tokens=1500,
    user_tokens=600,
    max_tokens=32,
    hot_fraction=0.0,
    think_ms=300.0,
    system_prompts=1,
)
_IDENTICAL = "follow-up TTFT <= 1.05x oracle; 0 cold follow-ups where the oracle has 0"
_LONG_TURNS = 3000


def _identical(group: int, user_tokens: int) -> Scenario:
    return Scenario(replace(_BASE, group_size=group, user_tokens=user_tokens), target=_IDENTICAL)


SCENARIOS: dict[str, Scenario] = {
    **{f"identical-{32 // n}x{n}": _identical(n, _BASE.user_tokens) for n in (4, 8, 16, 32)},
    **{f"identical-{32 // n}x{n}-long": _identical(n, _LONG_TURNS) for n in (4, 8, 16, 32)},
    "sessions": Scenario(
        replace(_BASE, conversations=16, group_size=16),
        sessions=True,
        target="turn-1 load max/mean <= 1.2 (one head, 16 session ids)",
    ),
    "pressure": Scenario(
        replace(_BASE, system_prompts=32),
        caches=(3000, 3000, 16000, 16000),
        target="follow-up TTFT <= 0.9x affinity",
    ),
    "fleet": Scenario(_BASE, target="<= 1.05x oracle, 0 cold follow-ups"),
    "distinct": Scenario(replace(_BASE, system_prompts=32), target="<= 1.05x oracle, 0 cold follow-ups"),
    "hetero": Scenario(
        replace(_BASE, system_prompts=32),
        ("ttft", "ttft+weights", "affinity", "affinity+weights"),
        speeds=(1.0, 1.0, 2.0, 4.0),
        target="mean TTFT (ttft, no weights) <= 1.10x ttft+weights",
    ),
    "join": Scenario(
        replace(_BASE, conversations=192, system_prompts=192),
        ("affinity", "ttft"),
        event="join",
        target="joined engine <= 1.5x its fair share of new conversations in the next minute; "
        "0 cold follow-ups",
    ),
    "slow": Scenario(
        replace(_BASE, conversations=192, system_prompts=192),
        ("affinity", "ttft"),
        event="slow",
        target="slowed engine's share of new conversations falls within 30 s",
    ),
}


# -- processes ----------------------------------------------------------------------------------------------


EXTRAS = frozenset({"weights", "kv", "admission"})


def _extras(variant: str) -> set[str]:
    """``weights``, ``kv`` and/or ``admission`` of ``policy+weights+kv+admission@settings%tree``."""
    extras = set(variant.partition("%")[0].partition("@")[0].split("+")[1:])
    if unknown := extras - EXTRAS:
        raise SystemExit(f"warmroute bench: unknown variant extras {sorted(unknown)} in {variant!r}")
    return extras


def admission_config(max_in_flight: int) -> dict[str, Any]:
    """``+admission``: what a user would write for these engines: each backend's bound is its engine's
    batch (the simulator's ``--max-running``, vLLM's ``max_num_seqs``); one class (no client keys)."""
    return {"enabled": True, "max_in_flight": max_in_flight}


def parse_variant(variant: str) -> tuple[str, set[str], dict[str, Any], Path | None]:
    """``policy[+weights][+kv][+admission][@key=value;key=value][%tree]``: the policy, its extras, the extra
    routing settings, and the checkout (``--tree``) whose gateway runs it (None: this one). Settings and
    trees make variants of one policy, so two versions of the routing code are compared within one run."""
    rest, _, tree = variant.partition("%")
    name, _, settings = rest.partition("@")
    overrides = {k: yaml.safe_load(v) for k, _, v in (s.partition("=") for s in settings.split(";") if s)}
    if tree and tree not in TREES:
        raise SystemExit(f"warmroute bench: variant {variant!r} names tree {tree!r}; give --tree {tree}=PATH")
    return name.partition("+")[0], _extras(variant), overrides, TREES[tree] if tree else None


def start_engines(launch: Launcher, sc: Scenario, profile: SimProfile) -> list[Engine]:
    """The scenario's engines; they publish KV cache events when a variant subscribes to them."""
    started, endpoints = [], []
    kv = any("kv" in _extras(v) for v in sc.variants)
    caches = sc.caches or (profile.cache_tokens,) * len(sc.speeds)
    for index, (speed, cache) in enumerate(zip(sc.speeds, caches, strict=True), 1):
        name, port = f"engine-{index}", free_port()
        p = replace(profile, prefill_tps=profile.prefill_tps * speed, decode_tps=profile.decode_tps * speed)
        p = replace(p, cache_tokens=cache)
        argv = launch_python("-m", "backends.sim", "--port", str(port), "--name", name, "--model", MODEL)
        # One seed for all: the engines are replicas of one model, so a prompt gets the same reply wherever it
        # goes (seeded per engine, one grouping's TTFT depended on which engine got which conversations).
        argv += [*p.argv(), "--prefill-serial", "--seed", "0", "--log-level", "warning"]
        endpoint = f"tcp://{LOCALHOST}:{free_port()}" if kv else None
        if endpoint is not None:
            argv += ["--kv-events-endpoint", endpoint]
        endpoints.append(endpoint)
        started.append(launch._spawn(name, port, argv))
    for child in started:
        launch._wait(child, "/health", _ok)
    return [Engine(c.name, c.url, endpoint) for c, endpoint in zip(started, endpoints, strict=True)]


def launch_python(*args: str) -> list[str]:
    return procs.python(*args)


def _ok(response: httpx.Response) -> bool:
    return response.status_code == 200


def start_gateway(
    launch: Launcher,
    engines: Sequence[Engine],
    policy: str,
    weights: Sequence[float] | None,
    time_scale: float,
    name: str,
    overrides: dict[str, Any] | None = None,
    kv_events: bool = False,
    admission: int | None = None,
    source: Path | None = None,
) -> Child:
    """A gateway in front of ``engines``; ``admission``: on, each backend admitting that many at once."""
    port = free_port()
    backends = [
        {"id": e.id, "url": e.url, "models": [MODEL], **({"weight": w} if weights else {}),
         **({"kv_events": {"endpoint": e.kv_endpoint}} if kv_events and e.kv_endpoint else {})}
        for e, w in zip(engines, weights or [1.0] * len(engines), strict=True)
    ]  # fmt: skip
    routing = {"policy": policy, "active_window_s": 10.0 * time_scale, "speed_half_life_s": 15.0 * time_scale}
    routing.update(ROUTING_OVERRIDES)
    routing.update(overrides or {})
    config = {
        "server": {"host": LOCALHOST, "port": port, "log_level": "warning"},
        "backends": backends,
        "routing": routing,
        "health": {"interval_s": 1, "timeout_s": 2, "fail_threshold": 2},
        "redis": {"url": None},
    }
    if admission is not None:
        config["admission"] = admission_config(admission)
    path = launch.workdir / f"{name}.yaml"
    path.write_text(json.dumps(config))
    argv = launch_python("-m", "gateway.cli", "serve", "--config", str(path))
    child = launch._spawn(name, port, argv, source)
    launch._wait(child, "/readyz", lambda r: r.status_code in (200, 503))
    return child


async def _backend_state(client: httpx.AsyncClient, gateway: Child, backend: str) -> str | None:
    try:
        doc = (await client.get(f"{gateway.url}/readyz")).json()
    except (httpx.HTTPError, ValueError):
        return None
    state = doc.get("backends", {}).get(backend, {}).get("state")
    return str(state) if state is not None else None


async def _until_state(client: httpx.AsyncClient, gateway: Child, backend: str, wanted: set[str]) -> None:
    for _ in range(200):
        if await _backend_state(client, gateway, backend) in wanted:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{backend} never reached {wanted}")


async def _faults(client: httpx.AsyncClient, engine: Engine, **patch: Any) -> None:
    (await client.post(f"{engine.url}/sim/faults", json=patch)).raise_for_status()


# -- one run ------------------------------------------------------------------------------------------------


async def run_variant(
    client: httpx.AsyncClient,
    launch: Launcher,
    engines: list[Engine],
    sc: Scenario,
    variant: str,
    round_: int,
    time_scale: float,
    max_running: int,
) -> dict[str, Any]:
    policy, extras, overrides, source = parse_variant(variant)
    for e in engines:
        await client.delete(f"{e.url}/sim/faults")
        (await client.post(f"{e.url}/reset_prefix_cache")).raise_for_status()
    gateway = None
    if policy == "oracle":
        turned = oracle_engines(engines, int(overrides.get("shift", 0)))
        target = Target(tuple(e.url for e in turned), tuple(e.id for e in turned))
    else:
        gateway = start_gateway(
            launch,
            engines,
            policy,
            sc.speeds if "weights" in extras else None,
            time_scale,
            f"gw-{round_}-{len(gateways_started)}",
            overrides,
            kv_events="kv" in extras,
            admission=max_running if "admission" in extras else None,
            source=source,
        )
        gateways_started.append(variant)
        await _until_state(client, gateway, engines[-1].id, {"ready"})
        target = Target((gateway.url,))
    try:
        spec = replace(sc.spec, think_ms=sc.spec.think_ms * time_scale)
        session = SESSION_HEADER if sc.sessions else None
        plan = Plan(spec, tuple(engines), MODEL, 16, {}, {}, None, 3600.0, True, session)
        conversations = build(spec)
        if sc.event == "join" and gateway is not None:
            await _faults(client, engines[-1], health_fail=True)
            await _until_state(client, gateway, engines[-1].id, {"down"})
        t0 = time.monotonic()
        event = asyncio.create_task(_event(client, sc, engines, gateway, time_scale))
        records = await play(
            client, target, conversations, plan, (variant, round_), Tally(total_requests(conversations))
        )
        event_at = await event if event.done() else None
        event.cancel()
        wall = time.monotonic() - t0
        reasons = await _reasons(client, gateway) if gateway is not None else {}
        learned = await _learned_tps(client, gateway, engines) if gateway is not None else {}
        queued = await _queued(client, gateway) if "admission" in extras and gateway is not None else {}
    finally:
        if gateway is not None:
            launch.stop(gateway)
    summary = summarize(records, engines, sc, event_at, wall, time_scale)
    return {**summary, **queued, "reasons": reasons, **learned}


def oracle_engines(engines: Sequence[Engine], shift: int) -> list[Engine]:
    """The oracle's engines in slot order: conversation i goes to slot i mod K, so ``oracle@shift=S`` sends it
    to engine (i + S) mod K: the oracle's grouping with the engines' labels turned."""
    at = shift % len(engines)
    return [*engines[at:], *engines[:at]]


async def _reasons(client: httpx.AsyncClient, gateway: Child) -> dict[str, int]:
    """The gateway's routing decisions by reason (non-zero ones)."""
    text = (await client.get(f"{gateway.url}/metrics")).text
    out = {}
    for line in text.splitlines():
        if line.startswith("warmroute_routing_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            if (n := int(float(line.rsplit(" ", 1)[1]))) > 0:
                out[reason] = n
    return out


async def _learned_tps(
    client: httpx.AsyncClient, gateway: Child, engines: Sequence[Engine]
) -> dict[str, Any]:
    """The prefill rate the gateway learned per engine by the end of the run (ttft policy; tokens/s)."""
    return {"learned_tps": learned_from_metrics((await client.get(f"{gateway.url}/metrics")).text, engines)}


def learned_from_metrics(text: str, engines: Sequence[Engine]) -> list[int]:
    prefix = "warmroute_backend_prefill_tokens_per_second{"
    rates: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            backend = line.split('backend="', 1)[1].split('"', 1)[0]
            rates[backend] = float(line.rsplit(" ", 1)[1])
    return [round(rates.get(e.id, 0.0)) for e in engines]


async def _queued(client: httpx.AsyncClient, gateway: Child) -> dict[str, Any]:
    """Admitted requests' wait in the gateway's queue (``warmroute_admission_wait_seconds``, all classes)."""
    return queued_from_metrics((await client.get(f"{gateway.url}/metrics")).text)


def queued_from_metrics(text: str) -> dict[str, Any]:
    prefix = "warmroute_admission_wait_seconds"
    admitted = 'outcome="admitted"'
    total = count = fast = 0.0
    for line in text.splitlines():
        if not line.startswith(prefix) or admitted not in line:
            continue
        value = float(line.rsplit(" ", 1)[1])
        if line.startswith(prefix + "_sum"):
            total += value
        elif line.startswith(prefix + "_count"):
            count += value
        elif line.startswith(prefix + "_bucket") and 'le="0.005"' in line:
            fast += value
    return {
        "admitted": int(count),
        "queued": int(count - fast),  # waited longer than 5 ms
        "queued_ms_mean": 1000 * total / count if count else None,
        "queued_s_total": total,
    }


async def _event(
    client: httpx.AsyncClient, sc: Scenario, engines: list[Engine], gateway: Child | None, time_scale: float
) -> float | None:
    if sc.event is None:
        return None
    t0 = time.monotonic()
    await asyncio.sleep(EVENT_AT_S * time_scale)
    if sc.event == "slow":
        await _faults(client, engines[0], slow_factor=4.0)
    elif sc.event == "join":
        (await client.post(f"{engines[-1].url}/reset_prefix_cache")).raise_for_status()
        await _faults(client, engines[-1], health_fail=False)
        if gateway is not None:
            await _until_state(client, gateway, engines[-1].id, {"ready"})
    return time.monotonic() - t0


def summarize(
    records: Sequence[TurnRecord],
    engines: Sequence[Engine],
    sc: Scenario,
    event_at: float | None,
    wall: float,
    time_scale: float,
) -> dict[str, Any]:
    ok = [r for r in records if r.result.error is None and r.result.ttft_s is not None]
    ttft = [r.result.ttft_s for r in ok if r.result.ttft_s is not None]
    first = sorted(r.result.ttft_s for r in ok if r.turn == 1 and r.result.ttft_s is not None)
    follow = [r.result.ttft_s for r in ok if r.turn > 1 and r.result.ttft_s is not None]
    per_engine = Counter(r.result.backend for r in ok)
    counts = [per_engine.get(e.id, 0) for e in engines]
    firsts = Counter(r.result.backend for r in ok if r.turn == 1)
    first_counts = [firsts.get(e.id, 0) for e in engines]
    out: dict[str, Any] = {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "wall_s": wall,
        "ttft_mean_ms": 1000 * statistics.fmean(ttft) if ttft else None,
        "followup_ttft_mean_ms": 1000 * statistics.fmean(follow) if follow else None,
        "turn1_p95_ms": 1000 * first[max(0, round(0.95 * len(first)) - 1)] if first else None,
        "load_max_mean": max(counts) / statistics.fmean(counts) if any(counts) else None,
        "turn1_load_max_mean": max(first_counts) / statistics.fmean(first_counts)
        if any(first_counts)
        else None,
        "split": counts,
        "cold_followups": sum(1 for r in ok if r.warm is False),  # moved: another engine than the last turn
        "missed_followups": _missed(ok),
        # prefill work the engines did (usage: prompt - cached), thousands of tokens
        "uncached_ktok": sum((r.result.prompt_tokens or 0) - (r.result.cached_tokens or 0) for r in ok)
        / 1000,
    }
    out.update(trace(records, engines))
    if event_at is not None:
        out.update(_event_shares(ok, engines, sc, event_at, time_scale))
    return out


def trace(records: Sequence[TurnRecord], engines: Sequence[Engine]) -> dict[str, Any]:
    """Which engine served each turn of each conversation (the grouping: which conversations shared an
    engine), in the json only: ``grouping``, per engine, the conversations whose first turn it served (in
    the order they started); ``turns``, per conversation and turn: its start (s since the run's), the
    engine's number (1-based; 0: none, an error), the route (the gateway's reason; "" from the oracle) and
    the TTFT in ms."""
    number = {e.id: i for i, e in enumerate(engines, 1)}
    by_conversation: dict[int, list[TurnRecord]] = {}
    for r in records:
        by_conversation.setdefault(r.conversation, []).append(r)
    turns: list[dict[str, Any]] = []
    for conversation, rs in sorted(by_conversation.items()):
        rs.sort(key=lambda r: r.turn)
        turns.append({
            "conversation": conversation,
            "start_s": [round(r.started_s, 3) for r in rs],
            "engines": [number.get(r.result.backend or "", 0) for r in rs],
            "routes": [r.result.route or "" for r in rs],
            "ttft_ms": [None if r.result.ttft_s is None else round(1000 * r.result.ttft_s, 1) for r in rs],
        })  # fmt: skip
    grouping: list[list[int]] = [[] for _ in engines]
    for t in sorted(turns, key=lambda t: t["start_s"][0]):
        if t["engines"] and t["engines"][0] > 0:
            grouping[t["engines"][0] - 1].append(t["conversation"])
    return {"grouping": grouping, "turns": turns}


def _missed(ok: Sequence[TurnRecord]) -> int:
    """Follow-ups whose engine had less than ``MISSED_SHARE`` of the previous turn's prompt cached."""
    prompts = {(r.conversation, r.turn): r.result.prompt_tokens for r in ok}
    missed = 0
    for r in ok:
        before = prompts.get((r.conversation, r.turn - 1)) if r.turn > 1 else None
        if before and (r.result.cached_tokens or 0) < MISSED_SHARE * before:
            missed += 1
    return missed


def _max_mean(counts: Sequence[int]) -> float | None:
    return max(counts) / statistics.fmean(counts) if any(counts) else None


def _event_shares(
    ok: Sequence[TurnRecord], engines: Sequence[Engine], sc: Scenario, at: float, time_scale: float
) -> dict[str, Any]:
    firsts = [(r.started_s, r.result.backend) for r in ok if r.turn == 1]
    if sc.event == "join":
        who, window = engines[-1].id, JOIN_WINDOW_S * time_scale
        after = [b for t, b in firsts if at <= t < at + window]
        joined = _share(after, who)
        return {
            "new_after": len(after),
            "joined_share": joined,
            "joined_vs_fair": joined * len(engines) if joined is not None else None,
        }
    who, window = engines[0].id, SLOW_WINDOW_S * time_scale
    before = [b for t, b in firsts if t < at]
    later = [b for t, b in firsts if t >= at + window]
    during = [b for t, b in firsts if at <= t < at + window]
    return {
        "slowed_share_before": _share(before, who),
        "slowed_share_first_30s": _share(during, who),
        "slowed_share_after_30s": _share(later, who),
        "new_after_30s": len(later),
    }


def _share(backends: list[str | None], who: str) -> float | None:
    return sum(1 for b in backends if b == who) / len(backends) if backends else None


# -- all runs -----------------------------------------------------------------------------------------------


async def run_scenario(name: str, rounds: int, time_scale: float, profile: SimProfile) -> dict[str, Any]:
    sc = SCENARIOS[name]
    if VARIANTS:
        sc = replace(sc, variants=tuple(VARIANTS))
    elif KV_EVENTS[0] and "ttft" in sc.variants:
        at = sc.variants.index("ttft") + 1
        sc = replace(sc, variants=(*sc.variants[:at], "ttft+kv", *sc.variants[at:]))
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in sc.variants}
    with Launcher(f"warmroute-{name}-") as launch:
        engines = start_engines(launch, sc, profile)
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0)) as client:
            for round_ in range(1, rounds + 1):
                shift = (round_ - 1) % len(sc.variants)
                for variant in [*sc.variants[shift:], *sc.variants[:shift]]:
                    result = await run_variant(
                        client, launch, engines, sc, variant, round_, time_scale, profile.max_running
                    )
                    print(f"  {name} {variant} round {round_}: {_brief(result)}", flush=True)
                    runs[variant].append(result)
    return {
        "scenario": name,
        "target": sc.target,
        "rounds": rounds,
        "time_scale": time_scale,
        "spec": str(sc.spec),
        "runs": runs,
        "medians": {v: _medians(rs) for v, rs in runs.items()},
    }


def _brief(result: dict[str, Any]) -> str:
    keys = (
        "ttft_mean_ms",
        "followup_ttft_mean_ms",
        "turn1_p95_ms",
        "load_max_mean",
        "turn1_load_max_mean",
        "cold_followups",
        "missed_followups",
        "queued",
        "queued_ms_mean",
        "uncached_ktok",
        "joined_vs_fair",
        "slowed_share_before",
        "slowed_share_after_30s",
        "split",
        "learned_tps",
        "reasons",
        "errors",
    )
    return ", ".join(f"{k}={_fmt(result[k])}" for k in keys if k in result)


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _medians(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
        if isinstance(value, (int, float)) and values:
            out[key] = statistics.median(values)
    return out


def main(names: Sequence[str], rounds: int, time_scale: float, profile: SimProfile, out: str | None) -> int:
    results = []
    known = [*SCENARIOS, *bench_neighbours.SCENARIOS, *bench_fairness.SCENARIOS, *bench_agents.SCENARIOS]
    names = [n for name in names for n in (bench_agents.SCENARIOS if name == "agents" else [name])]
    for name in names:
        if name not in known:
            raise SystemExit(f"warmroute bench: unknown scenario {name!r}; known: {', '.join(known)}, agents")
        print(f"== scenario {name} ({rounds} rounds, time scale {time_scale}) ==", flush=True)
        if name in bench_agents.SCENARIOS:  # coding agents: their own sessions, shapes and oracle
            bench_agents.TREES.update(TREES)
            result = bench_agents.run_scenario(name, rounds, time_scale, profile, VARIANTS)
            brief = bench_agents_report.brief
        elif name in bench_neighbours.SCENARIOS:  # admission: its own clients, not conversations
            result = asyncio.run(bench_neighbours.run_scenario(name, rounds, time_scale, profile))
            brief = bench_neighbours.brief
        elif name in bench_fairness.SCENARIOS:
            result = asyncio.run(bench_fairness.run_scenario(name, rounds, time_scale, profile))
            brief = bench_fairness.brief
        else:
            result = asyncio.run(run_scenario(name, rounds, time_scale, profile))
            brief = _brief
        results.append(result)
        for variant, med in result["medians"].items():
            print(f"  median {variant}: {brief(med)}", flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    return 0
