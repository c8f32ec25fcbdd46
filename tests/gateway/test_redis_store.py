"""RedisAffinityStore on a real redis-server: atomic first claims, counts, leases, round trips, outages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from backends.changes import Change, ChangeKind
from config.settings import RedisConfig, RoutingConfig
from gateway.redis_store import RedisAffinityStore, redis_pool
from routing.types import Decision, PinAction, Reason
from tools.procs import free_port
from tools.redis_server import CountingConnection, RedisServer

pytestmark = pytest.mark.anyio

StoreFactory = Callable[..., RedisAffinityStore]
CLAIM = PinAction.CLAIM


def decide(backend: str, pin: PinAction = CLAIM) -> Decision:
    reason = Reason.REPIN_UNHEALTHY if pin is PinAction.MOVE else Reason.NEW_LEAST_LOADED
    return Decision(backend, reason, pin)


@pytest.fixture
async def stores(redis_server: RedisServer, redis_prefix: str) -> AsyncIterator[StoreFactory]:
    made: list[RedisAffinityStore] = []

    def make(
        url: str | None = None, routing: dict[str, Any] | None = None, pool: Any = None, **redis: Any
    ) -> RedisAffinityStore:
        redis.setdefault("prefix", redis_prefix)
        redis.setdefault("timeout_s", 2.0)  # a loaded CI machine must not look like a Redis outage
        cfg = RedisConfig(url=url or redis_server.url, **redis)
        store = RedisAffinityStore(cfg, RoutingConfig(**(routing or {})), ["x", "y"], pool=pool)
        made.append(store)
        return store

    yield make
    for store in made:
        await store.aclose()


async def until(check: Callable[[], Any], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not await check():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        await asyncio.sleep(0.02)


async def test_the_first_claim_wins_and_both_replicas_agree(stores: StoreFactory) -> None:
    a, b = stores(), stores()
    await a.start()
    await b.start()
    # The race, made explicit: both replicas look before either claims, then claim different backends.
    assert (await a.view("k")).pinned is None
    assert (await b.view("k")).pinned is None
    assert await a.commit("k", decide("x")) == "x"
    assert await b.commit("k", decide("y")) == "x"
    assert (await b.view("k")).pinned == "x"
    # And truly concurrent: 50 conversations, each claimed by both at once with conflicting choices.
    keys = [f"c{i}" for i in range(50)]
    results = await asyncio.gather(
        *(a.commit(k, decide("x")) for k in keys), *(b.commit(k, decide("y")) for k in keys)
    )
    assert results[:50] == results[50:]
    assert (await a.view(None)).conversations == {
        "x": 1 + results.count("x") // 2,
        "y": results.count("y") // 2,
    }


async def test_move_transfers_the_count_and_touch_keeps_the_newer_pin(stores: StoreFactory) -> None:
    a, b = stores(), stores()
    await a.commit("k", decide("x"))
    assert (await b.view("k")).conversations == {"x": 1, "y": 0}
    assert await b.commit("k", decide("y", PinAction.MOVE)) == "y"
    view = await a.view("k")
    assert (view.pinned, view.conversations) == ("y", {"x": 0, "y": 1})
    # A stale replica refreshing its old idea of the pin gets the newer pin back instead of undoing it.
    assert await a.commit("k", Decision("x", Reason.AFFINITY_HIT, PinAction.TOUCH)) == "y"


async def test_pinned_counts_follow_expiring_pins(stores: StoreFactory) -> None:
    a = stores(routing={"affinity_ttl_s": 0.3})
    for i in range(5):
        await a.commit(f"k{i}", decide("x"))
    assert (await a.view(None)).conversations["x"] == 5

    async def drained() -> bool:
        return (await a.view(None)).conversations["x"] == 0

    await until(drained)

    async def forgotten() -> bool:
        # The local mirror keeps a pin up to one generation (ttl/8) past its last use + ttl.
        return (await a.view("k0")).pinned is None

    await until(forgotten)


async def test_in_flight_is_shared_and_a_silent_replicas_leases_expire(stores: StoreFactory) -> None:
    # A 2 s lease beats every 0.2 s: a loaded machine may stall this process for 1.8 s before the live
    # replica's lease lapses (with 1 s, a 0.8 s stall failed the check after the sleep below).
    lease = {"lease_ttl_s": 2.0, "heartbeat_s": 0.2}
    alive, silent, reader = stores(**lease), stores(**lease), stores(**lease)
    await alive.start()  # heartbeats
    for _ in range(3):
        alive.started("x")
    silent.started("y")  # never started: publishes once with the view below, then goes quiet
    silent.started("y")
    began = time.monotonic()  # before its one publish: its lease cannot lapse sooner than 2 s after this
    await silent.view(None)
    await alive.view(None)
    assert (await reader.view(None)).in_flight == {"x": 3, "y": 2}

    async def silent_expired() -> bool:
        return (await reader.view(None)).in_flight == {"x": 3, "y": 0}

    await until(silent_expired, within=10)
    assert time.monotonic() - began > 1.0  # it expired by its lease, not at once
    await asyncio.sleep(2.2)  # longer than a lease: the heartbeating replica still counts
    assert (await reader.view(None)).in_flight == {"x": 3, "y": 0}
    alive.finished("x")
    await alive.aclose()  # a clean exit withdraws the counts at once
    assert (await reader.view(None)).in_flight == {"x": 0, "y": 0}


async def test_a_routed_request_costs_at_most_two_round_trips(
    redis_server: RedisServer, stores: StoreFactory
) -> None:
    counting = CountingConnection.fresh()
    cfg = RedisConfig(url=redis_server.url)
    store = stores(pool=redis_pool(cfg, connection_class=counting))
    await store.view("warm-up")  # connection handshake and script loading are not per-request costs
    for i in range(20):
        before = counting.sent
        view = await store.view(f"k{i % 5}")
        pin = PinAction.TOUCH if view.pinned else CLAIM
        winner = await store.commit(f"k{i % 5}", Decision(view.pinned or "x", Reason.AFFINITY_HIT, pin))
        store.started(winner)
        store.finished(winner)
        assert counting.sent - before == 2


async def test_unreachable_redis_degrades_and_routes_locally(stores: StoreFactory) -> None:
    store = stores(url=f"redis://127.0.0.1:{free_port()}/0", reconnect_min_s=0.05)
    await store.start()
    assert store.status()["degraded"] is True
    assert await store.commit("k", decide("y")) == "y"
    view = await store.view("k")
    assert (view.pinned, view.conversations, view.in_flight) == ("y", {"y": 1}, None)


async def test_a_stalled_redis_costs_one_timeout_then_recovers(
    private_redis: RedisServer, stores: StoreFactory
) -> None:
    store = stores(url=private_redis.url, timeout_s=0.1, reconnect_min_s=0.05, reconnect_max_s=0.1)
    await store.start()
    await store.commit("k", decide("x"))
    private_redis.client().client_pause(3000, all=True)  # every command blocks for 3 s
    async with store.changes.subscribe() as events:
        began = time.monotonic()
        view = await store.view("k")
        assert time.monotonic() - began < 2.0  # gave up after its 0.1 s timeout, did not wait for Redis
        assert view.pinned == "x"  # from the local mirror
        assert store.status()["degraded"] is True
        assert await store.commit("new", decide("y")) == "y"
        await store.changes.wait(lambda: not store.degraded, within=30.0)  # announced when Redis answers
        shared = [(c.kind, c.value) for c in events.pending() if c.kind is ChangeKind.SHARED_STATE]
        assert shared == [(ChangeKind.SHARED_STATE, "degraded"), (ChangeKind.SHARED_STATE, "ok")]
    assert private_redis.client().get(store.keys.pin("new")) == "y"  # the pin made meanwhile was written back


async def test_pins_survive_a_redis_restart_that_lost_everything(
    private_redis: RedisServer, stores: StoreFactory
) -> None:
    fast = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.1, "heartbeat_s": 0.05}
    a = stores(url=private_redis.url, **fast)
    b = stores(url=private_redis.url, **fast)
    await a.start()
    await b.start()
    await a.commit("before", decide("x"))
    private_redis.kill()
    await a.view("before")  # notices the outage
    assert a.status()["degraded"] is True
    assert await a.commit("during", decide("y")) == "y"
    assert a.status()["pending_resync"] == 1
    private_redis.start()  # empty: no persistence

    async def resynced() -> bool:
        back = a.status()["degraded"] is False and b.status()["degraded"] is False
        return back and private_redis.client().exists(a.keys.pin("before")) == 1

    await until(resynced)
    # b never made a pin: it sees both, written back by a (the outage pin; the old one, as the epoch changed).
    assert (await b.view("during")).pinned == "y"
    assert (await b.view("before")).pinned == "x"
    assert (await b.view(None)).conversations == {"x": 1, "y": 1}


async def test_connections_from_before_an_outage_do_not_degrade_the_store_again(
    private_redis: RedisServer, stores: StoreFactory
) -> None:
    fast = {"reconnect_min_s": 0.05, "reconnect_max_s": 0.1, "heartbeat_s": 0.05}
    store = stores(url=private_redis.url, **fast)
    await store.start()
    await asyncio.gather(*(store.view(f"k{i}") for i in range(8)))  # several connections in the pool
    private_redis.kill()
    await store.view("k0")  # notices the outage
    assert store.status()["degraded"] is True
    private_redis.start()

    async def recovered() -> bool:
        return store.status()["degraded"] is False

    await until(recovered)
    # Every pooled connection is used at once: none may be one the old server reset.
    await asyncio.gather(*(store.view(f"k{i}") for i in range(8)))
    assert store.status()["degraded"] is False


async def test_pins_claimed_or_moved_are_announced_a_touch_or_another_replicas_pin_is_not(
    stores: StoreFactory,
) -> None:
    a, b = stores(), stores()
    async with a.changes.subscribe() as events:
        assert await a.commit("k", decide("x")) == "x"
        await a.commit("k", Decision("x", Reason.AFFINITY_HIT, PinAction.TOUCH))
        await a.commit("k", decide("y", PinAction.MOVE))
        assert await b.commit("k2", decide("y")) == "y"  # the other replica's pin: announced there only
        assert await a.commit("k2", decide("x")) == "y"  # a lost claim announces the winner
        assert events.pending() == [
            Change(1, ChangeKind.PIN, "k", "x"),
            Change(2, ChangeKind.PIN, "k", "y"),
            Change(3, ChangeKind.PIN, "k2", "y"),
        ]
    assert b.changes.version == 1


async def test_a_degraded_store_announces_its_local_pins_too(stores: StoreFactory) -> None:
    store = stores(url=f"redis://127.0.0.1:{free_port()}/0")
    async with store.changes.subscribe() as events:
        await store.start()
        assert store.status()["degraded"] is True
        assert await store.commit("k", decide("x")) == "x"
        await store.commit("k", Decision("x", Reason.AFFINITY_HIT, PinAction.TOUCH))
        await store.commit("k", decide("y", PinAction.MOVE))
        assert events.pending() == [
            Change(1, ChangeKind.SHARED_STATE, "redis", "degraded"),  # once, however many round trips fail
            Change(2, ChangeKind.PIN, "k", "x"),
            Change(3, ChangeKind.PIN, "k", "y"),
        ]
