"""backends.changes: one announcement of lifecycle, fleet and pin changes; waiters wake on the change."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from backends.canary import CanaryResult
from backends.changes import Change, ChangeKind, Changes
from backends.events import Command, Operator
from backends.fleet import Fleet
from backends.lifecycle import Lifecycle
from backends.managed import BackendController, policy_for
from backends.registry import Registry
from config.settings import BackendConfig, RoutingConfig, Settings
from gateway.state import MemoryAffinityStore
from routing.types import BackendState, Decision, PinAction, Reason

pytestmark = pytest.mark.anyio
S = BackendState
K = ChangeKind
BACKEND = {"id": "a", "url": "http://127.0.0.1:9", "models": ["m"]}


class GatedCanary:
    """A canary that passes when the test opens its gate (so the test sees CANARY before READY)."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()

    async def __call__(self) -> CanaryResult:
        await self.gate.wait()
        return CanaryResult(True, "consistency", "x", "all 1 checks passed")


def make_fleet(settings: Settings, canary: GatedCanary, changes: Changes, client: httpx.AsyncClient) -> Fleet:
    def make(
        cfg: BackendConfig, s: Settings, _client: httpx.AsyncClient, on_change: Callable[[Lifecycle], None]
    ) -> BackendController:
        return BackendController(cfg.id, policy_for(cfg, s.health, s.canary), canary, on_change=on_change)

    return Fleet(Registry(settings.backends), settings, client, make=make, changes=changes)


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as c:
        yield c


async def test_a_lifecycle_run_is_announced_change_by_change_in_order(client: httpx.AsyncClient) -> None:
    settings = Settings(backends=[BACKEND], health={"fail_threshold": 2})
    changes, canary = Changes(), GatedCanary()
    fleet = make_fleet(settings, canary, changes, client)
    async with changes.subscribe() as events:
        fleet.start()
        fleet.probed("a", None)  # STARTING -> CANARY
        canary.gate.set()
        assert await events.next(5.0) == Change(1, K.STATE, "a", "canary")
        assert await events.next(5.0) == Change(2, K.STATE, "a", "ready")  # the canary task passed
        fleet.controllers["a"].send(Operator(Command.DRAIN))
        fleet.probed("a", "refused")  # one failure of two: no change, nothing announced
        fleet.probed("a", "refused")
        fleet.add(BackendConfig(id="b", url="http://127.0.0.1:10", models=("m",)))
        await fleet.remove("b")
        assert events.pending() == [
            Change(3, K.STATE, "a", "draining"),
            Change(4, K.STATE, "a", "down"),
            Change(5, K.ADDED, "b", ""),
            Change(6, K.REMOVED, "b", ""),
            Change(7, K.STATE, "b", "down"),  # its lifecycle ends after it left the registry
        ]
        # The fleet's mirror is written before the announcement: a listener reads the new state.
        assert fleet.registry.backends["a"].state is S.DOWN
    await fleet.aclose()
    assert changes.version == 7  # closing the fleet changed no state


async def test_a_waiter_wakes_on_the_change_not_on_its_timeout(client: httpx.AsyncClient) -> None:
    settings = Settings(backends=[BACKEND])
    changes, canary = Changes(), GatedCanary()
    fleet = make_fleet(settings, canary, changes, client)
    fleet.start()
    backend = fleet.registry.backends["a"]
    waiter = asyncio.create_task(changes.wait(lambda: backend.state is S.READY, within=3600.0))
    await asyncio.sleep(0)  # let it park (one loop turn; no time passes)
    assert not waiter.done() and len(changes._waiters) == 1
    fleet.probed("a", None)
    canary.gate.set()
    async with asyncio.timeout(5.0):  # a waiter on its hour-long timeout would fail here
        await waiter
    assert backend.state is S.READY and changes._waiters == set()  # nothing left parked
    await fleet.aclose()


async def test_a_change_made_before_the_wait_is_never_lost() -> None:
    changes = Changes()
    state = {"ready": False}
    state["ready"] = True
    changes.notify(K.STATE, "a", "ready")  # announced before anyone waits
    async with asyncio.timeout(1.0):
        await changes.wait(lambda: state["ready"], within=3600.0)  # returns at once: it reads the state
    assert await changes.changed(0) == 1  # a version already passed returns at once too


async def test_notify_between_a_check_and_the_next_wait_wakes_the_waiter() -> None:
    changes = Changes()
    hits: list[int] = []

    def predicate() -> bool:
        hits.append(changes.version)
        if len(hits) == 1:
            # A writer running while the waiter is between two checks (as another task would, right after
            # the waiter resumed): the waiter must see this change and not park on an old version.
            changes.notify(K.STATE, "a", "down")
        return len(hits) == 2

    async with asyncio.timeout(1.0):
        await changes.wait(predicate, within=3600.0)
    assert hits == [0, 1]  # re-checked without parking, since the version had moved


async def test_a_timed_out_or_cancelled_waiter_leaves_nothing_behind() -> None:
    changes = Changes()
    with pytest.raises(TimeoutError):
        await changes.wait(lambda: False, within=0.01)
    task = asyncio.create_task(changes.changed(changes.version))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert changes._waiters == set()
    changes.notify(K.PIN, "k", "a")  # and a later change finds no stale future to resolve
    assert changes.version == 1


async def test_every_subscription_gets_every_change_and_a_closed_one_none() -> None:
    changes = Changes()
    first, second = changes.subscribe(), changes.subscribe()
    changes.notify(K.ADDED, "a")
    await second.aclose()
    changes.notify(K.REMOVED, "a")
    assert [c.kind for c in first.pending()] == [K.ADDED, K.REMOVED]
    assert [c.kind for c in second.pending()] == [K.ADDED]
    await first.aclose()
    assert changes._subscriptions == set()


async def test_pins_claimed_or_moved_are_announced_and_touches_are_not() -> None:
    changes = Changes()
    store = MemoryAffinityStore(RoutingConfig(), changes=changes)
    async with changes.subscribe() as events:
        assert await store.commit("k", Decision("a", Reason.NEW_LEAST_LOADED, PinAction.CLAIM)) == "a"
        await store.commit("k", Decision("a", Reason.AFFINITY_HIT, PinAction.TOUCH))
        await store.commit("k", Decision("b", Reason.REPIN_UNHEALTHY, PinAction.MOVE))
        # A claim that loses to the pin already there announces the winner.
        assert await store.commit("k", Decision("c", Reason.NEW_LEAST_LOADED, PinAction.CLAIM)) == "b"
        await store.commit("k", Decision("b", Reason.AFFINITY_HIT, PinAction.NONE))
        assert events.pending() == [
            Change(1, K.PIN, "k", "a"),
            Change(2, K.PIN, "k", "b"),
            Change(3, K.PIN, "k", "b"),
        ]
