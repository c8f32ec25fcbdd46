"""Several gateway replicas sharing one redis-server: stickiness, first-turn races, round trips, outages."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from config.settings import load_settings
from gateway.app import Gateway, create_app
from gateway.redis_keys import RedisKeys
from gateway.redis_store import RedisAffinityStore, redis_pool
from routing.keys import chat_key
from tools.redis_server import CountingConnection, RedisServer

from clusters import loop_of, wait_on_loop
from upstreams import FAST_HEALTH, FakeEngine, serve

SYS = {"role": "system", "content": "You are a coding agent."}


@dataclass
class Replicas:
    urls: list[str]
    gateways: list[Gateway]
    engines: dict[str, FakeEngine]
    loops: list[asyncio.AbstractEventLoop]  # each gateway's own (its server's thread)

    def wait_for(self, i: int, predicate: Callable[[], object], what: str) -> None:
        """Wait for a state gateway ``i`` announces (``Gateway.changes``), re-checked on its own loop."""
        wait_on_loop(self.gateways[i], self.loops[i], predicate, what, ANNOUNCED_S)


ReplicasFactory = Callable[..., Replicas]


QUIET_ADMIN = {"sync_interval_s": 3600}  # no change-feed poll while round trips are counted
#: How long a test waits for a state the product announces: room for a loaded 2-core machine.
ANNOUNCED_S = 30.0


@pytest.fixture
def replicas(redis_server: RedisServer, redis_prefix: str) -> Iterator[ReplicasFactory]:
    """``replicas(2, ["a", "b"], weights=[...], redis={...})``: fake engines and gateways sharing Redis."""
    stack = contextlib.ExitStack()

    def make(
        count: int = 2,
        names: tuple[str, ...] = ("a", "b", "c"),
        weights: list[dict[str, float]] | None = None,
        redis: dict[str, Any] | None = None,
        shared: bool = True,
        store: Callable[[Any], RedisAffinityStore] | None = None,
        routing: dict[str, Any] | None = None,
        admin: dict[str, Any] | None = None,
    ) -> Replicas:
        engines = {n: FakeEngine(n) for n in names}
        engine_urls = {n: stack.enter_context(serve(e.app()))[0] for n, e in engines.items()}
        # Generous timeouts: a loaded test machine must not look like a Redis outage. Outages here are kills.
        redis_cfg = {"url": redis_server.url, "prefix": redis_prefix, "timeout_s": 2.0, **(redis or {})}
        redis_cfg = redis_cfg if shared else {}
        urls, gateways, loops = [], [], []
        for i in range(count):
            w = weights[i] if weights else {}
            backends = [
                {"id": n, "url": u, "models": ["m"], "weight": w.get(n, 1.0)} for n, u in engine_urls.items()
            ]
            settings = load_settings(
                None,
                backends=backends,
                health=FAST_HEALTH,
                redis=redis_cfg,
                routing=routing or {"policy": "affinity"},  # pins shared as they are; ttft: its own test
                admin=admin or {},
            )
            app = create_app(settings, store(settings) if store else None)
            url, server = stack.enter_context(serve(app))
            urls.append(url)
            gateways.append(app.state.gateway)
            loops.append(loop_of(server))
        return Replicas(urls, gateways, engines, loops)

    with stack:
        yield make


def chat(
    url: str, messages: list[dict[str, str]], client: httpx.Client | None = None, **headers: str
) -> httpx.Response:
    body = {"model": "m", "messages": messages}
    r = (client or httpx).post(url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
    assert r.status_code == 200, r.text
    return r


def turn(conv: str, i: int) -> list[dict[str, str]]:
    history = [SYS, {"role": "user", "content": conv}]
    for j in range(i):
        history += [{"role": "assistant", "content": f"answer {j}"}, {"role": "user", "content": f"next {j}"}]
    return history


def test_a_conversation_stays_on_one_backend_across_replicas(replicas: ReplicasFactory) -> None:
    r = replicas(2)
    for conv in (f"task {i}" for i in range(8)):
        seen = [chat(r.urls[i % 2], turn(conv, i)) for i in range(4)]  # turns alternate between replicas
        assert len({s.headers["x-warmroute-backend"] for s in seen}) == 1
        assert [s.headers["x-warmroute-route"] for s in seen[1:]] == ["affinity_hit"] * 3
    ready = httpx.get(r.urls[0] + "/readyz").json()
    assert ready["shared_state"]["backend"] == "redis" and ready["shared_state"]["degraded"] is False


async def race(urls: list[str], conversations: int) -> list[tuple[list[str], list[str]]]:
    """Fire each conversation's first turn at every replica at once; (backends, routes) per conversation."""
    out = []
    async with httpx.AsyncClient(timeout=10) as client:
        for conv in range(conversations):
            body = {"model": "m", "messages": turn(f"race {conv}", 0)}
            rs = await asyncio.gather(*(client.post(u + "/v1/chat/completions", json=body) for u in urls))
            assert all(x.status_code == 200 for x in rs)
            out.append(
                ([x.headers["x-warmroute-backend"] for x in rs], [x.headers["x-warmroute-route"] for x in rs])
            )
    return out


