"""A lean HTTP/1.1 client for the proxy hot path: ``asyncio.Protocol`` + httptools, LIFO keep-alive pool.

httpx stays for health checks and everything else. This exists because httpcore costs over 1 ms of CPU per
request at 32 connections (a ``poll()`` on every pooled connection per request, anyio stream wrappers, h11).
The seam is as narrow as httpx's transport: ``UpstreamPool.request()`` returns an ``UpstreamResponse`` once
the head is parsed; the caller streams ``aiter_raw()`` and always calls ``aclose()``.

Invariants:

- A connection is in exactly one place: its origin's idle stack, or owned by one unclosed response.
- A connection goes back to the stack only if its response arrived in full, allows keep-alive and nothing
  followed it on the wire. Anything else (error, cancellation, early ``aclose()``) aborts the transport at
  once: that is how an upstream request is cancelled, and the engine sees the disconnect.
- One permit per origin is held from ``request()`` until ``aclose()``, so at most
  ``max_connections_per_origin`` connections per origin are ever open (idle ones are reused before new ones
  are opened).
"""

from __future__ import annotations

import asyncio
import collections
import re
import ssl
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools

READ_HIGH_WATER = 64 * 1024  # body bytes waiting for the consumer before the socket is paused
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
_OWN_HEADERS = frozenset({b"host", b"content-length", b"transfer-encoding"})  # framing is ours to write
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")  # a space or CR/LF in the target would split the request


class UpstreamConnectError(Exception):
    """Connect refused, timed out, TLS handshake or DNS failed: nothing was sent."""


class UpstreamProtocolError(Exception):
    """The connection broke, or the server sent garbage, before the response head was complete."""


class UpstreamReadError(Exception):
    """The connection broke, or the body framing was invalid, after the response head."""


class _StaleConnection(Exception):
    """A reused keep-alive connection closed before any response byte: the server never read the request."""


