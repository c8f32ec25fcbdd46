"""A lean HTTP/1.1 client for the proxy hot path: ``asyncio.Protocol`` + httptools, LIFO keep-alive pool.

httpx stays for health checks and everything else. This exists because httpcore costs over 1 ms of CPU per
request at 32 connections (a ``poll()`` on every pooled connection per request, anyio stream wrappers, h11).
The seam is as narrow as httpx's transport (``gateway.transport.UpstreamTransport``):
``UpstreamPool.request()`` returns an ``UpstreamResponse`` once the head is parsed; the caller streams
``aiter_raw()`` and always calls ``aclose()``. Errors are ``gateway.transport``'s hierarchy.

Invariants:

- A connection is in exactly one place: its origin's idle stack, or owned by one unclosed response.
- A connection goes back to the stack only if its response arrived in full, allows keep-alive and nothing
  followed it on the wire. Anything else (error, cancellation, early ``aclose()``) aborts the transport at
  once: that is how an upstream request is cancelled, and the engine sees the disconnect. A response to
  HEAD whose head announces a body is not reused either: an engine that gets HEAD wrong sends that body,
  maybe only once the next request is on its way, and it would read as that request's answer.
- A connection is taken from the stack only if nothing waits on its socket (no stray byte, no EOF the event
  loop has not read yet); anything there aborts it.
- One permit per origin is held from ``request()`` until ``aclose()``, so at most
  ``max_connections_per_origin`` connections per origin are ever open (idle ones are reused before new ones
  are opened). A response garbage-collected without ``aclose()`` gives its permit back (``__del__``).
- Only idempotent requests are resent, once, when a reused connection turns out to be closed.
- A response head larger than ``max_response_header_bytes`` or with more than ``max_response_headers``
  fields aborts the connection as soon as the limit is crossed; nothing past the limit is buffered.
- A status outside 100-599, or a body on an interim (1xx) response, is an ``UpstreamProtocolError``. Where
  the body ends is llhttp's decision (RFC 9112 §6.3), Content-Length of a response without a body (HEAD,
  204, 304) is not reported, and the parser stops at the end of the response: what follows is never
  parsed as part of it.
- A request refused by the pool timeout logs one warning per origin per ``busy_log_every_s`` at most,
  with the number of requests it stands for.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from gateway.http1 import READ_HIGH_WATER, Connection, encode_head
from gateway.throttle import LogThrottle
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

if TYPE_CHECKING:
    from gateway.transport import UpstreamTransport

__all__ = [
    "DEFAULT_IDLE_TIMEOUT",
    "DEFAULT_MAX_RESPONSE_HEADERS",
    "DEFAULT_MAX_RESPONSE_HEADER_BYTES",
    "READ_HIGH_WATER",
    "UpstreamConnectError",
    "UpstreamPool",
    "UpstreamPoolTimeout",
    "UpstreamProtocolError",
    "UpstreamReadError",
    "UpstreamResponse",
    "UpstreamResponseHeadTooLarge",
    "UpstreamStaleConnection",
    "UpstreamTransportError",
]

log = logging.getLogger("warmroute.upstream")

# Below the 5 s keep-alive of uvicorn (vLLM, SGLang): we drop a connection before the server does, so a
# request rarely meets a connection the server is closing.
DEFAULT_IDLE_TIMEOUT = 4.0
DEFAULT_MAX_RESPONSE_HEADER_BYTES = 64 * 1024
DEFAULT_MAX_RESPONSE_HEADERS = 200
#: At most one "refused: every connection busy" line per origin per this many seconds.
BUSY_LOG_EVERY_S = 10.0


class Origin:
    """Where to connect, what to put in Host, and the idle connections (most recently used last)."""

    __slots__ = ("busy_log", "host", "host_header", "idle", "name", "permits", "port", "prefix", "ssl")

    def __init__(
        self, origin: str, limit: int, ssl_context: ssl.SSLContext | None, busy_log_every_s: float
    ) -> None:
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
        self.idle: collections.deque[Connection] = collections.deque()
        self.permits = asyncio.Semaphore(limit)
        self.busy_log = LogThrottle(busy_log_every_s)


class UpstreamResponse:
    """A response whose head is parsed; stream the body with ``aiter_raw()``, then always ``aclose()``."""

    __slots__ = ("_conn", "_dest", "_pool", "headers", "status")

    def __init__(self, conn: Connection, dest: Origin, pool: UpstreamPool) -> None:
        self._conn: Connection | None = conn
        self._dest = dest
        self._pool = pool
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
            self._pool._finish(conn, self._dest)

    def __del__(self) -> None:
        conn = self._conn
        if conn is not None:  # dropped without aclose(): a caller's bug, but it must not cost a permit
            self._conn = None
            self._pool._abandoned(conn, self._dest)


class UpstreamPool:
    """Per-origin LIFO pools of keep-alive HTTP/1.1 connections.

    ``pool_timeout``: how long a request may wait for one of ``max_connections_per_origin`` connections
    before ``UpstreamPoolTimeout`` (None: as long as the caller's own timeout allows).
    ``idle_timeout``: an idle connection older than this is closed instead of reused; keep it below the
    servers' keep-alive timeout.
    ``busy_log_every_s``: at most one warning per origin this often for requests the pool timeout refused.
    """

    def __init__(
        self,
        *,
        connect_timeout: float,
        max_connections_per_origin: int = 1024,
        pool_timeout: float | None = None,
        idle_timeout: float = DEFAULT_IDLE_TIMEOUT,
        max_response_header_bytes: int = DEFAULT_MAX_RESPONSE_HEADER_BYTES,
        max_response_headers: int = DEFAULT_MAX_RESPONSE_HEADERS,
        ssl_context: ssl.SSLContext | None = None,
        busy_log_every_s: float = BUSY_LOG_EVERY_S,
    ) -> None:
        self._connect_timeout = connect_timeout
        self._limit = max_connections_per_origin
        self._pool_timeout = pool_timeout
        self._idle_timeout = idle_timeout
        self._max_head_bytes = max_response_header_bytes
        self._max_headers = max_response_headers
        self._ssl_context = ssl_context
        self._busy_log_every_s = busy_log_every_s
        self._origins: dict[str, Origin] = {}
        self._conns: set[Connection] = set()  # every open connection, idle or busy
        self._closed = False
        self.leaked_responses = 0  # responses garbage-collected without aclose(); should stay 0

    async def request(
        self, method: str, origin: str, path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes
    ) -> UpstreamResponse:
        """Send a request and return once its head is parsed (the body is not read yet).

        ``origin`` is ``scheme://host[:port][/prefix]``; ``path`` (with the query) is appended to it.
        ``headers`` names must be lower-case; Host, Content-Length and Transfer-Encoding are written here.
        No timeout of its own beyond connecting and the pool wait: wrap the call in ``asyncio.timeout``.
        """
        if self._closed:
            raise RuntimeError("UpstreamPool is closed")
        dest = self._origins.get(origin) or self._add_origin(origin)
        data = encode_head(method, dest.prefix + path or "/", dest.host_header, headers, body)
        if self._pool_timeout is not None and dest.permits.locked():
            await self._wait_for_permit(dest, self._pool_timeout)  # saturated: the only case with a timer
        else:
            await dest.permits.acquire()
        try:
            return await self._exchange(dest, method, data, body)
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

    def close_origin(self, origin: str) -> int:
        """A backend was removed: close its idle connections and forget the origin. Busy ones close when
        their response ends (they are not pooled again). Returns how many were closed now."""
        dest = self._origins.pop(origin, None)
        if dest is None:
            return 0
        closed = len(dest.idle)
        while dest.idle:
            dest.idle.pop().abort()
        return closed

    def connections(self, origin: str) -> int:
        """Open connections (idle or busy) to ``origin``."""
        return sum(1 for c in self._conns if c.origin == origin)

    async def _wait_for_permit(self, dest: Origin, wait_s: float) -> None:
        try:
            async with asyncio.timeout(wait_s):
                await dest.permits.acquire()
        except TimeoutError:
            busy = f"all {self._limit} connections to {dest.name} busy for {wait_s} s"
            if count := dest.busy_log.due(asyncio.get_running_loop().time()):
                every = dest.busy_log.every_s
                log.warning("%s: %d request(s) refused (one line per %g s at most)", busy, count, every)
            raise UpstreamPoolTimeout(busy) from None

    async def _exchange(self, dest: Origin, method: str, data: bytes, body: bytes) -> UpstreamResponse:
        head_only = method == "HEAD"
        conn = self._checkout(dest)
        if conn is not None:
            try:
                return await self._send(dest, conn, data, body, reused=True, head_only=head_only)
            except UpstreamStaleConnection:
                # Most likely the server's idle close crossed the request, but it may have been working on
                # it: only a method that is safe to run twice is sent again (RFC 9112 §9.3.1).
                if method not in IDEMPOTENT_METHODS:
                    raise
        conn = await self._connect(dest)
        return await self._send(dest, conn, data, body, reused=False, head_only=head_only)

    async def _send(
        self, dest: Origin, conn: Connection, data: bytes, body: bytes, *, reused: bool, head_only: bool
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
        return UpstreamResponse(conn, dest, self)

    def _checkout(self, dest: Origin) -> Connection | None:
        idle = dest.idle
        while idle:
            conn = idle.pop()
            if conn.closing:  # the server hung up while it was idle
                continue
            assert conn.loop is not None  # open, so made
            if conn.loop.time() - conn.idle_since > self._idle_timeout:  # the newest is too old: so the rest
                conn.abort()
                while idle:
                    idle.pop().abort()
                return None
            if conn.readable():  # stray bytes or a close the loop has not read yet: out of step
                conn.abort()
                continue
            return conn
        return None

    def _finish(self, conn: Connection, dest: Origin) -> None:
        dest.permits.release()
        if self._closed or self._origins.get(dest.name) is not dest:  # closed, or its origin was removed
            conn.abort()
            return
        if not conn.release():
            return
        assert conn.loop is not None  # released for reuse, so open
        now = conn.loop.time()  # not ``asyncio.get_running_loop()``: a ``getpid()`` on 3.11
        conn.idle_since = now
        dest.idle.append(conn)
        idle = dest.idle
        # ``conn`` itself is neither (just released): with one idle connection nothing is asked
        while idle[0] is not conn and (idle[0].closing or now - idle[0].idle_since > self._idle_timeout):
            idle.popleft().abort()

    def _abandoned(self, conn: Connection, dest: Origin) -> None:
        """A response was garbage-collected unclosed: abort its connection and give its permit back."""
        self.leaked_responses += 1
        if self.leaked_responses == 1:  # once per pool: a leak on the hot path would flood the log
            log.warning(
                "a response from %s was dropped without aclose(); its connection is aborted", dest.name
            )
        try:
            conn.abort()
            dest.permits.release()
        except RuntimeError:  # the event loop is already closed (interpreter exit): nothing waits any more
            pass

    async def _connect(self, dest: Origin) -> Connection:
        loop = asyncio.get_running_loop()
        conn = Connection(
            dest.name, self._conns, max_head_bytes=self._max_head_bytes, max_headers=self._max_headers
        )
        server_hostname = dest.host if dest.ssl is not None else None
        try:
            async with asyncio.timeout(self._connect_timeout):
                await loop.create_connection(
                    lambda: conn, dest.host, dest.port, ssl=dest.ssl, server_hostname=server_hostname
                )
        except OSError as exc:  # refused, unreachable, DNS, TLS, and TimeoutError (an OSError since 3.3)
            raise UpstreamConnectError(f"cannot connect to {dest.name}: {exc!r}") from exc
        return conn

    def _add_origin(self, origin: str) -> Origin:
        dest = Origin(origin, self._limit, self._ssl_context, self._busy_log_every_s)
        self._origins[origin] = dest
        return dest


if TYPE_CHECKING:

    def _satisfies_the_protocol(pool: UpstreamPool) -> UpstreamTransport:
        return pool  # mypy checks that UpstreamPool (and UpstreamResponse) fit gateway.transport's seam