# Opposite weights: each replica, left alone, would put most new conversations on a different engine.
OPPOSED = [{"a": 100.0, "b": 1.0}, {"a": 1.0, "b": 100.0}]


@pytest.mark.anyio
async def test_simultaneous_first_turns_on_two_replicas_resolve_to_one_backend(
    replicas: ReplicasFactory,
) -> None:
    r = replicas(2, ("a", "b"), weights=OPPOSED)
    results = await race(r.urls, 50)
    split = [backends for backends, _ in results if len(set(backends)) > 1]
    assert split == []
    # Both replicas believed the conversation new (neither saw the other's pin) in real races: the atomic
    # claim, not luck, kept them together.
    both_new = sum(routes == ["new_least_loaded"] * 2 for _, routes in results)
    print(f"{both_new} of 50 first turns were true races")
    assert both_new >= 5, both_new


@pytest.mark.anyio
async def test_the_race_splits_conversations_without_shared_state(replicas: ReplicasFactory) -> None:
    """Control for the test above: the same race, each replica with its own memory, does split."""
    r = replicas(2, ("a", "b"), weights=OPPOSED, shared=False)
    results = await race(r.urls, 50)
    assert sum(len(set(backends)) > 1 for backends, _ in results) >= 10


def test_a_routed_request_costs_at_most_two_redis_round_trips(replicas: ReplicasFactory) -> None:
    counting = CountingConnection.fresh()

    def store(settings: Any) -> RedisAffinityStore:
        pool = redis_pool(settings.redis, connection_class=counting)
        return RedisAffinityStore(
            settings.redis, settings.routing, [b.id for b in settings.backends], pool=pool
        )

    # No heartbeat within the test: every round trip counted belongs to a request.
    # Nor an admin change-feed poll (admin.sync_interval_s): it shares the store's connections.
    r = replicas(1, ("a", "b"), redis={"heartbeat_s": 60, "lease_ttl_s": 120}, store=store, admin=QUIET_ADMIN)
    url = r.urls[0]
    chat(url, turn("warm-up", 0))  # the connection's handshake and script loading are one-off costs
    before, requests = counting.sent, 0
    with httpx.Client() as client:
        for conv in range(10):
            for i in range(3):
                chat(url, turn(f"conv {conv}", i), client)
                requests += 1
        per_request = (counting.sent - before) / requests
        pinned = chat(url, turn("retried", 0), client).headers["x-warmroute-backend"]
        r.engines[pinned].fail_next = 1
        before_retry = counting.sent
        retried = chat(url, turn("retried", 1), client)
    assert per_request == 2, per_request  # 10 claims + 20 hits: one view and one commit each
    # The failure path pays one more: the retry moves the pin to the engine that now holds the prefix.
    assert retried.headers["x-warmroute-route"] == "retry_next"
    assert counting.sent - before_retry == 3


