"""Serial prefill (a queue that routing can see) and an engine slowing down at runtime."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from backends.sim import SimConfig, SimEngine
from backends.sim.engine import RequestUsage
from backends.sim.faults import FaultsPatch
from backends.sim.text import FinishReason, OutputPlan

pytestmark = pytest.mark.anyio


class GatedSleep:
    """Each modelled delay waits until the test releases it, so overlap is visible."""

    def __init__(self) -> None:
        self.pending: list[tuple[float, asyncio.Event]] = []

    async def __call__(self, seconds: float) -> None:
        gate = asyncio.Event()
        self.pending.append((seconds, gate))
        await gate.wait()


def prompt(n: int, tag: str) -> tuple[str, ...]:
    return tuple(f"{tag}{i}" for i in range(n))


async def start(engine: SimEngine, tokens: tuple[str, ...]) -> tuple[asyncio.Task[None], RequestUsage]:
    usage = RequestUsage(len(tokens))

    async def go() -> None:
        async for _ in engine.generate(tokens, OutputPlan((), ("w",), FinishReason.STOP), usage):
            pass

    return asyncio.create_task(go()), usage


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_serial_prefill_queues_and_a_queued_twin_hits_the_cache_of_the_one_ahead() -> None:
    sleep = GatedSleep()
    engine = SimEngine(SimConfig(prefill_serial=True, ttft_base_ms=0, prefill_tps=1000), sleep)
    first, _ = await start(engine, prompt(64, "p"))
    twin, twin_usage = await start(engine, prompt(64, "p"))
    await settle()
    assert len(sleep.pending) == 1 and engine.num_waiting == 1  # the twin waits for the prefill slot
    sleep.pending[0][1].set()
    await settle()
    assert twin_usage.cached_tokens == 48  # looked up when its prefill started: the first one's blocks
    for _, gate in sleep.pending:
        gate.set()
    await asyncio.gather(first, twin)
    assert engine.num_waiting == 0


async def test_parallel_prefill_is_the_default() -> None:
    sleep = GatedSleep()
    engine = SimEngine(SimConfig(ttft_base_ms=0), sleep)
    tasks = [(await start(engine, prompt(64, t)))[0] for t in "ab"]
    await settle()
    assert len(sleep.pending) == 2 and engine.num_waiting == 0
    for _, gate in sleep.pending:
        gate.set()
    for task in tasks:
        task.cancel()


async def test_slow_factor_multiplies_every_delay_from_the_next_one_on() -> None:
    calls: list[float] = []

    async def record(seconds: float) -> None:
        calls.append(seconds)

    engine = SimEngine(SimConfig(ttft_base_ms=0, prefill_tps=1000, time_scale=0.5), record)
    usage = RequestUsage(100)
    engine.faults.apply(FaultsPatch(slow_factor=4.0))
    async for _ in engine.generate(prompt(100, "x"), OutputPlan((), ("w",), FinishReason.STOP), usage):
        pass
    assert calls == pytest.approx([0.5 * 4.0 * 100 / 1000])
    assert dataclasses.asdict(engine.faults.reset())["slow_factor"] == 1.0
