"""Running one policy against the engines: the closed-loop client, progress lines, engine readings.

Used by ``tools.bench`` (the command line); one ``run_policy`` call is one policy in one round.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import httpx

from tools import bench_report as report
from tools.bench_engines import LoadSampler, imbalance, read_cache_counters, reset_prefix_caches
from tools.client import chat_body, stream_chat
from tools.launch import Engine, Launcher
from tools.workload import Conversation, WorkloadSpec, build, total_requests

STAGGER_S = 0.02  # streams start this far apart, so the first turns do not arrive as one burst


@dataclass(frozen=True, slots=True)
class Target:
    """Where a conversation's turns go: one gateway, or (oracle) engine i mod K for conversation i."""

    urls: tuple[str, ...]
    engine_ids: tuple[str, ...] = ()

    def for_conversation(self, index: int) -> tuple[str, str | None]:
        slot = index % len(self.urls)
        return self.urls[slot], self.engine_ids[slot] if self.engine_ids else None


@dataclass(slots=True)
class Tally:
    total: int
    done: int = 0
    errors: int = 0
    skipped: int = 0


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a run needs that does not change between runs."""

    spec: WorkloadSpec
    engines: tuple[Engine, ...]
    model: str
    concurrency: int
    headers: Mapping[str, str]
    routing: Mapping[str, Any]
    api_key: str | None
    progress_s: float
    seeded: bool = False  # each conversation sends its own sampling ``seed`` (twins' replies differ)
    #: Each conversation sends its own session id in this header (agent sessions: one session key each).
    session_header: str | None = None


class Outcome(NamedTuple):
    isolation: str  # "reset" or "salt"
    runs: dict[str, list[report.RunStats]]
    records: list[report.TurnRecord]


# -- one run ----------------------------------------------------------------------------------------------


async def play(
    client: httpx.AsyncClient,
    target: Target,
    conversations: Sequence[Conversation],
    plan: Plan,
    label: tuple[str, int],
    tally: Tally,
) -> list[report.TurnRecord]:
    """Closed loop: ``plan.concurrency`` streams, each playing whole conversations one after another."""
    pending = deque(conversations)
    records: list[report.TurnRecord] = []
    t0 = time.monotonic()

    async def conversation(conv: Conversation) -> None:
        url, fixed_engine = target.for_conversation(conv.index)
        replies: list[str] = []
        previous: str | None = None
        for k, pause in enumerate(conv.pauses_s):
            if pause:
                await asyncio.sleep(pause)
            body = chat_body(plan.model, conv.messages(k, replies), plan.spec.max_tokens)
            if plan.seeded:
                body["seed"] = conv.index
            started = time.monotonic() - t0
            headers = plan.headers
            if plan.session_header is not None:
                headers = {**headers, plan.session_header: f"session-{conv.index}"}
            result = await stream_chat(client, url, body, headers)
            if fixed_engine is not None:
                result.backend = fixed_engine
            warm = None if k == 0 or previous is None else result.backend == previous
            records.append(report.TurnRecord(*label, conv.index, k + 1, conv.hot, started, result, warm))
            tally.done += 1
            if result.error is not None:
                tally.errors += 1
                tally.skipped += len(conv.pauses_s) - k - 1  # without the reply, the history cannot go on
                return
            replies.append(result.reply)
            previous = result.backend

    async def stream(index: int) -> None:
        await asyncio.sleep(index * STAGGER_S)
        while pending:
            await conversation(pending.popleft())

    await asyncio.gather(*(stream(i) for i in range(min(plan.concurrency, len(conversations)))))
    return records


async def _progress(tally: Tally, label: str, every_s: float) -> None:
    started = time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        print(f"  [{label}] {tally.done}/{tally.total} requests, {tally.errors} errors, "
              f"{time.monotonic() - started:.0f} s", flush=True)  # fmt: skip


async def run_policy(
    client: httpx.AsyncClient,
    launch: Launcher,
    plan: Plan,
    policy: str,
    round_: int,
    conversations: Sequence[Conversation],
) -> tuple[report.RunStats, list[report.TurnRecord]]:
    gateway = None
    if policy == report.ORACLE:
        target = Target(tuple(e.url for e in plan.engines), tuple(e.id for e in plan.engines))
    else:
        gateway = launch.start_gateway(
            plan.engines,
            plan.model,
            policy,
            routing=dict(plan.routing),
            api_key=plan.api_key,
            name=f"gw-{policy}",
        )
        target = Target((gateway.url,))
    tally = Tally(total_requests(list(conversations)))
    try:
        before = await read_cache_counters(client, plan.engines, plan.headers)
        sampler = LoadSampler(client, plan.engines, plan.headers)
        stop = asyncio.Event()
        sampling = asyncio.create_task(sampler.run(stop))
        ticker = asyncio.create_task(_progress(tally, f"{policy} round {round_}", plan.progress_s))
        t0 = time.monotonic()
        try:
            records = await play(client, target, conversations, plan, (policy, round_), tally)
        finally:
            wall_s = time.monotonic() - t0
            stop.set()
            ticker.cancel()
            await asyncio.gather(sampling, ticker, return_exceptions=True)
        after = await read_cache_counters(client, plan.engines, plan.headers)
    finally:
        if gateway is not None:
            launch.stop(gateway)
    loads = sampler.time_average()
    stats = report.summarize(
        records,
        streams=plan.concurrency,
        skipped=tally.skipped,
        wall_s=wall_s,
        hit_rate=after.hit_rate_since(before),
        loads=loads,
        imbalance=imbalance(loads),
    )
    return stats, records


# -- all runs ---------------------------------------------------------------------------------------------


async def choose_isolation(client: httpx.AsyncClient, plan: Plan, wanted: str) -> str:
    if wanted == "salt":
        return "salt"
    if await reset_prefix_caches(client, plan.engines, plan.headers):
        return "reset"
    if wanted == "reset":
        raise SystemExit(
            "warmroute bench: an engine refused POST /reset_prefix_cache (vLLM: VLLM_SERVER_DEV_MODE=1)"
        )
    return "salt"


async def run_all(
    launch: Launcher, plan: Plan, policies: Sequence[str], rounds: int, isolation_wanted: str
) -> Outcome:
    limits = httpx.Limits(max_connections=2 * plan.concurrency + 4 * len(plan.engines) + 8)
    timeout = httpx.Timeout(connect=10.0, read=300.0, write=30.0, pool=60.0)
    runs: dict[str, list[report.RunStats]] = {p: [] for p in policies}
    every: list[report.TurnRecord] = []
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        isolation = await choose_isolation(client, plan, isolation_wanted)
        for round_ in range(1, rounds + 1):
            shift = (round_ - 1) % len(policies)
            for policy in [*policies[shift:], *policies[:shift]]:
                salt = "" if isolation == "reset" else f"~{policy}.{round_}"
                if isolation == "reset" and not await reset_prefix_caches(client, plan.engines, plan.headers):
                    raise SystemExit("warmroute bench: an engine stopped accepting POST /reset_prefix_cache")
                print(f"{policy}, round {round_}/{rounds}: starting", flush=True)
                stats, records = await run_policy(
                    client, launch, plan, policy, round_, build(plan.spec, salt)
                )
                print(report.run_line(stats), flush=True)
                runs[policy].append(stats)
                every.extend(records)
    return Outcome(isolation, runs, every)
