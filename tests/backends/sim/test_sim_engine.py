import asyncio
import math
import time

import pytest

from backends.sim import SimConfig, SimEngine, decode_step_seconds, ttft_seconds
from backends.sim.engine import RequestUsage
from backends.sim.testing import SleepRecorder
from backends.sim.text import FinishReason, OutputPlan

pytestmark = pytest.mark.anyio


@pytest.fixture
def recorder() -> SleepRecorder:
    return SleepRecorder()


CFG = SimConfig(ttft_base_ms=20, prefill_tps=4000, decode_tps=50, decode_slowdown=0.5, block_size=16)


def prompt(n: int, tag: str = "p") -> tuple[str, ...]:
    return tuple(f"{tag}{i}" for i in range(n))


def plan(n: int) -> OutputPlan:
    return OutputPlan((), ("w",) * n, FinishReason.LENGTH)


async def run(engine: SimEngine, tokens: tuple[str, ...], n: int) -> RequestUsage:
    usage = RequestUsage(len(tokens))
    async for _ in engine.generate(tokens, plan(n), usage):
        pass
    return usage


def test_formulas() -> None:
    assert ttft_seconds(CFG, 0) == pytest.approx(0.020)
    assert ttft_seconds(CFG, 4000) == pytest.approx(1.020)
    assert decode_step_seconds(CFG, 1) == pytest.approx(1 / 50)
    assert decode_step_seconds(CFG, 3) == pytest.approx((1 + 0.5 * 2) / 50)
    assert decode_step_seconds(CFG, 0) == decode_step_seconds(CFG, 1)


async def test_ttft_then_decode_steps_scaled_and_cache_shortens_prefill(recorder: SleepRecorder) -> None:
    cfg = SimConfig(ttft_base_ms=20, prefill_tps=4000, decode_tps=50, time_scale=0.5)
    engine = SimEngine(cfg, recorder)
    first = await run(engine, prompt(100), 5)
    assert (first.cached_tokens, first.completion_tokens) == (0, 5)
    assert recorder.calls == pytest.approx([0.5 * (0.020 + 100 / 4000)] + [0.5 / 50] * 4)
    recorder.calls.clear()
    second = await run(engine, prompt(100), 1)
    assert second.cached_tokens == 96
    assert recorder.calls == pytest.approx([0.5 * (0.020 + 4 / 4000)])


async def test_decode_slows_with_concurrent_running_streams(recorder: SleepRecorder) -> None:
    engine = SimEngine(CFG, recorder)
    holder = engine.generate(prompt(10, "a"), plan(3), RequestUsage(10))
    await anext(holder)  # A is running (past prefill)
    recorder.calls.clear()
    await run(engine, prompt(10, "b"), 4)
    assert recorder.calls[1:] == pytest.approx([(1 + 0.5) / 50] * 3)
    await holder.aclose()


async def test_requests_beyond_max_running_wait_and_a_released_slot_is_handed_on(
    recorder: SleepRecorder,
) -> None:
    engine = SimEngine(SimConfig(max_running=1, block_size=16, cache_tokens=1600), recorder)
    holder = engine.generate(prompt(100, "a"), plan(5), RequestUsage(100))
    await anext(holder)
    assert (engine.num_running, engine.num_waiting) == (1, 0)
    assert engine.kv_cache_usage() == pytest.approx(math.ceil(101 / 16) / 100)
    queued = asyncio.create_task(run(engine, prompt(10, "b"), 2))
    cancelled = asyncio.create_task(run(engine, prompt(10, "c"), 2))
    await asyncio.sleep(0)
    assert (engine.num_running, engine.num_waiting) == (1, 2)
    cancelled.cancel()
    await asyncio.gather(cancelled, return_exceptions=True)
    assert engine.num_waiting == 1
    await holder.aclose()  # e.g. the client went away
    assert (await queued).completion_tokens == 2
    assert (engine.num_running, engine.num_waiting) == (0, 0)
    assert engine.stats.finished == {"abort": 1, "length": 1}
    assert engine.kv_cache_usage() == 0.0


