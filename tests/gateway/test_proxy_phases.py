"""The proxy's phases on the in-memory transport: no sockets, exact outcomes, every response closed."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from backends.breaker import BreakerPolicy, CircuitBreaker
from backends.registry import Registry
from config.settings import Settings, load_settings
from gateway.context import RequestContext
from gateway.metrics import Metrics
from gateway.proxy import AdmitAll, Proxy, RequestFeed
from gateway.shapes.table import CHAT
from gateway.state import MemoryAffinityStore
from gateway.transport import (
    UpstreamConnectError,
    UpstreamPoolTimeout,
    UpstreamReadError,
    UpstreamStaleConnection,
)
from routing.policies.round_robin import RoundRobinPolicy
from routing.types import BackendState

from transports import FakeTransport, Reply

pytestmark = pytest.mark.anyio
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
OK = {"choices": [{"message": {"content": "fine"}}]}


def backends_ab(**timeouts: float) -> tuple[Settings, MemoryAffinityStore, Registry]:
    """Backends a and b, both ready, over one memory store."""
    settings = load_settings(
        None,
        backends=[{"id": n, "url": f"http://{n}", "models": ["m"]} for n in ("a", "b")],
        timeouts=timeouts,
    )
    store = MemoryAffinityStore(settings.routing)
    registry = Registry(settings.backends, listener=store)
    for b in registry.backends.values():
        b.state = BackendState.READY
    return settings, store, registry


def make_proxy(
    fake: FakeTransport,
    *modules: object,
    feed: RequestFeed | None = None,
    parts: tuple[Settings, MemoryAffinityStore, Registry] | None = None,
    **timeouts: float,
) -> Proxy:
    """A proxy over ``parts`` (default: ``backends_ab``) with ``modules``, all given at construction."""
    settings, store, registry = parts or backends_ab(**timeouts)
    metrics = Metrics(registry)
    return Proxy(settings.timeouts, registry, store, feed or AdmitAll(), metrics, fake, modules)


def context() -> RequestContext:
    raw = json.dumps(BODY).encode()
    return RequestContext(
        "POST", "/v1/chat/completions", raw, BODY, "m", "k", RoundRobinPolicy(), [], {}, CHAT
    )


async def run(proxy: Proxy, ctx: RequestContext) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await proxy.forward(receive, send, ctx)
    return sent


def status_and_body(sent: list[dict[str, Any]]) -> tuple[int, bytes]:
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


async def test_a_stale_post_is_retried_visibly_on_the_next_backend_never_resent() -> None:
    fake = FakeTransport()
    fake.script("http://a", Reply(error=UpstreamStaleConnection("closed before any byte")))
    fake.script("http://b", Reply.json(OK))
    proxy = make_proxy(fake)
    sent = await run(proxy, ctx := context())
    assert status_and_body(sent) == (200, json.dumps(OK).encode())
    assert [r.origin for r in fake.requests] == ["http://a", "http://b"]
    assert (ctx.reason.value, ctx.outcome.value) == ("retry_next", "ok")
    assert dict(sent[0]["headers"])[b"x-warmroute-route"] == b"retry_next"
    assert fake.unclosed() == [] and proxy.registry.total_in_flight() == 0


async def test_pool_timeout_on_both_backends_is_a_503_naming_saturation() -> None:
    fake = FakeTransport()
    for origin in ("http://a", "http://b"):
        fake.script(origin, Reply(error=UpstreamPoolTimeout("all 1 connections busy for 0.1 s")))
    proxy = make_proxy(fake)
    status, body = status_and_body(await run(proxy, context()))
    assert status == 503
    assert json.loads(body)["error"] == {
        "message": "backend b is saturated",
        "type": "server_error",
        "param": None,
        "code": "upstream_busy",
    }
    assert proxy.registry.total_in_flight() == 0


async def test_a_5xx_body_is_closed_before_the_retry_and_the_retry_body_relayed() -> None:
    fake = FakeTransport()
    fake.script("http://a", Reply.json({"error": "boom"}, status=500))
    fake.script(
        "http://b", Reply(200, [(b"content-type", b"text/event-stream")], [b"data: 1\n\n", b"data: 2\n\n"])
    )
    proxy = make_proxy(fake)
    sent = await run(proxy, context())
    assert status_and_body(sent) == (200, b"data: 1\n\ndata: 2\n\n")
    first, second = fake.responses
    assert first.closed and not first.finished  # abandoned unread
    assert second.closed and second.finished
    assert proxy.registry.total_in_flight() == 0


async def test_engine_silence_after_the_head_ends_the_stream_with_an_error_event() -> None:
    stall = asyncio.Event()  # never set
    fake = FakeTransport()
    fake.script("http://a", Reply(200, [(b"content-type", b"text/event-stream")], [b"data: 1\n\n", stall]))
    proxy = make_proxy(fake, read_s=0.05)
    status, body = status_and_body(await run(proxy, context()))
    assert status == 200
    assert body.startswith(b"data: 1\n\nevent: error\ndata: ")
    assert b'"code": "upstream_timeout"' in body and b"sent nothing for 0.05s" in body
    assert body.endswith(b"data: [DONE]\n\n")
    assert fake.unclosed() == [] and proxy.registry.total_in_flight() == 0


class BreakerFeed:
    """Real circuit breakers behind the proxy's feed; records every outcome it is told."""

    def __init__(self, policy: BreakerPolicy | None = None) -> None:
        self.breakers = {n: CircuitBreaker(policy) for n in ("a", "b")}
        self.outcomes: list[tuple[str, str]] = []  # (backend, "ok"/"failed"/"5xx from <client>"/"abstain")
        self.unreachable_seen: list[str] = []

    def admit(self, backend_id: str) -> bool:
        return self.breakers[backend_id].begin(time.monotonic())

    def outcome(self, backend_id: str, ok: bool) -> None:
        self.outcomes.append((backend_id, "ok" if ok else "failed"))
        self.breakers[backend_id].record(ok, time.monotonic())

    def answer_failed(self, backend_id: str, client: str) -> None:
        self.outcomes.append((backend_id, f"5xx from {client}"))
        self.breakers[backend_id].record(False, time.monotonic(), client)

    def abstain(self, backend_id: str) -> None:
        self.outcomes.append((backend_id, "abstain"))
        self.breakers[backend_id].abstain(time.monotonic())

    def unreachable(self, backend_id: str, error: str) -> None:
        self.unreachable_seen.append(backend_id)
        self.outcome(backend_id, False)


