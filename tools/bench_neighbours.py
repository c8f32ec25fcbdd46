"""``warmroute bench --scenario noisy-neighbour``: one shared engine, a flood and a person, admission on/off.

One simulated engine runs ``MAX_RUNNING`` requests at a time and queues the rest by vLLM's priority policy
(``--scheduling-policy priority``: lowest ``priority`` first, then arrival; a request without one is 0, so
variants that send none are queued first-come-first-served, as by vLLM's default scheduler). Client A
(key ``flood``) keeps ``FLOOD`` long streams in flight; client B (key ``person``) asks short questions one at
a time. Each variant starts its own gateway:

- ``alone`` / ``alone+admission``: B without A, admission off / on (B's baseline);
- ``flood`` / ``flood+admission``: A and B; with admission A's key is ``batch`` and B's ``interactive``;
- ``flood+admission@headroom``: the same, the batch class leaving the engine's last slot free;
- ``flood+admission@pause``: the same, A's streams preemptible: an interactive turn that finds every slot
  taken pauses A's newest stream (aborted at the engine, resumed later as a continuation of the same turn,
  one uninterrupted stream for A) and takes its slot;
- ``flood+admission@one-class``: A and B in the same class (fair share alone decides).
- ``flood+engine-priority``: the gateway holds nothing back (a bound above A's streams) and tells the
  engine each class's rank as ``priority``: B waits at the head of the engine's own queue instead of the
  gateway's (the engine preempts no running request for it, as vLLM does not for a full batch).

Reported per variant: B's TTFT p50 and p95, B's turns, completion tokens per second over the run (A's and
B's, as the clients counted them; the run includes the drain of A's last requests, whose ragged end idles
slots for a share that is larger the shorter the run), the engine's own completion tokens per second while
B's turns ran (A backlogged throughout: the figure that compares variants' throughput, so admission's cost
shows next to its gain in latency), and the median
time A's streams ran (first token to last): the engine's slot turnover (the time one running request takes
to finish), the bound of B's p95 when A and B share a class.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tools import procs
from tools.bench_rounds import interleaved_rounds, report
from tools.client import StreamResult, stream_chat
from tools.launch import Child, Engine, Launcher, SimProfile
from tools.procs import LOCALHOST, free_port

MODEL = "sim-model"
MAX_RUNNING = 8
FLOOD = 32  # A's streams in flight (the workload: 32+)
FLOOD_TOKENS = 64  # each of A's answers (ignore_eos: exactly this many)
TURN_TOKENS = 8
TURNS = 15  # B's questions per variant
KEYS = {"flood": "key-flood", "person": "key-person", "heavy": "key-heavy", "light": "key-light"}
VARIANTS = (
    "alone",
    "alone+admission",
    "flood",
    "flood+admission",
    "flood+admission@headroom",
    "flood+admission@pause",
    "flood+admission@one-class",
    "flood+engine-priority",
)
SCENARIOS = {
    "noisy-neighbour": "B's TTFT p95 with A <= 1.5x B alone (A batch, B interactive); "
    "one class: B's p95 <= one slot turnover; tokens/s within 5 % of no admission",
}


@dataclass(slots=True)
class Run:
    turns: list[StreamResult]
    flood_tokens: int
    wall_s: float
    flood_running_s: tuple[float, ...] = ()  # each of A's streams, first token to last (a slot held)
    window_tokens: int = 0  # the engine's completion tokens while B's turns ran (A backlogged throughout)
    window_s: float = 0.0


def body(max_tokens: int, text: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def start_engine(launch: Launcher, profile: SimProfile) -> Engine:
    port = free_port()
    argv = procs.python("-m", "backends.sim", "--port", str(port), "--name", "engine-1", "--model", MODEL)
    argv += [*profile.argv(), "--max-running", str(MAX_RUNNING), "--scheduling-policy", "priority"]
    argv += ["--log-level", "warning"]
    child = launch._spawn("engine-1", port, argv)
    launch._wait(child, "/health", procs.ok)
    return Engine(child.name, child.url)


def start_gateway(launch: Launcher, engine: Engine, variant: str, name: str) -> Child:
    port = free_port()
    keys = [{"name": n, "key": k} for n, k in KEYS.items()]
    admission: dict[str, Any] = {"enabled": "+admission" in variant, "max_in_flight": MAX_RUNNING}
    if variant.endswith("+engine-priority"):  # every request reaches the engine, ranked
        admission |= {"enabled": True, "max_in_flight": FLOOD + 8, "engine_priority": [engine.id]}
    if not variant.endswith("@one-class"):
        admission["clients"] = {"flood": "batch", "person": "interactive"}
    if variant.endswith("@headroom"):  # the engine's last slot is kept for interactive turns
        batch = {"max_queued": 1024, "timeout_s": 600, "headroom": 1}
        admission["classes"] = {"interactive": {}, "standard": {}, "batch": batch}
    if variant.endswith("@pause"):  # A's streams give their slot to an interactive turn, and resume
        batch = {"max_queued": 1024, "timeout_s": 600, "preemptible": True}
        admission["classes"] = {"interactive": {}, "standard": {}, "batch": batch}
    config = {
        "server": {"host": LOCALHOST, "port": port, "log_level": "warning"},
        "backends": [{"id": engine.id, "url": engine.url, "models": [MODEL]}],
        "routing": {"policy": "least_loaded"},
        "health": {"interval_s": 1, "timeout_s": 2, "fail_threshold": 2},
        "redis": {"url": None},
        "auth": {"client_keys": keys},
        "admission": admission,
    }
    path = launch.workdir / f"{name}.yaml"
    path.write_text(json.dumps(config))
    child = launch._spawn(name, port, procs.python("-m", "gateway.cli", "serve", "--config", str(path)))
    launch._wait(child, "/readyz", lambda r: r.status_code == 200)
    return child


async def _flood(
    client: httpx.AsyncClient, url: str, stop: asyncio.Event, tokens: list[int], running: list[float]
) -> None:
    headers = {"authorization": f"Bearer {KEYS['flood']}"}
    n = 0
    while not stop.is_set():
        n += 1
        result = await stream_chat(client, url, body(FLOOD_TOKENS, f"summarise document {n}"), headers)
        tokens.append(result.completion_tokens)
        if result.error is None and result.decode_s is not None:
            running.append(result.decode_s)


async def generated(client: httpx.AsyncClient, engine_url: str) -> int:
    """The simulated engine's completion tokens so far (its own counter)."""
    stats = (await client.get(engine_url + "/sim/stats")).json()
    return int(stats["generation_tokens"])