class _Origin:
    """Where to connect, what to put in Host, and the idle connections (most recently used last)."""

    __slots__ = ("host", "host_header", "idle", "name", "permits", "port", "prefix", "ssl")

    def __init__(self, origin: str, limit: int, ssl_context: ssl.SSLContext | None) -> None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
            raise ValueError(f"not an http(s) origin: {origin!r}")
        tls = parts.scheme == "https"
        self.name = origin
        self.host = parts.hostname
        self.port = parts.port or (443 if tls else 80)
        self.host_header = parts.netloc.rpartition("@")[2].encode("ascii")
        self.prefix = parts.path.rstrip("/")
        self.ssl = (ssl_context or ssl.create_default_context()) if tls else None
        self.idle: collections.deque[_Connection] = collections.deque()
        self.permits = asyncio.Semaphore(limit)


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the state of the exchange in progress on it (fed by httptools)."""

    def __init__(self, pool: UpstreamPool, origin: _Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.paused = False
        self._begin(None, reused=False, head_only=False)

    def _begin(self, parser: httptools.HttpResponseParser | None, *, reused: bool, head_only: bool) -> None:
        self.parser = parser  # None while idle
        self.reused = reused
        self.head_only = head_only
        self.got_bytes = False
        self.head_done = False
        self.complete = False  # the whole response arrived
        self.keep_alive = False
        self.until_eof = False  # close-delimited body
        self.extra = False  # bytes followed the response: never reuse
        self.error: Exception | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.waiter: asyncio.Future[None] | None = None

    def start(self, data: bytes, body: bytes, *, reused: bool, head_only: bool) -> asyncio.Future[None]:
        """Send one request; the future resolves when the head is parsed or the exchange failed."""
        assert self.transport is not None
        self._begin(httptools.HttpResponseParser(self), reused=reused, head_only=head_only)
        self.waiter = waiter = asyncio.get_running_loop().create_future()
        if len(body) <= 16384:
            self.transport.write(data + body)  # one send() for the common small request
        else:
            self.transport.write(data)
            self.transport.write(body)
        return waiter

    def release(self) -> bool:
        """Make the connection idle; False (and the transport aborted) if it cannot be reused."""
        if not self.complete or not self.keep_alive or self.extra or self.closing or self.error is not None:
            self.abort()
            return False
        self._begin(None, reused=False, head_only=False)
        if self.paused:
            self.resume()
        return True

    @property
    def closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    def resume(self) -> None:
        self.paused = False
        if not self.closing:
            assert self.transport is not None
            self.transport.resume_reading()

    async def wait(self) -> None:
        self.waiter = waiter = asyncio.get_running_loop().create_future()
        await waiter

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self.complete:  # garbage after a finished response only spoils the connection
            self.extra = True
        elif self.error is None:
            self.error = exc
        self.abort()
        self._wake()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's
        self.pool._conns.add(self)

    def data_received(self, data: bytes) -> None:
        parser = self.parser
        if parser is None:  # idle, yet the server speaks: the connection is out of step
            self.abort()
            return
        if self.complete:
            self.extra = True
            return
        self.got_bytes = True
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamProtocolError("upstream switched protocols; only HTTP/1.1 is supported"))
            return
        except httptools.HttpParserError as exc:
            bad = UpstreamReadError if self.head_done else UpstreamProtocolError
            self._fail(bad(f"malformed response from {self.origin.name}: {exc}"))
            return
        if self.chunks or self.complete:
            self._wake()
        if self.buffered > READ_HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool._conns.discard(self)
        if self.parser is None or self.complete or self.error is not None:
            self._wake()
            return
        where = self.origin.name
        if not self.head_done:
            if self.reused and not self.got_bytes:
                self.error = _StaleConnection()
            else:
                self.error = UpstreamProtocolError(f"{where} closed the connection before the response head")
        elif self.until_eof and exc is None:
            self.complete = True  # a close-delimited body ends here; keep_alive is already False
        else:
            self.error = UpstreamReadError(f"{where} closed the connection mid-body ({exc!r})")
        self._wake()

    # httptools callbacks

    def on_message_begin(self) -> None:
        if self.complete:
            self.extra = True
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        status = self.parser.get_status_code()
        if status < 200:  # informational (103 Early Hints): llhttp goes on to the real response
            return
        self.status = status
        self.head_done = True
        self.keep_alive = self.parser.should_keep_alive()
        if self.head_only:
            self.complete = True
        else:
            self.until_eof = _close_delimited(self.headers)
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.complete:  # bytes after a HEAD response
            self.extra = True
            return
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = True


def _close_delimited(headers: list[tuple[bytes, bytes]]) -> bool:
    """True when neither Content-Length nor a final chunked coding frames the body (RFC 9112 §6.3)."""
    for name, value in headers:
        if name == b"content-length":
            return False
        if name == b"transfer-encoding" and value.rstrip().lower().endswith(b"chunked"):
            return False
    return True


class UpstreamResponse:
    """A response whose head is parsed; stream the body with ``aiter_raw()``, then always ``aclose()``."""

    __slots__ = ("_conn", "headers", "status")

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self.status = conn.status
        self.headers = conn.headers  # names lower-cased

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower-case), or None."""
        for key, value in self.headers:
            if key == name:
                return value
        return None

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (de-chunked); whatever is queued is yielded as one piece."""
        while True:
            conn = self._conn
            if conn is None:
                raise UpstreamReadError("response is closed")
            chunks = conn.chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                conn.chunks = []
                conn.buffered = 0
                if conn.paused:
                    conn.resume()
                yield data
            elif conn.complete:
                return
            elif conn.error is not None:
                raise conn.error
            else:
                await conn.wait()

    async def aclose(self) -> None:
        """Pool the connection if the response arrived in full, else abort it. Idempotent; never awaits."""
        conn = self._conn
        if conn is not None:
            self._conn = None
            conn.pool._finish(conn)


class UpstreamPool:
    """Per-origin LIFO pools of keep-alive HTTP/1.1 connections."""

    def __init__(
        self,
        *,
        connect_timeout: float,
        max_connections_per_origin: int = 1024,
        idle_timeout: float = 60.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._connect_timeout = connect_timeout
        self._limit = max_connections_per_origin
        self._idle_timeout = idle_timeout
        self._ssl_context = ssl_context
        self._origins: dict[str, _Origin] = {}
        self._conns: set[_Connection] = set()  # every open connection, idle or busy
        self._closed = False

    async def request(
        self, method: str, origin: str, path: str, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        """Send a request and return once its head is parsed (the body is not read yet).

        ``origin`` is ``scheme://host[:port][/prefix]``; ``path`` (with the query) is appended to it.
        ``headers`` names must be lower-case; Host, Content-Length and Transfer-Encoding are written here.
        No timeout of its own beyond connecting: wrap the call in ``asyncio.timeout``.
        """
        if self._closed:
            raise RuntimeError("UpstreamPool is closed")
        dest = self._origins.get(origin) or self._add_origin(origin)
        data = _encode_head(method, dest.prefix + path or "/", dest.host_header, headers, body)
        await dest.permits.acquire()
        try:
            return await self._exchange(dest, data, body, method == "HEAD")
        except BaseException:
            dest.permits.release()
            raise

    async def aclose(self) -> None:
        """Abort every connection, idle or busy; later requests raise RuntimeError."""
        self._closed = True
        for dest in self._origins.values():
            dest.idle.clear()
        for conn in list(self._conns):
            conn.abort()
        await asyncio.sleep(0)  # let the transports run connection_lost and close their sockets

    async def _exchange(self, dest: _Origin, data: bytes, body: bytes, head_only: bool) -> UpstreamResponse:
        conn = self._checkout(dest)
        if conn is not None:
            try:
                return await self._send(conn, data, body, reused=True, head_only=head_only)
            except _StaleConnection:
                pass  # the server closed it while idle; it never saw this request, so send it again
        conn = await self._connect(dest)
        return await self._send(conn, data, body, reused=False, head_only=head_only)

    async def _send(
        self, conn: _Connection, data: bytes, body: bytes, *, reused: bool, head_only: bool
    ) -> UpstreamResponse:
        waiter = conn.start(data, body, reused=reused, head_only=head_only)
        try:
            await waiter
        except BaseException:
            conn.abort()  # cancelled waiting for the head: the connection is half-used, drop it
            raise
        if not conn.head_done:
            conn.abort()
            assert conn.error is not None
            raise conn.error
        return UpstreamResponse(conn)

    def _checkout(self, dest: _Origin) -> _Connection | None:
        idle = dest.idle
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()
            if conn.closing:  # the server hung up while it was idle
                continue
            if now - conn.idle_since > self._idle_timeout:  # the newest is too old, so are the rest
                conn.abort()
                while idle:
                    idle.pop().abort()
                return None
            return conn
        return None

    def _finish(self, conn: _Connection) -> None:
        dest = conn.origin
        dest.permits.release()
        if self._closed:
            conn.abort()
            return
        if not conn.release():
            return
        now = asyncio.get_running_loop().time()
        conn.idle_since = now
        dest.idle.append(conn)
        idle = dest.idle
        while idle and (idle[0].closing or now - idle[0].idle_since > self._idle_timeout):
            idle.popleft().abort()

    async def _connect(self, dest: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        conn = _Connection(self, dest)
        server_hostname = dest.host if dest.ssl is not None else None
        try:
            async with asyncio.timeout(self._connect_timeout):
                await loop.create_connection(
                    lambda: conn, dest.host, dest.port, ssl=dest.ssl, server_hostname=server_hostname
                )
        except OSError as exc:  # refused, unreachable, DNS, TLS, and TimeoutError (an OSError since 3.3)
            raise UpstreamConnectError(f"cannot connect to {dest.name}: {exc!r}") from exc
        return conn

    def _add_origin(self, origin: str) -> _Origin:
        dest = _Origin(origin, self._limit, self._ssl_context)
        self._origins[origin] = dest
        return dest


def _encode_head(
    method: str, target: str, host: bytes, headers: list[tuple[bytes, bytes]], body: bytes
) -> bytes:
    if _BAD_TARGET.search(target):
        raise ValueError(f"invalid request target: {target!r}")
    parts = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method.encode("ascii"), target.encode("latin-1"), host)]
    if body or method in _METHODS_WITH_BODY:
        parts.append(b"content-length: %d\r\n" % len(body))
    parts.extend(b"%s: %s\r\n" % (name, value) for name, value in headers if name not in _OWN_HEADERS)
    parts.append(b"\r\n")
    return b"".join(parts)
