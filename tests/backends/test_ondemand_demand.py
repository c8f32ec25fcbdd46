"""``backends.demand.Demand`` (the scheduler's async edge) with fake controllers: tickets, cancellation,
claims, holds, timers and shutdown. No processes."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from backends.demand import Demand, EngineUnavailable
from backends.events import Event, Sleep, Wake
from backends.lifecycle import Lifecycle
from backends.ondemand import EngineSpec, GroupSpec, Phase, RejectWhy, SchedulerPolicy
from routing.types import BackendState

pytestmark = pytest.mark.anyio
READY = Lifecycle(state=BackendState.READY, reason="canary passed")


class FakeController:
    def __init__(self) -> None:
        self.sent: list[Event] = []
        self.stop_done = asyncio.Event()

    def send(self, event: Event) -> None:
        self.sent.append(event)

    async def stopping(self) -> None:
        await self.stop_done.wait()


def make(
    policy: SchedulerPolicy, busy: dict[str, int] | None = None
) -> tuple[Demand, dict[str, FakeController]]:
    ctls = {e.id: FakeController() for e in policy.engines}
    counts = busy if busy is not None else {}
    demand = Demand(policy, ctls, lambda ids: {i: counts.get(i, 0) for i in ids})  # type: ignore[arg-type]
    return demand, ctls


ONE = SchedulerPolicy((EngineSpec("a", ("ma",), idle_ttl_s=None),))
PAIR = SchedulerPolicy((EngineSpec("a", ("ma",), "g"), EngineSpec("b", ("mb",), "g")), {"g": GroupSpec(1)})


async def test_a_request_wakes_the_engine_and_is_admitted_when_its_lifecycle_is_ready() -> None:
    demand, ctls = make(ONE)
    pending = demand.request("ma")
    assert ctls["a"].sent == [Wake()] and not pending.done()
    demand.lifecycle_changed("a", READY)
    claim = await pending.claim()
    assert claim.engine == "a" and demand.schedule.engines["a"].claims == 1
    claim.release()
    claim.release()  # idempotent
    assert demand.schedule.engines["a"].claims == 0


async def test_a_cancelled_waiter_leaves_the_queue() -> None:
    demand, _ = make(ONE)
    task = asyncio.create_task(demand.ready_for("ma"))
    await asyncio.sleep(0)  # let it queue
    assert demand.schedule.waiting("ma") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert demand.schedule.waiting("ma") == 0


async def test_an_admission_whose_client_left_gives_its_claim_back() -> None:
    demand, _ = make(ONE)
    task = asyncio.create_task(demand.ready_for("ma"))
    await asyncio.sleep(0)
    demand.lifecycle_changed("a", READY)  # admitted: the future is resolved, the task not resumed yet
    assert demand.schedule.engines["a"].claims == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert demand.schedule.engines["a"].claims == 0


async def test_a_failed_start_rejects_with_the_lifecycles_reason_and_sleeps_the_engine() -> None:
    demand, ctls = make(ONE)
    pending = demand.request("ma")
    down = Lifecycle(state=BackendState.DOWN, reason="engine process exited with code 3")
    demand.lifecycle_changed("a", down)
    with pytest.raises(EngineUnavailable) as exc:
        await pending.claim()
    assert (exc.value.why, exc.value.message) == (
        RejectWhy.START_FAILED,
        "backend a failed to start: engine process exited with code 3",
    )
    assert ctls["a"].sent[-1] == Sleep(
        "stopped after a failure: engine process exited with code 3 (starts again on a request)"
    )
    assert demand.schedule.engines["a"].phase is Phase.STOPPING
    ctls["a"].stop_done.set()
    for _ in range(3):
        await asyncio.sleep(0)
    assert demand.schedule.engines["a"].phase is Phase.STOPPED


async def test_a_stopped_lifecycle_is_no_failure() -> None:
    demand, ctls = make(ONE)
    demand.lifecycle_changed("a", replace(Lifecycle(state=BackendState.DOWN), stopped=True))
    assert ctls["a"].sent == [] and demand.schedule.engines["a"].phase is Phase.STOPPED


async def test_the_timer_fires_the_idle_ttl() -> None:
    policy = SchedulerPolicy((EngineSpec("a", ("ma",), idle_ttl_s=0.05),))
    demand, ctls = make(policy)
    pending = demand.request("ma")
    demand.lifecycle_changed("a", READY)
    (await pending.claim()).release()
    async with asyncio.timeout(5):
        while not any(isinstance(e, Sleep) for e in ctls["a"].sent):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert ctls["a"].sent[-1].reason.startswith("stopped: idle for 0.")  # type: ignore[union-attr]


async def test_hold_and_release_hold_on_engines_that_are_not_on_demand_raise_key_error() -> None:
    demand, _ = make(PAIR)
    with pytest.raises(KeyError):
        demand.hold("zz", 10, "x")
    with pytest.raises(KeyError):
        demand.release_hold("zz")
    status = demand.hold("a", 10, "bench")  # a stopped engine that is held is started
    assert status["phase"] == "starting" and status["hold"]["reason"] == "bench"
    assert demand.release_hold("a")["hold"] is None


async def test_shutdown_answers_every_waiter() -> None:
    demand, _ = make(ONE)
    pending = demand.request("ma")
    await demand.aclose()
    with pytest.raises(EngineUnavailable, match="shutting down"):
        await pending.claim()
