"""A routing decision counts on its backend from the moment it is made, while its pin commits (a round trip
with Redis): requests routed meanwhile, on this replica or on another sharing Redis, see it placed; the count
is back to zero whatever ends the request (an answer, a client gone)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, MutableMapping
from typing import Any

import pytest
from test_proxy_phases import run

from backends.registry import Registry
from config.settings import RedisConfig, RoutingConfig, load_settings
from gateway.context import RequestContext
from gateway.metrics import Metrics
from gateway.proxy import AdmitAll, Proxy
from gateway.redis_store import RedisAffinityStore
from gateway.shapes.table import CHAT
from gateway.state import MemoryAffinityStore, StoreView
from routing.params import RoutingParams
from routing.policies.affinity import AffinityPolicy
from routing.types import BackendState, Decision, Reason
from tools.redis_server import RedisServer

from transports import FakeTransport, Reply

pytestmark = pytest.mark.anyio

POLICY = AffinityPolicy(RoutingParams("affinity", 2.0, 8, False))
OK = {"choices": [{"message": {"content": "fine"}}]}
BACKENDS = ("x", "y")


def request(conversation: str) -> RequestContext:
    body = {"model": "m", "messages": [{"role": "user", "content": conversation}]}
    raw = json.dumps(body).encode()
    return RequestContext("POST", "/v1/chat/completions", raw, body, "m", conversation, POLICY, [], {}, CHAT)


def proxy_over(store: Any, fake: FakeTransport) -> Proxy:
    settings = load_settings(
        None, backends=[{"id": n, "url": f"http://{n}", "models": ["m"]} for n in BACKENDS]
    )
    registry = Registry(settings.backends, listener=store)
    for b in registry.backends.values():
        b.state = BackendState.READY
    return Proxy(settings.timeouts, registry, store, AdmitAll(), Metrics(registry), fake, ())


class _GatedCommit(MemoryAffinityStore):
    """A memory store whose commit waits for ``go``, as a round trip would (``commit_is_round_trip``)."""

    commit_is_round_trip = True

    def __init__(self) -> None:
        super().__init__(RoutingConfig())
        self.go = asyncio.Event()
        self.committing = asyncio.Event()

    async def commit(self, key: str, decision: Decision) -> str:
        self.committing.set()
        await self.go.wait()
        return await super().commit(key, decision)


def in_flight(proxy: Proxy) -> dict[str, int]:
    return {b.id: b.in_flight for b in proxy.registry.backends.values()}


async def test_a_decision_counts_on_its_backend_while_its_pin_commits() -> None:
    store = _GatedCommit()
    fake = FakeTransport()
    fake.script("http://x", Reply.json(OK))
    fake.script("http://y", Reply.json(OK))
    proxy = proxy_over(store, fake)
    first = asyncio.create_task(run(proxy, one := request("task 0")))
    await store.committing.wait()
    assert sorted(in_flight(proxy).values()) == [0, 1]  # counted before the commit returned
    store.committing.clear()
    second = asyncio.create_task(run(proxy, two := request("task 1")))
    await store.committing.wait()
    assert in_flight(proxy) == {"x": 1, "y": 1}  # the second saw the first placed: it went elsewhere
    store.go.set()
    await asyncio.gather(first, second)
    assert one.backend is not None and two.backend is not None
    assert {one.backend.id, two.backend.id} == {"x", "y"}
    assert (one.reason, two.reason) == (Reason.NEW_LEAST_LOADED, Reason.NEW_LEAST_LOADED)
    assert in_flight(proxy) == {"x": 0, "y": 0} and fake.unclosed() == []


async def test_a_client_gone_during_the_commit_leaves_no_count_behind() -> None:
    store = _GatedCommit()
    proxy = proxy_over(store, FakeTransport())  # nothing scripted: no request may reach an engine
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        return None

    task = asyncio.create_task(proxy.forward(receive, send, ctx := request("task 0")))
    await store.committing.wait()
    assert sum(in_flight(proxy).values()) == 1
    gone.set()
    await task
    assert ctx.outcome.value == "client_disconnect"
    assert in_flight(proxy) == {"x": 0, "y": 0}


async def test_a_store_that_commits_in_place_is_not_held() -> None:
    store = MemoryAffinityStore(RoutingConfig())
    fake = FakeTransport()
    fake.script("http://x", Reply.json(OK))
    fake.script("http://y", Reply.json(OK))
    proxy = proxy_over(store, fake)
    started: list[str] = []
    store.started = started.append  # type: ignore[method-assign, assignment]
    await run(proxy, request("task 0"))
    assert len(started) == 1  # the seat's lease only


# -- two replicas sharing a real Redis ----------------------------------------------------------------------


class _Watched(RedisAffinityStore):
    """Replica A: right after each commit, what replica B's view shows (B's one round trip)."""

    def __init__(self, other: Callable[[], RedisAffinityStore], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.other = other
        self.seen: list[StoreView] = []

    async def commit(self, key: str, decision: Decision) -> str:
        winner = await super().commit(key, decision)
        self.seen.append(await self.other().view(None))
        return winner


@pytest.fixture
async def pair(redis_server: RedisServer, redis_prefix: str) -> AsyncIterator[tuple[Proxy, _Watched, Any]]:
    # No heartbeat during the test: what B sees of A was published by A's own commit script.
    cfg = RedisConfig(
        url=redis_server.url, prefix=redis_prefix, timeout_s=2.0, heartbeat_s=600, lease_ttl_s=1200
    )
    b = RedisAffinityStore(cfg, RoutingConfig(), BACKENDS)
    a = _Watched(lambda: b, cfg, RoutingConfig(), BACKENDS)
    await a.start()
    await b.start()
    fake = FakeTransport()
    fake.script("http://x", Reply.json(OK), Reply.json(OK))
    fake.script("http://y", Reply.json(OK), Reply.json(OK))
    yield proxy_over(a, fake), a, b
    await a.aclose()
    await b.aclose()


async def test_another_replica_sees_a_placement_as_soon_as_its_commit_returns(
    pair: tuple[Proxy, _Watched, RedisAffinityStore],
) -> None:
    proxy, a, b = pair
    await run(proxy, ctx := request("task 0"))
    assert ctx.backend is not None
    chosen = ctx.backend.id
    (seen,) = a.seen
    assert seen.in_flight == {chosen: 1, ({"x", "y"} - {chosen}).pop(): 0}  # published by the commit
    assert seen.conversations[chosen] == 1
    assert in_flight(proxy) == {"x": 0, "y": 0}
    assert a._in_flight == {"x": 0, "y": 0}  # the hold and the lease both given back: no stray count
    # A's next round trip publishes zero again, and B's next view reads it.
    await a.view(None)
    assert (await b.view(None)).in_flight == {"x": 0, "y": 0}