def proxy_with(fake: FakeTransport, feed: BreakerFeed) -> Proxy:
    return make_proxy(fake, feed=feed)


async def test_every_attempt_feeds_the_breaker_and_a_4xx_is_a_success() -> None:
    fake = FakeTransport()
    fake.script("http://a", Reply.json(OK, status=500), Reply.json({"error": {}}, status=400))
    fake.script("http://b", Reply(error=UpstreamConnectError("refused")))
    feed = BreakerFeed()
    proxy = proxy_with(fake, feed)
    assert status_and_body(await run(proxy, context()))[0] == 502  # a: 500, retried on b: refused
    assert status_and_body(await run(proxy, context()))[0] == 400  # then a again: its 400
    # a's 500 is judged once b's attempt is known: b failed without an answer, so nobody confirmed it.
    assert feed.outcomes == [("b", "failed"), ("a", "5xx from unknown"), ("a", "ok")]
    assert feed.unreachable_seen == ["b"]


async def test_half_open_lets_one_trial_through_and_routes_the_others_on() -> None:
    fake = FakeTransport()
    gate = asyncio.Event()
    held = Reply.json(OK)
    held.before_head = gate  # the trial stays in flight until the test lets it answer
    fake.script("http://a", held)
    fake.script("http://b", Reply.json(OK), Reply.json(OK))
    feed = BreakerFeed(BreakerPolicy(failure_threshold=1, open_s=0.01, open_max_s=0.01))
    feed.breakers["a"].record(False, time.monotonic() - 1)  # opened a second ago: half-open now
    proxy = proxy_with(fake, feed)
    trial = asyncio.create_task(run(proxy, context()))
    while not fake.requests:  # noqa: ASYNC110 - the fake transport announces nothing
        await asyncio.sleep(0)
    others = [await run(proxy, context()) for _ in range(2)]  # round robin would pick a for one of them
    assert [r.origin for r in fake.requests] == ["http://a", "http://b", "http://b"]
    gate.set()
    assert status_and_body(await trial)[0] == 200
    assert all(status_and_body(sent)[0] == 200 for sent in others)
    assert feed.breakers["a"].state(time.monotonic()).value == "closed"