def test_redis_dying_mid_traffic_is_invisible_to_clients_and_pins_come_back(
    private_redis: RedisServer, replicas: ReplicasFactory
) -> None:
    fast = {"url": private_redis.url, "reconnect_min_s": 0.05, "reconnect_max_s": 0.2}
    # A heartbeat (how gw1, which serves nothing until the end, sees the outage and Redis's return) with a
    # lease that outlives a heartbeat late by seconds on a loaded machine.
    r = replicas(2, redis={**fast, "heartbeat_s": 0.5, "lease_ttl_s": 10.0})
    gw0, gw1 = r.urls
    store0, store1 = (gw.store for gw in r.gateways)
    assert isinstance(store0, RedisAffinityStore) and isinstance(store1, RedisAffinityStore)
    placed = {
        f"before {i}": chat(gw0, turn(f"before {i}", 0)).headers["x-warmroute-backend"] for i in range(6)
    }
    failures: list[str] = []
    moved: list[str] = []
    answered: list[int] = []  # one entry per successful request; its length is read by the test thread
    progress = threading.Condition()  # notified after every request of the traffic thread
    stop = threading.Event()

    def traffic() -> None:
        with httpx.Client(timeout=10) as client:
            n = 0
            while not stop.is_set():
                conv = f"before {n % 6}"
                n += 1
                try:
                    resp = client.post(
                        gw0 + "/v1/chat/completions", json={"model": "m", "messages": turn(conv, 1 + n % 3)}
                    )
                except httpx.HTTPError as exc:
                    failures.append(repr(exc))
                    continue
                with progress:
                    if resp.status_code != 200:
                        failures.append(f"{resp.status_code} {resp.text}")
                    elif resp.headers["x-warmroute-backend"] != placed[conv]:
                        moved.append(conv)
                    else:
                        answered.append(n)
                    progress.notify_all()

    def flows(more: int) -> None:
        """Wait until the traffic thread has had ``more`` further requests answered."""
        with progress:
            target = len(answered) + more
            assert progress.wait_for(lambda: len(answered) >= target or failures, ANNOUNCED_S), "no traffic"

    worker = threading.Thread(target=traffic, daemon=True)
    worker.start()
    try:
        flows(5)  # traffic flows before the outage
        private_redis.kill()
        r.wait_for(0, lambda: store0.degraded, "gw0 routing from local state")
        flows(5)  # and during it
        ready = httpx.get(gw0 + "/readyz")
        assert ready.status_code == 200  # degraded is a detail, not unreadiness
        assert ready.json()["shared_state"]["degraded"] is True
        assert "warmroute_shared_state_degraded 1.0" in httpx.get(gw0 + "/metrics").text
        during = {
            f"during {i}": chat(gw0, turn(f"during {i}", 0)).headers["x-warmroute-backend"] for i in range(6)
        }
        private_redis.start()  # same port, empty
        r.wait_for(0, lambda: not store0.degraded, "gw0 back on Redis")
        r.wait_for(1, lambda: not store1.degraded, "gw1 back on Redis")
        for url in (gw0, gw1):
            assert httpx.get(url + "/readyz").json()["shared_state"]["degraded"] is False
        flows(5)  # and again through Redis
    finally:
        stop.set()
        worker.join(10)
    assert failures == []
    assert moved == []
    assert "warmroute_shared_state_degraded 0.0" in httpx.get(gw0 + "/metrics").text
    keys = RedisKeys(r.gateways[0].settings.redis.prefix)
    pins = [keys.pin(chat_key({"model": "m", "messages": turn(conv, 0)})) for conv in during]
    assert private_redis.client().mget(pins) == list(during.values())  # written back after the restart
    # The replica that never saw them follows the pins made during the outage and those from before it.
    for conv, backend in {**during, **placed}.items():
        resp = chat(gw1, turn(conv, 5))
        assert (resp.headers["x-warmroute-backend"], resp.headers["x-warmroute-route"]) == (
            backend,
            "affinity_hit",
        )


def test_ttft_routing_still_costs_at_most_two_round_trips_and_its_pins_are_shared(
    replicas: ReplicasFactory,
) -> None:
    """Routing v2 keeps its learning local; pins (including the extended keys of turns >= 2) are shared."""
    counting = CountingConnection.fresh()

    def store(settings: Any) -> RedisAffinityStore:
        pool = redis_pool(settings.redis, connection_class=counting)
        return RedisAffinityStore(
            settings.redis, settings.routing, [b.id for b in settings.backends], pool=pool
        )

    r = replicas(2, ("a", "b"), redis={"heartbeat_s": 60, "lease_ttl_s": 120}, store=store,
                 routing={"policy": "ttft"}, admin=QUIET_ADMIN)  # fmt: skip
    chat(r.urls[0], turn("warm-up", 0))
    chat(r.urls[1], turn("warm-up", 0))
    before, requests = counting.sent, 0
    with httpx.Client() as client:
        for conv in range(6):
            seen = set()
            for i in range(4):
                # turns 1-2 on replica 0, later ones on replica 1: it finds the pin turn 2 claimed
                response = chat(r.urls[0 if i < 2 else 1], turn(f"conv {conv}", i), client)
                seen.add(response.headers["x-warmroute-backend"])
                requests += 1
            assert len(seen) == 1, seen
    assert (counting.sent - before) / requests <= 2
