"""gateway.upstream against real servers on 127.0.0.1: uvicorn for the ordinary cases, raw asyncio servers
for the protocol edge cases (exact bytes, closes at chosen moments). Every test runs on asyncio and uvloop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import shutil
import ssl
import subprocess
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from config.settings import UpstreamConfig
from gateway.http1 import READ_HIGH_WATER, Connection, needs_eof
from gateway.transport import (
    IDEMPOTENT_METHODS,
    UpstreamConnectError,
    UpstreamPoolTimeout,
    UpstreamProtocolError,
    UpstreamReadError,
    UpstreamResponseHeadTooLarge,
    UpstreamStaleConnection,
    UpstreamTransportError,
)
from gateway.upstream import (
    DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_RESPONSE_HEADER_BYTES,
    DEFAULT_MAX_RESPONSE_HEADERS,
    UpstreamPool,
    UpstreamResponse,
)
from tools.procs import free_port

from upstreams import FakeEngine, serve

pytestmark = pytest.mark.anyio

JSON = [(b"content-type", b"application/json")]


@pytest.fixture(params=["asyncio", ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture
async def pool(anyio_backend: Any) -> AsyncIterator[UpstreamPool]:
    p = UpstreamPool(connect_timeout=2.0, max_connections_per_origin=32)
    yield p
    await p.aclose()


async def read_all(response: UpstreamResponse) -> bytes:
    try:
        return b"".join([chunk async for chunk in response.aiter_raw()])
    finally:
        await response.aclose()


def idle(pool: UpstreamPool, origin: str) -> int:
    return sum(not conn.closing for conn in pool._origins[origin].idle)


async def until(predicate: Callable[[], bool], within: float = 10.0) -> None:
    """For state another thread or the kernel changes, where there is no event to wait on."""
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - no event to wait on
            await asyncio.sleep(0.005)


# -- a uvicorn app that records which client connection served each request ------------------------------


@dataclass
class Recorder:
    ports: list[int] = field(default_factory=list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.ports.append(scope["client"][1])
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        path, status = scope["path"], 200
        if path == "/echo":
            payload = body
        elif path.startswith("/status/"):
            status, payload = int(path.rsplit("/", 1)[1]), b""
        else:
            payload = b"hello world"
        length = b"11" if scope["method"] == "HEAD" else str(len(payload)).encode()
        headers = [(b"content-length", length), (b"X-Path", path.encode())] if status != 204 else []
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


@pytest.fixture
def recorder() -> Any:
    app = Recorder()
    with serve(app) as (url, _server):  # type: ignore[arg-type]
        yield url, app


# -- raw servers for exact bytes ----------------------------------------------------------------------


@dataclass
class RawServer:
    origin: str = ""
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    got_request: asyncio.Event = field(default_factory=asyncio.Event)
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)


Handler = Callable[[RawServer, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def raw_server(handler: Handler, tls: ssl.SSLContext | None = None) -> AsyncIterator[RawServer]:
    state = RawServer()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        state.connections += 1
        try:
            await handler(state, reader, writer)
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0, ssl=tls)
    scheme = "https" if tls else "http"
    state.origin = f"{scheme}://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        yield state
        server.close()


async def read_request(state: RawServer, reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    request = head + await reader.readexactly(length)
    state.requests.append(request)
    state.got_request.set()
    return request


async def wait_for_disconnect(state: RawServer, reader: asyncio.StreamReader) -> None:
    try:
        await reader.read()  # b"" at EOF; a reset raises ConnectionError, which also counts
    finally:
        state.disconnected.set()


def responder(*responses: bytes, then_close: bool = False) -> Handler:
    """Answer the n-th request on each connection with ``responses[n]``, then hang up: at once if
    ``then_close``, else on reading the next request (a keep-alive close crossing a request in flight)."""

    async def handle(state: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for response in responses:
            if await read_request(state, reader) is None:
                return
            writer.write(response)
            await writer.drain()
        if not then_close:
            await read_request(state, reader)

    return handle


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
EARLY = b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n"


# -- the ordinary cases ----------------------------------------------------------------------------


async def test_content_length_body_and_headers(pool: UpstreamPool, recorder: Any) -> None:
    url, _app = recorder
    response = await pool.request("POST", url, "/x?q=1", JSON, b'{"a": 1}')
    assert response.status == 200
    assert response.header(b"x-path") == b"/x"
    assert (b"content-length", b"11") in response.headers
    assert response.header(b"nope") is None
    assert await read_all(response) == b"hello world"


async def test_keep_alive_reuses_one_connection(pool: UpstreamPool, recorder: Any) -> None:
    url, app = recorder
    for _ in range(3):
        assert await read_all(await pool.request("GET", url, "/", [], b"")) == b"hello world"
    assert len(app.ports) == 3
    assert len(set(app.ports)) == 1
    assert idle(pool, url) == 1


async def test_chunked_chunks_are_yielded_as_they_arrive(pool: UpstreamPool) -> None:
    head_seen, first_seen = asyncio.Event(), asyncio.Event()
    second_sent = False

    async def handle(state: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal second_sent
        await read_request(state, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        await head_seen.wait()
        writer.write(b"5\r\nfirst\r\n")
        await first_seen.wait()
        second_sent = True
        writer.write(b"6\r\nsecond\r\n0\r\n\r\n")
        await read_request(state, reader)

    async with raw_server(handle) as srv:
        response = await pool.request("GET", srv.origin, "/", [], b"")
        head_seen.set()
        chunks = response.aiter_raw()
        async with asyncio.timeout(5):
            assert await anext(chunks) == b"first"
        assert not second_sent
        first_seen.set()
        async with asyncio.timeout(5):
            assert b"".join([c async for c in chunks]) == b"second"
        await response.aclose()
        assert idle(pool, srv.origin) == 1


async def test_many_concurrent_requests_share_the_connection_limit(pool: UpstreamPool, recorder: Any) -> None:
    url, app = recorder

    async def one(i: int) -> bytes:
        return await read_all(await pool.request("POST", url, "/echo", JSON, b"request-%d" % i))

    async with asyncio.timeout(30):
        bodies = await asyncio.gather(*(one(i) for i in range(200)))
    assert bodies == [b"request-%d" % i for i in range(200)]
    assert len(set(app.ports)) <= 32
    assert len(pool._conns) <= 32


class _CountedWrites:
    """A transport that counts the sends asked of it (``write`` / ``writelines`` calls) and does them."""

    def __init__(self, transport: asyncio.Transport, sends: list[int]) -> None:
        self._transport = transport
        self._sends = sends

    def write(self, data: bytes) -> None:
        self._sends.append(len(data))
        self._transport.write(data)

    def writelines(self, parts: Any) -> None:
        parts = list(parts)
        self._sends.append(sum(len(p) for p in parts))
        self._transport.writelines(parts)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


@pytest.mark.parametrize("size", [100, 16384, 16385, 40_000, 1 << 20])
async def test_a_request_goes_in_one_send_whatever_its_body_size(
    pool: UpstreamPool, recorder: Any, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """Head and body in one send: in two, the engine woke for the head alone and again for the body (an
    agent's follow-up is 20-40 KB), and the gateway could lose its core between the two."""
    url, _app = recorder
    sends: list[int] = []
    made = Connection.connection_made

    def counted(self: Connection, transport: asyncio.BaseTransport) -> None:
        made(self, transport)
        assert self.transport is not None
        self.transport = _CountedWrites(self.transport, sends)  # type: ignore[assignment]

    monkeypatch.setattr(Connection, "connection_made", counted)
    payload = os.urandom(size)
    for _ in range(2):  # a new connection, then the pooled one
        assert await read_all(await pool.request("POST", url, "/echo", JSON, payload)) == payload
    assert len(sends) == 2
    assert all(sent > size for sent in sends)  # each the whole request: head and body


async def test_one_mib_request_and_response(pool: UpstreamPool, recorder: Any) -> None:
    url, _app = recorder
    payload = os.urandom(1 << 20)
    assert await read_all(await pool.request("POST", url, "/echo", [], payload)) == payload


async def test_slow_consumer_pauses_the_socket(pool: UpstreamPool) -> None:
    size = 8 << 20

    async def handle(state: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(state, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        for _ in range(size // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()
        await read_request(state, reader)

    async with raw_server(handle) as srv:
        response = await pool.request("GET", srv.origin, "/", [], b"")
        conn = response._conn
        assert conn is not None
        await until(lambda: conn.paused)
        assert conn.buffered < READ_HIGH_WATER + (1 << 20)  # one read past the mark at most
        assert len(await read_all(response)) == size
        assert idle(pool, srv.origin) == 1


@pytest.mark.parametrize(
    ("method", "path", "connections"),
    [("HEAD", "/", 2), ("GET", "/status/204", 1), ("GET", "/status/304", 1)],
)
async def test_no_body_responses(
    pool: UpstreamPool, recorder: Any, method: str, path: str, connections: int
) -> None:
    url, app = recorder
    response = await pool.request(method, url, path, [], b"")
    assert response.status == (int(path.rsplit("/", 1)[1]) if "status" in path else 200)
    assert response.header(b"content-length") is None  # it frames nothing here (HEAD's says 11)
    assert await read_all(response) == b""
    assert await read_all(await pool.request("GET", url, "/", [], b"")) == b"hello world"
    # The connection stays in step; after HEAD the parser still waits for the 11 bytes the head announced:
    # that connection is not reused (an engine that gets HEAD wrong sends them).
    assert len(set(app.ports)) == connections


async def test_informational_response_is_skipped(pool: UpstreamPool) -> None:
    async with raw_server(responder(EARLY + OK)) as srv:
        response = await pool.request("GET", srv.origin, "/", [], b"")
        assert (response.status, response.headers) == (200, [(b"content-length", b"2")])
        assert await read_all(response) == b"ok"


async def test_close_delimited_body_is_read_to_eof(pool: UpstreamPool) -> None:
    async with raw_server(responder(b"HTTP/1.0 200 OK\r\n\r\nuntil the end", then_close=True)) as srv:
        assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"until the end"
        assert idle(pool, srv.origin) == 0


async def test_request_head_is_framed_by_the_pool(pool: UpstreamPool) -> None:
    async with raw_server(responder(OK)) as srv:
        smuggled = [(b"host", b"evil"), (b"content-length", b"99"), (b"x-a", b"1")]
        await read_all(await pool.request("POST", srv.origin + "/base/", "/v1/x", smuggled, b"{}"))
        host = srv.origin.removeprefix("http://").encode()
        assert srv.requests == [
            b"POST /base/v1/x HTTP/1.1\r\nhost: %s\r\ncontent-length: 2\r\nx-a: 1\r\n\r\n{}" % host
        ]
        with pytest.raises(ValueError):
            await pool.request("GET", srv.origin, "/a b", [], b"")


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = (tmp_path_factory.mktemp("tls") / name for name in ("cert.pem", "key.pem"))
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


@pytest.mark.needs("openssl")
async def test_https(anyio_backend: Any, certificate: tuple[Path, Path]) -> None:
    cert, key = certificate
    server_side = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_side.load_cert_chain(cert, key)
    chunked = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n"
    async with raw_server(responder(chunked, OK), tls=server_side) as srv:
        pool = UpstreamPool(connect_timeout=2.0, ssl_context=ssl.create_default_context(cafile=cert))
        assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"abc"
        assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"ok"
        assert srv.connections == 1
        await pool.aclose()
        untrusting = UpstreamPool(connect_timeout=2.0)
        with pytest.raises(UpstreamConnectError):
            await untrusting.request("GET", srv.origin, "/", [], b"")
        await untrusting.aclose()


# -- failures --------------------------------------------------------------------------------------


async def test_connection_refused(pool: UpstreamPool) -> None:
    origin = f"http://127.0.0.1:{free_port()}"  # nothing listens, and no connection of ours is bound there
    tight = UpstreamPool(connect_timeout=2.0, max_connections_per_origin=1)
    async with asyncio.timeout(5):  # a leaked permit would make the second attempt wait forever
        for _ in range(2):
            with pytest.raises(UpstreamConnectError):
                await tight.request("GET", origin, "/", [], b"")
    await tight.aclose()


@pytest.mark.parametrize("method", sorted(IDEMPOTENT_METHODS - {"HEAD"}))
async def test_idempotent_request_on_a_stale_connection_is_resent(pool: UpstreamPool, method: str) -> None:
    async with raw_server(responder(OK)) as srv:
        assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"ok"
        # The server read the second request on the kept-alive connection, then hung up without a byte.
        assert await read_all(await pool.request(method, srv.origin, "/", [], b"again")) == b"ok"
        assert srv.connections == 2
        assert [r.split(b" ", 1)[0] for r in srv.requests] == [b"GET", method.encode(), method.encode()]


@pytest.mark.parametrize("method", ["POST", "PATCH"])
async def test_non_idempotent_request_on_a_stale_connection_is_not_resent(
    pool: UpstreamPool, method: str
) -> None:
    async with raw_server(responder(OK)) as srv:
        assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"ok"
        # As a server that read a long generation and then died looks: the request may have been processed.
        with pytest.raises(UpstreamStaleConnection, match="reused keep-alive connection"):
            await pool.request(method, srv.origin, "/v1/chat/completions", [], b"generate")
        assert srv.connections == 1
        assert len(srv.requests) == 2  # seen once, not run twice
        assert srv.requests[1].startswith(method.encode() + b" /v1/chat/completions ")
        # The permit came back: the next request opens a fresh connection.
        assert await read_all(await pool.request(method, srv.origin, "/", [], b"")) == b"ok"
        assert srv.connections == 2


async def test_retry_happens_once(pool: UpstreamPool) -> None:
    served = 0

    async def handle(state: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal served
        while await read_request(state, reader) is not None and served == 0:
            served += 1
            writer.write(OK)

    async with raw_server(handle) as srv:
        await read_all(await pool.request("GET", srv.origin, "/", [], b""))
        with pytest.raises(UpstreamProtocolError):
            await pool.request("GET", srv.origin, "/", [], b"")
        assert srv.connections == 2


async def test_idle_connection_closed_by_server_is_skipped(pool: UpstreamPool) -> None:
    async with raw_server(responder(OK, OK, then_close=True)) as srv:
        await read_all(await pool.request("GET", srv.origin, "/", [], b""))
        await read_all(await pool.request("GET", srv.origin, "/", [], b""))
        await until(lambda: not pool._conns)  # the server's FIN reached the idle connection
        assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"ok"
        assert srv.connections == 2


@pytest.mark.parametrize(
    "reply",
    [b"", b"HTTP/1.1 200 OK\r\ncontent-le", b"SMTP ready\r\n\r\n"],
    ids=["silence", "half-head", "garbage"],
)
async def test_broken_head_is_a_protocol_error(pool: UpstreamPool, reply: bytes) -> None:
    async with raw_server(responder(reply, then_close=True)) as srv:
        with pytest.raises(UpstreamProtocolError):
            await pool.request("GET", srv.origin, "/", [], b"")
        assert srv.connections == 1  # a fresh connection is never retried


@pytest.mark.parametrize(
    ("reply", "received"),
    [
        (b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b", b"only ten b"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n", b"abc"),
        (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\nzz\r\n", b"abc"),
    ],
    ids=["content-length", "chunked", "bad-chunk"],
)
async def test_broken_body_is_a_read_error(pool: UpstreamPool, reply: bytes, received: bytes) -> None:
    async with raw_server(responder(reply, then_close=True)) as srv:
        response = await pool.request("GET", srv.origin, "/", [], b"")
        got = b""
        with pytest.raises(UpstreamReadError):
            async for chunk in response.aiter_raw():
                got += chunk
        await response.aclose()
        assert got == received
        assert idle(pool, srv.origin) == 0


async def test_bytes_after_the_response_spoil_the_connection(pool: UpstreamPool) -> None:
    async with raw_server(responder(OK + b"HTTP/1.1 200 OK\r\n")) as srv:
        assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"ok"
        assert idle(pool, srv.origin) == 0


FORGED = b"HTTP/1.1 418 X\r\nx-ratelimit-forged: 1\r\ncontent-length: 6\r\n\r\nforged"


async def test_a_second_response_in_the_same_read_changes_nothing_and_spoils_the_connection(
    pool: UpstreamPool,
) -> None:
    async with raw_server(responder(OK + FORGED, OK)) as srv:
        response = await pool.request("GET", srv.origin, "/", [], b"")
        assert (response.status, response.headers) == (200, [(b"content-length", b"2")])
        assert await read_all(response) == b"ok"
        assert idle(pool, srv.origin) == 0
        assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"ok"
        assert srv.connections == 2


@pytest.mark.parametrize(
    ("reply", "says"),
    [
        (b"HTTP/1.1 600 X\r\ncontent-length: 2\r\n\r\nok", "answered with status 600"),
        (b"HTTP/1.1 999 X\r\ncontent-length: 0\r\n\r\n", "answered with status 999"),
        (b"HTTP/1.1 000 X\r\ncontent-length: 2\r\n\r\nok" + OK, "answered with status 000"),
        (b"HTTP/1.1 099 X\r\n\r\n" + OK, "answered with status 099"),
        (b"HTTP/1.1 150 X\r\ncontent-length: 2\r\n\r\nok" + OK, "sent a body with an interim response"),
    ],
    ids=["600", "999", "000-with-body", "099", "150-with-body"],
)
async def test_a_status_outside_100_599_or_an_interim_body_is_a_protocol_error(
    pool: UpstreamPool, reply: bytes, says: str
) -> None:
    async with raw_server(responder(reply)) as srv:
        with pytest.raises(UpstreamProtocolError) as caught:
            await pool.request("GET", srv.origin, "/", [], b"")
        assert str(caught.value) == f"{srv.origin} {says}"
        assert (srv.connections, len(srv.requests), idle(pool, srv.origin)) == (1, 1, 0)


@pytest.mark.parametrize(
    ("method", "reply", "reused"),
    [
        ("GET", b"HTTP/1.1 304 X\r\ncontent-length: 10\r\netag: 1\r\n\r\n", True),
        ("GET", b"HTTP/1.1 204 X\r\ncontent-length: 10\r\netag: 1\r\n\r\n", True),
        ("HEAD", b"HTTP/1.1 200 X\r\ncontent-length: 0\r\netag: 1\r\n\r\n", True),
        ("HEAD", b"HTTP/1.1 200 X\r\ncontent-length: 10\r\netag: 1\r\n\r\n", False),
        ("HEAD", b"HTTP/1.1 200 X\r\ntransfer-encoding: chunked\r\netag: 1\r\n\r\n", False),
    ],
    ids=["304", "204", "head-empty", "head-length", "head-chunked"],
)
async def test_a_response_without_a_body_reports_no_content_length_and_awaits_no_body(
    pool: UpstreamPool, method: str, reply: bytes, reused: bool
) -> None:
    async with raw_server(responder(reply, OK)) as srv:
        response = await pool.request(method, srv.origin, "/", [], b"")
        assert (response.header(b"content-length"), response.header(b"etag")) == (None, b"1")
        async with asyncio.timeout(5):
            assert await read_all(response) == b""
        # Pooled unless the parser still waits for a body that a HEAD response announced.
        assert idle(pool, srv.origin) == int(reused)
        if reused:  # and in step: the next answer on it is read as it should be
            assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"ok"
            assert srv.connections == 1


@pytest.mark.parametrize("coding", [b"xchunked", b"chunked, gzip", b"gzip", b"chunkedx"])
async def test_a_body_without_a_final_chunked_coding_is_read_until_the_close(
    pool: UpstreamPool, coding: bytes
) -> None:
    # RFC 9112 §6.3: a transfer coding other than a final chunked one leaves the body close-delimited.
    reply = b"HTTP/1.1 200 OK\r\ntransfer-encoding: " + coding + b"\r\n\r\nuntil the end"
    async with raw_server(responder(reply, then_close=True)) as srv:
        assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"until the end"
        assert idle(pool, srv.origin) == 0


@pytest.mark.parametrize(
    ("status", "headers", "until_close"),
    [
        (200, [], True),
        (200, [(b"content-length", b"5")], False),
        (200, [(b"transfer-encoding", b"chunked")], False),
        (200, [(b"transfer-encoding", b"gzip, chunked")], False),
        (200, [(b"transfer-encoding", b"CHUNKED")], False),
        (200, [(b"transfer-encoding", b"xchunked")], True),
        (200, [(b"transfer-encoding", b"chunked, gzip")], True),
        (200, [(b"connection", b"close"), (b"content-length", b"5")], False),
        (200, [(b"connection", b"close")], True),
        (204, [], False),
        (304, [], False),
    ],
)
def test_needs_eof_is_the_parsers_framing_decision(
    status: int, headers: list[tuple[bytes, bytes]], until_close: bool
) -> None:
    assert needs_eof(status, headers) is until_close


# -- cancellation ----------------------------------------------------------------------------------


async def test_aclose_mid_body_disconnects_the_engine(pool: UpstreamPool) -> None:
    engine = FakeEngine("e", chunks=5, gate=threading.Event())
    with serve(engine.app()) as (url, _server):
        body = b'{"model": "m", "stream": true}'
        response = await pool.request("POST", url, "/v1/chat/completions", JSON, body)
        first = await anext(response.aiter_raw())
        assert first.startswith(b"data: ")
        conn = response._conn
        assert conn is not None and conn.transport is not None
        await response.aclose()
        await response.aclose()  # idempotent
        assert conn.transport.is_closing()
        assert idle(pool, url) == 0
        engine.gate.set()  # type: ignore[union-attr]
        await until(lambda: engine.cancelled == 1)
        assert engine.completed == 0
        with pytest.raises(UpstreamReadError):
            await anext(response.aiter_raw())


@pytest.mark.parametrize("how", ["cancel", "timeout"])
async def test_cancelled_while_waiting_for_head_leaves_pool_clean(pool: UpstreamPool, how: str) -> None:
    async def handle(state: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if state.connections == 1:
            await read_request(state, reader)
            await wait_for_disconnect(state, reader)
        else:
            await responder(OK)(state, reader, writer)

    async with raw_server(handle) as srv:
        if how == "cancel":
            task = asyncio.create_task(pool.request("GET", srv.origin, "/", [], b""))
            await srv.got_request.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await pool.request("GET", srv.origin, "/", [], b"")
        async with asyncio.timeout(5):
            await srv.disconnected.wait()
        assert idle(pool, srv.origin) == 0
        assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"ok"
        assert srv.connections == 2


async def test_cancelled_while_waiting_for_body(pool: UpstreamPool) -> None:
    async def handle(state: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(state, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await wait_for_disconnect(state, reader)

    async with raw_server(handle) as srv:
        response = await pool.request("GET", srv.origin, "/", [], b"")
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.2):
                try:
                    async for _chunk in response.aiter_raw():
                        pass
                finally:
                    await response.aclose()
        async with asyncio.timeout(5):
            await srv.disconnected.wait()
        assert idle(pool, srv.origin) == 0


async def test_pool_aclose_breaks_streams_and_refuses_requests(anyio_backend: Any) -> None:
    pool = UpstreamPool(connect_timeout=2.0)

    async def handle(state: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(state, reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc")
        await wait_for_disconnect(state, reader)

    async with raw_server(handle) as srv:
        response = await pool.request("GET", srv.origin, "/", [], b"")
        await pool.aclose()
        with pytest.raises(UpstreamReadError):
            await read_all(response)
        with pytest.raises(RuntimeError):
            await pool.request("GET", srv.origin, "/", [], b"")
        async with asyncio.timeout(5):
            await srv.disconnected.wait()


async def test_idle_timeout_drops_old_connections(anyio_backend: Any, recorder: Any) -> None:
    url, app = recorder
    pool = UpstreamPool(connect_timeout=2.0, idle_timeout=30.0)
    await read_all(await pool.request("GET", url, "/", [], b""))
    await read_all(await pool.request("GET", url, "/", [], b""))
    assert len(set(app.ports)) == 1
    pool._origins[url].idle[-1].idle_since -= 31.0  # as if it had sat idle for 31 s
    await read_all(await pool.request("GET", url, "/", [], b""))
    assert len(set(app.ports)) == 2
    await pool.aclose()


async def test_idle_timeout_defaults_below_the_engines_keep_alive(anyio_backend: Any, recorder: Any) -> None:
    url, app = recorder
    assert DEFAULT_IDLE_TIMEOUT == UpstreamConfig().idle_timeout_s == 4.0  # uvicorn closes idle ones at 5 s
    pool = UpstreamPool(connect_timeout=2.0)
    await read_all(await pool.request("GET", url, "/", [], b""))
    pool._origins[url].idle[-1].idle_since -= 3.9
    await read_all(await pool.request("GET", url, "/", [], b""))
    assert len(set(app.ports)) == 1
    pool._origins[url].idle[-1].idle_since -= 4.1
    await read_all(await pool.request("GET", url, "/", [], b""))
    assert len(set(app.ports)) == 2
    await pool.aclose()


# -- the pool's own limits -------------------------------------------------------------------------


async def test_pool_timeout_names_the_busy_origin(anyio_backend: Any) -> None:
    async with raw_server(responder(OK, OK)) as srv:
        pool = UpstreamPool(connect_timeout=2.0, max_connections_per_origin=1, pool_timeout=0.2)
        held = await pool.request("GET", srv.origin, "/", [], b"")
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamPoolTimeout) as caught:
            await pool.request("GET", srv.origin, "/", [], b"")
        waited = asyncio.get_running_loop().time() - started
        assert str(caught.value) == f"all 1 connections to {srv.origin} busy for 0.2 s"
        assert 0.19 <= waited < 5.0  # uvloop's timers have 1 ms resolution; 5 s allows a loaded machine
        assert len(srv.requests) == 1  # the timed-out request never reached the server
        assert await read_all(held) == b"ok"
        assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"ok"  # no permit lost
        await pool.aclose()


async def test_pool_timeouts_log_one_line_per_interval_with_their_count(
    anyio_backend: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # 4,904 requests refused by a saturated pool logged 4,904 identical lines.
    caplog.set_level(logging.WARNING, "warmroute.upstream")
    async with raw_server(responder(OK)) as srv:
        pool = UpstreamPool(
            connect_timeout=2.0, max_connections_per_origin=1, pool_timeout=0.01, busy_log_every_s=3600
        )
        held = await pool.request("GET", srv.origin, "/", [], b"")
        for _ in range(5):
            with pytest.raises(UpstreamPoolTimeout):
                await pool.request("GET", srv.origin, "/", [], b"")
        assert [r.getMessage() for r in caplog.records if r.name == "warmroute.upstream"] == [
            f"all 1 connections to {srv.origin} busy for 0.01 s: 1 request(s) refused"
            " (one line per 3600 s at most)"
        ]
        assert await read_all(held) == b"ok"
        await pool.aclose()


async def test_without_pool_timeout_a_queued_request_waits_for_a_permit(anyio_backend: Any) -> None:
    async with raw_server(responder(OK, OK)) as srv:
        pool = UpstreamPool(connect_timeout=2.0, max_connections_per_origin=1)
        held = await pool.request("GET", srv.origin, "/", [], b"")
        queued = asyncio.create_task(pool.request("GET", srv.origin, "/", [], b""))
        await asyncio.sleep(0.3)  # proving a negative: past any pool timeout it might wrongly apply
        assert not queued.done()
        assert await read_all(held) == b"ok"
        async with asyncio.timeout(5):
            assert await read_all(await queued) == b"ok"
        assert srv.connections == 1
        await pool.aclose()


async def test_dropped_response_gives_its_permit_back(
    anyio_backend: Any, recorder: Any, caplog: pytest.LogCaptureFixture
) -> None:
    url, app = recorder
    pool = UpstreamPool(connect_timeout=2.0, max_connections_per_origin=1)
    for _ in range(2):
        response = await pool.request("GET", url, "/", [], b"")
        conn = response._conn
        assert conn is not None
        del response  # never aclose()d
        gc.collect()
        assert conn.closing  # aborted: a half-read connection is never pooled
    async with asyncio.timeout(5):  # with the permit leaked this would wait forever (max_connections=1)
        assert await read_all(await pool.request("GET", url, "/", [], b"")) == b"hello world"
    assert pool.leaked_responses == 2  # counted each time, logged once
    assert len(set(app.ports)) == 3  # neither dropped connection was pooled
    warnings = [
        r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and url in r.getMessage()
    ]
    assert warnings == [f"a response from {url} was dropped without aclose(); its connection is aborted"]
    await pool.aclose()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def endless_head(line: bytes) -> Handler:
    """Answer with a status line, then ``line`` again and again until the client hangs up."""

    async def handle(state: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(state, reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        try:
            while True:
                writer.write(line)
                await writer.drain()
                await asyncio.sleep(0)  # drain() does not yield while the socket keeps up
        except ConnectionError:
            state.disconnected.set()

    return handle


async def huge_header(state: RawServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await read_request(state, reader)
    writer.write(b"HTTP/1.1 200 OK\r\nx-huge: " + b"a" * (1 << 20) + b"\r\n\r\n")
    await wait_for_disconnect(state, reader)


@pytest.mark.parametrize(
    ("handler", "says"),
    [
        (huge_header, f"over {DEFAULT_MAX_RESPONSE_HEADER_BYTES} bytes of head"),
        (endless_head(b"x-trickle: v\r\n"), f"over {DEFAULT_MAX_RESPONSE_HEADERS} headers"),
        (endless_head(b"x-pad: " + b"p" * 1000 + b"\r\n"), f"over {DEFAULT_MAX_RESPONSE_HEADER_BYTES} bytes"),
        (endless_head(b"x-" + b"n" * 4096), f"over {DEFAULT_MAX_RESPONSE_HEADER_BYTES} bytes"),
    ],
    ids=["1-MiB-header", "endless-headers", "endless-big-headers", "endless-header-name"],
)
async def test_oversized_response_head_aborts_at_the_limit(
    pool: UpstreamPool, handler: Handler, says: str
) -> None:
    before = rss_bytes()
    async with raw_server(handler) as srv:
        with pytest.raises(UpstreamResponseHeadTooLarge, match=says):
            async with asyncio.timeout(5):
                await pool.request("GET", srv.origin, "/", [], b"")
        async with asyncio.timeout(5):
            await srv.disconnected.wait()  # the client hung up: an endless head is not read forever
        assert not pool._conns
    assert rss_bytes() - before < 32 << 20
    assert issubclass(UpstreamResponseHeadTooLarge, UpstreamProtocolError)


def head_of(size: int, headers: int = 1) -> bytes:
    """A response head of exactly ``size`` bytes with ``headers`` fields, then a 2-byte body."""
    fields = [b"content-length: 2\r\n"] + [b"x-%d: v\r\n" % i for i in range(headers - 1)]
    start, end = b"HTTP/1.1 200 OK\r\n", b"\r\n"
    pad = size - len(start) - len(end) - sum(map(len, fields)) - len(b"x-pad: \r\n")
    assert pad >= 0
    return start + b"".join(fields) + b"x-pad: " + b"p" * pad + b"\r\n" + end


@pytest.mark.parametrize(
    ("reply", "fits"),
    [
        (head_of(1024) + b"ok", True),
        (head_of(1025) + b"ok", False),
        (EARLY + head_of(1024 - len(EARLY)) + b"ok", True),
        (EARLY + head_of(1025 - len(EARLY)) + b"ok", False),
        (head_of(200, headers=7) + b"ok", True),  # 7 + x-pad = 8 fields
        (head_of(200, headers=8) + b"ok", False),
    ],
    ids=["1024-bytes", "1025-bytes", "1xx-counts-1024", "1xx-counts-1025", "8-fields", "9-fields"],
)
async def test_response_head_limits_are_exact(anyio_backend: Any, reply: bytes, fits: bool) -> None:
    pool = UpstreamPool(connect_timeout=2.0, max_response_header_bytes=1024, max_response_headers=8)
    async with raw_server(responder(reply, OK)) as srv:
        if fits:
            assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"ok"
            assert await read_all(await pool.request("GET", srv.origin, "/", [], b"")) == b"ok"
            assert srv.connections == 1  # the body after the head was parsed in step
        else:
            with pytest.raises(UpstreamResponseHeadTooLarge):
                await pool.request("GET", srv.origin, "/", [], b"")
            assert not pool._conns
    await pool.aclose()


# -- the error hierarchy ---------------------------------------------------------------------------


def test_every_error_says_whether_the_request_may_have_been_processed() -> None:
    not_processed = {UpstreamConnectError, UpstreamPoolTimeout}
    maybe_processed = {
        UpstreamProtocolError,
        UpstreamStaleConnection,
        UpstreamResponseHeadTooLarge,
        UpstreamReadError,
    }
    for cls in not_processed | maybe_processed:
        assert issubclass(cls, UpstreamTransportError)
        assert cls.may_have_been_processed is (cls in maybe_processed), cls
    assert issubclass(UpstreamStaleConnection, UpstreamProtocolError)  # "failed before the head"
    cfg = UpstreamConfig()
    assert (cfg.max_response_header_bytes, cfg.max_response_headers) == (
        DEFAULT_MAX_RESPONSE_HEADER_BYTES,
        DEFAULT_MAX_RESPONSE_HEADERS,
    )
