"""The server writes a response's head with its first body message: one write for an answer read whole, the
same bytes as uvicorn's, and a head never waits on a body that is not there yet.

The protocol runs on the real loop over a spy transport that records each write; uvicorn's own protocol over
another spy gives the bytes to expect."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.server_protocol import GatewayHttpProtocol

pytestmark = pytest.mark.anyio

App = Callable[[Any, Any, Any], Awaitable[None]]
GET = b"GET /x HTTP/1.1\r\nhost: t\r\n\r\n"
SIZED = [(b"content-type", b"application/json"), (b"content-length", b"11")]


@pytest.fixture(params=["asyncio", ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


class Spy:
    """A transport that records each write (``writelines`` is one write: one writev)."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False
        self.wrote = asyncio.Event()

    def write(self, data: bytes) -> None:
        assert not self.closed, "written after close"
        self.writes.append(bytes(data))
        self.wrote.set()

    def writelines(self, parts: Any) -> None:
        self.write(b"".join(parts))

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


async def serve_one(
    protocol: type[HttpToolsProtocol], app: App, request: bytes = GET, spy: Spy | None = None
) -> Spy:
    """``request`` through ``protocol`` serving ``app`` (over ``spy``); returns once the app returned."""
    done = asyncio.Event()

    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        try:
            await app(scope, receive, send)
        finally:
            done.set()

    config = uvicorn.Config(wrapped, proxy_headers=False, log_level="critical")
    config.load()
    proto = protocol(config, ServerState(), {})
    spy = spy or Spy()
    proto.connection_made(spy)  # type: ignore[arg-type]
    proto.data_received(request)
    await done.wait()
    await asyncio.sleep(0)  # the turn after the app's last send (nothing held may be left over)
    proto.connection_lost(None)
    return spy


def answer(*messages: dict[str, Any]) -> App:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        for message in messages:
            await send(message)

    return app


START = {"type": "http.response.start", "status": 200, "headers": SIZED}


async def test_an_answer_read_whole_goes_in_one_write_with_uvicorns_bytes() -> None:
    app = answer(START, {"type": "http.response.body", "body": b'{"ok": true}'[:11]})
    ours, theirs = await serve_one(GatewayHttpProtocol, app), await serve_one(HttpToolsProtocol, app)
    assert len(theirs.writes) == 2  # uvicorn: the head, then the body
    assert ours.writes == [b"".join(theirs.writes)]


async def test_a_chunked_answer_saves_the_heads_write_and_keeps_every_byte() -> None:
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
    app = answer(
        start,
        {"type": "http.response.body", "body": b"a", "more_body": True},
        {"type": "http.response.body", "body": b"bc", "more_body": False},
    )
    ours, theirs = await serve_one(GatewayHttpProtocol, app), await serve_one(HttpToolsProtocol, app)
    assert len(theirs.writes) == 3 and len(ours.writes) == 2
    assert ours.writes[0] == theirs.writes[0] + theirs.writes[1]
    assert b"".join(ours.writes) == b"".join(theirs.writes)


async def test_a_large_body_goes_beside_the_head_in_the_same_write() -> None:
    big = b"x" * 100_000
    headers = [(b"content-length", str(len(big)).encode())]
    app = answer(
        {"type": "http.response.start", "status": 200, "headers": headers},
        {"type": "http.response.body", "body": big},
    )
    ours, theirs = await serve_one(GatewayHttpProtocol, app), await serve_one(HttpToolsProtocol, app)
    assert ours.writes == [b"".join(theirs.writes)]


async def test_a_head_goes_on_its_own_while_the_body_is_not_there_yet() -> None:
    # An SSE stream whose first event waits on the engine: the client has its head at once.
    gate, spy = asyncio.Event(), Spy()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        sse = [(b"content-type", b"text/event-stream")]
        await send({"type": "http.response.start", "status": 200, "headers": sse})
        await gate.wait()
        await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": False})

    served = asyncio.ensure_future(serve_one(GatewayHttpProtocol, app, GET, spy))
    await spy.wrote.wait()
    (head,) = spy.writes
    assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")  # the head alone
    gate.set()
    await served
    assert spy.writes[1:] == [b"9\r\ndata: 1\n\n\r\n0\r\n\r\n"]


async def test_a_head_request_gets_its_head_alone_as_uvicorn_sends_it() -> None:
    app = answer(START, {"type": "http.response.body", "body": b""})
    request = b"HEAD /x HTTP/1.1\r\nhost: t\r\n\r\n"
    ours = await serve_one(GatewayHttpProtocol, app, request)
    theirs = await serve_one(HttpToolsProtocol, app, request)
    assert ours.writes == theirs.writes and len(ours.writes) == 1


async def test_an_app_failing_after_the_head_still_sends_it_before_the_close() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(START)
        raise RuntimeError("a defect after the head")

    ours, theirs = await serve_one(GatewayHttpProtocol, app), await serve_one(HttpToolsProtocol, app)
    assert ours.writes == theirs.writes and len(ours.writes) == 1
    assert ours.closed and theirs.closed


async def test_a_connection_close_answer_writes_once_then_closes() -> None:
    app = answer(START, {"type": "http.response.body", "body": b"01234567890"})
    request = b"GET /x HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n"
    ours = await serve_one(GatewayHttpProtocol, app, request)
    theirs = await serve_one(HttpToolsProtocol, app, request)
    assert ours.writes == [b"".join(theirs.writes)] and ours.closed
