"""Interleaved rounds on one simulated engine, for the admission scenarios (noisy-neighbour, fair-share).

One engine serves the whole scenario. Each round runs every variant in turn, each against a gateway of its
own started for that run, so the variants of one round meet the machine in the same state; the report holds
every run and, per variant, the median of each figure (a figure the first run has no value for is left out).
"""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx

from tools.launch import Child, Engine, Launcher, SimProfile

StartEngine = Callable[[Launcher, SimProfile], Engine]
StartGateway = Callable[[Launcher, Engine, str, str], Child]  # (launch, engine, variant, its name)
RunVariant = Callable[[httpx.AsyncClient, str, str], Awaitable[dict[str, Any]]]  # (client, url, variant)
Runs = dict[str, list[dict[str, Any]]]


async def interleaved_rounds(
    name: str,
    rounds: int,
    variants: Sequence[str],
    profile: SimProfile,
    *,
    start_engine: StartEngine,
    start_gateway: StartGateway,
    run_variant: RunVariant,
    brief: Callable[[dict[str, Any]], str],
    max_connections: int,
) -> Runs:
    """Each variant's results, one a round, in the order they ran; each printed as it comes."""
    runs: Runs = {v: [] for v in variants}
    with Launcher(f"warmroute-{name}-") as launch:
        engine = start_engine(launch, profile)
        limits = httpx.Limits(max_connections=max_connections)
        async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120.0)) as client:
            for round_ in range(1, rounds + 1):
                for variant in variants:
                    gateway = start_gateway(launch, engine, variant, f"gw-{round_}-{len(runs[variant])}")
                    try:
                        result = await run_variant(client, gateway.url, variant)
                    finally:
                        launch.stop(gateway)
                    print(f"  {name} {variant} round {round_}: {brief(result)}", flush=True)
                    runs[variant].append(result)
    return runs


def report(name: str, target: str, rounds: int, time_scale: float, runs: Runs) -> dict[str, Any]:
    medians = {
        v: {k: statistics.median(r[k] for r in rs) for k in rs[0] if rs[0][k] is not None}
        for v, rs in runs.items()
    }
    return {
        "scenario": name,
        "target": target,
        "rounds": rounds,
        "time_scale": time_scale,
        "runs": runs,
        "medians": medians,
    }
