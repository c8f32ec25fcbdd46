"""The reasoning relay in the proxy, on the in-memory transport: any SSE framing at the engine's pace, the
silence clock on the engine's bytes, and bounded holds (an oversized event, a non-streamed body)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any, Literal

import pytest

from backends.registry import Registry
from config.settings import ReasoningFields, load_settings
from gateway.context import RequestContext
from gateway.exchange import RelayLimits
from gateway.metrics import Metrics
from gateway.proxy import Proxy
from gateway.reasoning import ReasoningRelay
from gateway.shapes.table import CHAT
from gateway.state import MemoryAffinityStore
from routing.policies.round_robin import RoundRobinPolicy
from routing.types import BackendState

from transports import FakeTransport, Reply, Step

pytestmark = pytest.mark.anyio
SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]


class Feed:
    """The proxy's breaker feed, recording what it is told."""

    def __init__(self) -> None:
        self.outcomes: list[tuple[str, bool]] = []

    def admit(self, backend_id: str) -> bool:
        return True

    def outcome(self, backend_id: str, ok: bool) -> None:
        self.outcomes.append((backend_id, ok))

    def unreachable(self, backend_id: str, error: str) -> None:
        self.outcomes.append((backend_id, False))


def make_proxy(
    fake: FakeTransport, relay: ReasoningRelay, limits: RelayLimits | None = None, **timeouts: float
) -> Proxy:
    settings = load_settings(
        None, backends=[{"id": "a", "url": "http://a", "models": ["m"]}], timeouts=timeouts
    )
    store = MemoryAffinityStore(settings.routing)
    registry = Registry(settings.backends, listener=store)
    registry.backends["a"].state = BackendState.READY
    metrics = Metrics(registry)
    return Proxy(settings.timeouts, registry, store, Feed(), metrics, fake, (relay,), limits=limits)


def relay() -> ReasoningRelay:
    return ReasoningRelay(ReasoningFields.BOTH, lambda _model: True)


def context(stream: bool) -> RequestContext:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    raw = json.dumps(body).encode()
    return RequestContext(
        "POST", "/v1/chat/completions", raw, body, "m", "k", RoundRobinPolicy(), [], {}, CHAT
    )


class Client:
    """The ASGI side: records what the gateway sends; the n-th body chunk received sets ``gates[n]``."""

    def __init__(self, gates: int = 0) -> None:
        self.sent: list[MutableMapping[str, Any]] = []
        self.gates = [asyncio.Event() for _ in range(gates)]
        self.chunks: list[bytes] = []

    async def run(self, proxy: Proxy, ctx: RequestContext) -> None:
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await never.wait()
            return {"type": "http.disconnect"}

        await proxy.forward(receive, self.send, ctx)

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.sent.append(message)
        if message.get("body"):
            self.chunks.append(message["body"])
            if len(self.chunks) <= len(self.gates):
                self.gates[len(self.chunks) - 1].set()

    @property
    def status(self) -> int:
        status: int = self.sent[0]["status"]
        return status

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)


def chunk(delta: dict[str, str]) -> bytes:
    return json.dumps({"choices": [{"index": 0, "delta": delta}]}, separators=(",", ":")).encode()


@pytest.mark.parametrize("newline", [b"\r\n", b"\r"], ids=["crlf", "cr"])
async def test_a_crlf_or_cr_framed_stream_is_relayed_at_the_engine_pace(newline: bytes) -> None:
    events = [
        b"data: " + chunk({"reasoning": "think"}) + newline * 2,
        b": keep-alive" + newline * 2,
        b"data: " + chunk({"content": "answer"}) + newline * 2,
        b"data: [DONE]" + newline * 2,
    ]
    client = Client(gates=3)
    steps: list[Step] = [events[0], client.gates[0], events[1], client.gates[1], events[2], client.gates[2]]
    fake = FakeTransport()
    fake.script("http://a", Reply(200, SSE, [*steps, events[3]]))
    proxy = make_proxy(fake, relay(), read_s=30)
    await client.run(proxy, ctx := context(stream=True))
    # Each event reached the client before the engine sent the next (the engine waits for that), one body
    # message each, the reasoning one rewritten in the engine's own framing.
    rewritten = b"data: " + chunk({"reasoning": "think", "reasoning_content": "think"}) + newline * 2
    assert client.chunks == [rewritten, *events[1:]]
    assert ctx.outcome.value == "ok"
    assert fake.unclosed() == [] and proxy.registry.total_in_flight() == 0