async def run_variant(
    client: httpx.AsyncClient, url: str, variant: str, engine_url: str | None = None
) -> Run:
    stop = asyncio.Event()
    tokens: list[int] = []
    running: list[float] = []
    flooding = variant.startswith("flood")
    floods = [
        asyncio.create_task(_flood(client, url, stop, tokens, running))
        for _ in range(FLOOD if flooding else 0)
    ]
    headers = {"authorization": f"Bearer {KEYS['person']}"}
    t0 = time.monotonic()
    if flooding:
        await asyncio.sleep(2.0)  # the flood fills the engine and its queue first
    turns = []
    before = await generated(client, engine_url) if engine_url else 0
    w0 = time.monotonic()
    for i in range(TURNS):
        turns.append(await stream_chat(client, url, body(TURN_TOKENS, f"question {i}"), headers))
    window_s = time.monotonic() - w0
    window = await generated(client, engine_url) - before if engine_url else 0
    stop.set()
    await asyncio.gather(*floods)
    wall = time.monotonic() - t0
    return Run(turns, sum(tokens), wall, tuple(running), window, window_s if engine_url else 0.0)


def summarize(run: Run) -> dict[str, Any]:
    ttft = sorted(r.ttft_s for r in run.turns if r.error is None and r.ttft_s is not None)
    tokens = run.flood_tokens + sum(r.completion_tokens for r in run.turns)
    return {
        "b_turns": len(ttft),
        "b_errors": len(run.turns) - len(ttft),
        "b_ttft_p50_ms": 1000 * statistics.median(ttft) if ttft else None,
        "b_ttft_p95_ms": 1000 * ttft[max(0, round(0.95 * len(ttft)) - 1)] if ttft else None,
        "tokens_per_s": tokens / run.wall_s,
        "engine_tokens_per_s": run.window_tokens / run.window_s if run.window_s else None,
        "wall_s": run.wall_s,
        "a_running_p50_ms": 1000 * statistics.median(run.flood_running_s) if run.flood_running_s else None,
    }


async def run_scenario(name: str, rounds: int, time_scale: float, profile: SimProfile) -> dict[str, Any]:
    engines: list[Engine] = []

    def engine(launch: Launcher, profile: SimProfile) -> Engine:
        engines.append(start_engine(launch, profile))
        return engines[-1]

    async def run(client: httpx.AsyncClient, url: str, variant: str) -> dict[str, Any]:
        return summarize(await run_variant(client, url, variant, engines[0].url))

    runs = await interleaved_rounds(
        name,
        rounds,
        VARIANTS,
        profile,
        start_engine=engine,
        start_gateway=start_gateway,
        run_variant=run,
        brief=brief,
        max_connections=FLOOD + 8,
    )
    return report(name, SCENARIOS[name], rounds, time_scale, runs)


def brief(result: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())