async def test_a_released_slot_is_reserved_for_the_waiter_not_a_newcomer() -> None:
    gate, blocking = asyncio.Event(), False

    async def gated_sleep(seconds: float) -> None:
        if blocking:
            await gate.wait()

    engine = SimEngine(SimConfig(max_running=1), gated_sleep)
    holder = engine.generate(prompt(4, "a"), plan(1), RequestUsage(4))
    await anext(holder)
    waiter = asyncio.create_task(run(engine, prompt(4, "b"), 1))
    await asyncio.sleep(0)
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    blocking = True
    with pytest.raises(StopAsyncIteration):
        await anext(holder)  # finishes without yielding to the loop
    assert (engine.num_running, engine.num_waiting) == (1, 0)  # taken for the waiter before it resumes
    newcomer = asyncio.create_task(run(engine, prompt(4, "c"), 1))
    for _ in range(3):
        await asyncio.sleep(0)
    assert (engine.num_running, engine.num_waiting) == (1, 1)
    gate.set()
    await asyncio.gather(waiter, newcomer)
    assert engine.num_running == 0
    assert engine.stats.finished == {"length": 3}


async def test_a_waiter_cancelled_after_being_handed_a_slot_passes_it_on(recorder: SleepRecorder) -> None:
    engine = SimEngine(SimConfig(max_running=1), recorder)
    holder = engine.generate(prompt(4, "a"), plan(1), RequestUsage(4))
    await anext(holder)
    first = asyncio.create_task(run(engine, prompt(4, "b"), 1))
    second = asyncio.create_task(run(engine, prompt(4, "c"), 1))
    await asyncio.sleep(0)
    with pytest.raises(StopAsyncIteration):
        await anext(holder)  # hands the slot to `first` ...
    first.cancel()  # ... whose client leaves before it resumes
    await asyncio.wait_for(second, timeout=1)
    assert first.cancelled()
    assert (engine.num_running, engine.num_waiting) == (0, 0)


async def test_decoded_blocks_are_cached_for_the_next_turn(recorder: SleepRecorder) -> None:
    engine = SimEngine(SimConfig(block_size=4), recorder)
    await run(engine, prompt(6), 10)  # 16 tokens in all: 4 full blocks
    follow_up = (*prompt(6), *("w",) * 10, "next")
    assert (await run(engine, follow_up, 1)).cached_tokens == 16


async def test_time_scale_shrinks_real_time() -> None:
    cfg = SimConfig(ttft_base_ms=0, prefill_tps=1000, decode_tps=1, time_scale=0.05)
    engine = SimEngine(cfg)  # real asyncio.sleep: 0.4 s prefill + 1 s decode, scaled to 0.07 s
    start = time.perf_counter()
    await run(engine, prompt(400), 2)
    elapsed = time.perf_counter() - start
    assert 0.063 <= elapsed < 0.7  # under half the unscaled 1.4 s: room for a loaded machine


async def test_a_request_aborted_during_prefill_caches_nothing() -> None:
    gate = asyncio.Event()

    async def stuck(seconds: float) -> None:
        await gate.wait()

    engine = SimEngine(SimConfig(block_size=4), stuck)
    task = asyncio.create_task(run(engine, prompt(40), 2))
    await asyncio.sleep(0)
    assert engine.num_running == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert (engine.num_running, len(engine.cache)) == (0, 0)
    assert engine.stats.finished == {"abort": 1}


@pytest.mark.parametrize(
    ("policy", "order"), [("fcfs", ["b", "c", "d", "e"]), ("priority", ["c", "e", "b", "d"])]
)
async def test_a_free_slot_goes_by_the_scheduling_policy_and_a_running_request_is_never_preempted(
    recorder: SleepRecorder, policy: str, order: list[str]
) -> None:
    engine = SimEngine(SimConfig(max_running=1, scheduling_policy=policy), recorder)
    holder = engine.generate(prompt(4, "a"), plan(2), RequestUsage(4), priority=9)
    await anext(holder)
    started: list[str] = []

    async def ask(tag: str, priority: int) -> None:
        async for _ in engine.generate(prompt(4, tag), plan(1), RequestUsage(4), priority):
            started.append(tag)

    waiters = []
    for tag, priority in (("b", 5), ("c", 0), ("d", 5), ("e", 0)):  # arrival order
        waiters.append(asyncio.create_task(ask(tag, priority)))
        await asyncio.sleep(0)
    assert (engine.num_running, engine.num_waiting) == (1, 4)
    await anext(holder)  # the worst-priority request kept its slot through every arrival
    with pytest.raises(StopAsyncIteration):
        await anext(holder)
    await asyncio.gather(*waiters)
    assert started == order


def test_a_scheduling_policy_vllm_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="scheduling_policy"):
        SimConfig(scheduling_policy="lifo")