async def test_an_engine_that_breaks_mid_stream_is_a_breaker_failure_too() -> None:
    fake = FakeTransport()
    sse = [(b"content-type", b"text/event-stream")]
    fake.script("http://a", Reply(200, sse, [b"data: {}\n\n", UpstreamReadError("reset by peer")]))
    feed = BreakerFeed()
    sent = await run(proxy_with(fake, feed), context())
    assert b"event: error" in status_and_body(sent)[1]
    assert feed.outcomes == [("a", "ok"), ("a", "failed")]  # the head was an answer; the break was not


async def test_a_5xx_from_both_engines_is_the_requests_own_and_held_against_neither(
    caplog: pytest.LogCaptureFixture,
) -> None:
    fake = FakeTransport()
    fake.script("http://a", Reply.json({"error": "poison"}, status=500))
    fake.script("http://b", Reply.json({"error": "poison"}, status=502))
    feed = BreakerFeed(BreakerPolicy(failure_threshold=1))
    with caplog.at_level("WARNING", logger="warmroute.blame"):
        status, _ = status_and_body(await run(proxy_with(fake, feed), context()))
    assert status == 502  # the retry's own answer, relayed
    assert feed.outcomes == [("a", "abstain"), ("b", "abstain")]
    states = {n: b.state(time.monotonic()).value for n, b in feed.breakers.items()}
    assert states == {"a": "closed", "b": "closed"}
    assert [r.getMessage() for r in caplog.records if r.name == "warmroute.blame"] == [
        "POST /v1/chat/completions from unknown: 500 from backend a, then 502 from backend b: the request's "
        "own failure, held against neither breaker"
    ]
    assert fake.unclosed() == []


async def test_a_5xx_that_another_engine_answers_counts_against_the_engine() -> None:
    fake = FakeTransport()
    fake.script("http://a", Reply.json({"error": "engine broke"}, status=500))
    fake.script("http://b", Reply.json(OK))
    feed = BreakerFeed(BreakerPolicy(failure_threshold=1))
    assert status_and_body(await run(proxy_with(fake, feed), context()))[0] == 200
    assert feed.outcomes == [("b", "ok"), ("a", "failed")]  # the input was fine: a's failure is a's own
    assert feed.breakers["a"].state(time.monotonic()).value == "open"


async def test_a_5xx_with_nobody_else_to_ask_counts_per_client() -> None:
    fake = FakeTransport()
    fake.script("http://a", *[Reply.json({"error": "?"}, status=500)] * 3)
    feed = BreakerFeed(BreakerPolicy(failure_threshold=1))
    feed.breakers["b"].record(False, time.monotonic())  # b open: a is the only choice
    proxy = proxy_with(fake, feed)
    for client in ("x", "x", "y"):
        ctx = context()
        ctx.client = client
        assert status_and_body(await run(proxy, ctx))[0] == 500
    assert feed.outcomes == [("a", "5xx from key:x"), ("a", "5xx from key:x"), ("a", "5xx from key:y")]
    assert feed.breakers["a"].consecutive_failures == 3
    assert feed.breakers["a"].state(time.monotonic()).value == "open"  # x alone did not; y's made two


async def test_a_poison_request_that_takes_the_half_open_trial_gives_it_back() -> None:
    fake = FakeTransport()
    fake.script("http://a", Reply.json({"error": "poison"}, status=500), Reply.json(OK))
    fake.script("http://b", Reply.json({"error": "poison"}, status=500))
    feed = BreakerFeed(BreakerPolicy(failure_threshold=1, open_s=0.01, open_max_s=0.01))
    feed.breakers["a"].record(False, time.monotonic() - 1)  # opened a second ago: half-open now
    proxy = proxy_with(fake, feed)
    assert status_and_body(await run(proxy, context()))[0] == 500  # the trial on a, then b: both 500
    assert feed.breakers["a"].state(time.monotonic()).value == "half_open"
    assert feed.breakers["a"].allows(time.monotonic())  # the trial slot is free again
    ctx = context()
    ctx.ineligible = frozenset({"b"})
    assert status_and_body(await run(proxy, ctx))[0] == 200  # the next request is the trial, and closes it
    assert feed.breakers["a"].state(time.monotonic()).value == "closed"