class VirtualClock:
    """The running loop's clock, moved only by the engine's steps: the silence watch sees exactly the
    engine's pace, however fast or slow this machine is."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.now = loop.time()

    def __call__(self) -> float:
        return self.now


class Takes(asyncio.Event):
    """A body step: the engine takes ``seconds`` (on the virtual clock) before its next bytes."""

    def __init__(self, clock: VirtualClock, seconds: float) -> None:
        super().__init__()
        self.clock, self.seconds = clock, seconds

    async def wait(self) -> Literal[True]:
        self.clock.now += self.seconds
        for _ in range(3):  # timers now due (the silence watch's) run before the engine's next bytes
            await asyncio.sleep(0)
        return True


@contextmanager
def virtual_time() -> Iterator[VirtualClock]:
    loop = asyncio.get_running_loop()
    clock = VirtualClock(loop)
    loop.time = clock  # type: ignore[method-assign]
    try:
        yield clock
    finally:
        del loop.time


async def test_a_slow_healthy_crlf_engine_is_never_cut_by_read_s() -> None:
    # One event each 0.5 s with read_s 1, each cut between its CR and LF: six events take 3 s.
    with virtual_time() as clock:
        steps: list[Step] = []
        for i in range(6):
            event = b"data: " + chunk({"reasoning": f"t{i}"}) + b"\r\n\r\n"
            steps += [Takes(clock, 0.5), event[:-1], event[-1:]]
        fake = FakeTransport()
        fake.script("http://a", Reply(200, SSE, [*steps, b"data: [DONE]\r\n\r\n"]))
        proxy = make_proxy(fake, relay(), read_s=1)
        client = Client()
        await client.run(proxy, ctx := context(stream=True))
    assert ctx.outcome.value == "ok"
    assert client.body.count(b"reasoning_content") == 6 and b"event: error" not in client.body
    assert proxy.feed.outcomes == [("a", True)]  # type: ignore[attr-defined]


async def test_the_silence_clock_runs_on_engine_bytes_not_on_finished_events() -> None:
    # One event dribbled over 3 s in reads 0.6 s apart: no event is complete for longer than read_s, yet
    # the engine is never silent for it. Then a real silence of 1.2 s is cut, and said to be one.
    with virtual_time() as clock:
        event = b"data: " + chunk({"reasoning": "slow"}) + b"\r\n\r\n"
        steps: list[Step] = []
        for i in range(0, len(event), 10):
            steps += [Takes(clock, 0.6), event[i : i + 10]]
        fake = FakeTransport()
        fake.script("http://a", Reply(200, SSE, [*steps, Takes(clock, 1.2), b"data: [DONE]\r\n\r\n"]))
        proxy = make_proxy(fake, relay(), read_s=1)
        client = Client()
        await client.run(proxy, ctx := context(stream=True))
    first, error = client.chunks[0], client.body[len(client.chunks[0]) :]
    assert first == b"data: " + chunk({"reasoning": "slow", "reasoning_content": "slow"}) + b"\r\n\r\n"
    assert error.startswith(b"event: error\ndata: ") and b"backend a sent nothing for 1s" in error
    assert ctx.outcome.value == "mid_stream_error"
    assert proxy.feed.outcomes == [("a", True), ("a", False)]  # type: ignore[attr-defined]
    assert fake.unclosed() == [] and proxy.registry.total_in_flight() == 0


async def test_a_non_streamed_reply_that_keeps_coming_is_not_cut_by_read_s() -> None:
    # Read whole to be rewritten, it takes 3 s in reads 0.6 s apart, with read_s 1: never silent.
    doc = {
        "choices": [{"index": 0, "message": {"role": "assistant", "reasoning_content": "r", "content": "c"}}]
    }
    raw = json.dumps(doc).encode()
    with virtual_time() as clock:
        steps: list[Step] = []
        for i in range(0, len(raw), len(raw) // 5 + 1):
            steps += [Takes(clock, 0.6), raw[i : i + len(raw) // 5 + 1]]
        fake = FakeTransport()
        fake.script("http://a", Reply(200, JSON, steps))
        proxy = make_proxy(fake, relay(), read_s=1)
        client = Client()
        await client.run(proxy, ctx := context(stream=False))
    assert client.status == 200 and ctx.outcome.value == "ok"
    message = json.loads(client.body)["choices"][0]["message"]
    assert message["reasoning"] == message["reasoning_content"] == "r"


async def test_a_non_streamed_reply_over_the_bound_is_a_502_and_never_held() -> None:
    never = asyncio.Event()  # the engine would go on: the gateway must stop reading first
    fake = FakeTransport()
    fake.script("http://a", Reply(200, JSON, [b"{" + b" " * 599, b" " * 600, never, b"}"]))
    proxy = make_proxy(fake, relay(), RelayLimits(max_reply_bytes=1000), read_s=30)
    client = Client()
    await client.run(proxy, ctx := context(stream=False))
    assert client.status == 502  # the head was held with the body: nothing of the 200 went out
    assert json.loads(client.body)["error"] == {
        "message": "backend a sent a reply larger than 1000 bytes; the gateway does not hold one that large "
        "to rewrite it (ask for a stream)",
        "type": "server_error",
        "param": None,
        "code": "upstream_reply_too_large",
    }
    (response,) = fake.responses
    assert response.closed and response.steps == [never, b"}"]  # read no further than past the bound
    assert ctx.outcome.value == "upstream_error"
    assert proxy.feed.outcomes == [("a", True)]  # type: ignore[attr-defined]  # it answered: no failure
    assert proxy.registry.total_in_flight() == 0


async def test_an_unterminated_oversized_event_passes_through_as_it_comes() -> None:
    # Bound 1 KiB: the event's first 1.1 KiB go at once, then each read before the engine sends the next.
    client = Client(gates=4)
    reads = [b"data: " + b"a" * 500, b"b" * 600, b"c" * 1000, b"d" * 1000, b"e" * 1000, b"f" * 1000]
    steps: list[Step] = [reads[0], reads[1]]
    for gate, read in zip(client.gates, reads[2:], strict=True):
        steps += [gate, read]
    tail = b"\r\n\r\ndata: " + chunk({"reasoning": "x"}) + b"\r\n\r\n"
    fake = FakeTransport()
    fake.script("http://a", Reply(200, SSE, [*steps, client_gate := asyncio.Event(), tail]))
    client.gates.append(client_gate)
    proxy = make_proxy(fake, relay(), RelayLimits(max_event_bytes=1024), read_s=30)
    await client.run(proxy, ctx := context(stream=True))
    assert client.chunks == [
        reads[0] + reads[1],
        *reads[2:],
        b"\r\n\r\ndata: " + chunk({"reasoning": "x", "reasoning_content": "x"}) + b"\r\n\r\n",
    ]
    assert ctx.outcome.value == "ok" and proxy.registry.total_in_flight() == 0


async def test_a_reply_whose_head_says_it_is_too_large_is_refused_unread() -> None:
    fake = FakeTransport()
    fake.script("http://a", Reply(200, [*JSON, (b"content-length", b"1001")], [b"{" + b" " * 999 + b"}"]))
    proxy = make_proxy(fake, relay(), RelayLimits(max_reply_bytes=1000), read_s=30)
    client = Client()
    await client.run(proxy, context(stream=False))
    assert client.status == 502
    assert json.loads(client.body)["error"]["code"] == "upstream_reply_too_large"
    (response,) = fake.responses
    assert response.closed and len(response.steps) == 1  # not a byte of the body read
    assert proxy.registry.total_in_flight() == 0
