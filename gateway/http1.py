"""One HTTP/1.1 client connection: request framing, and the response parsed by httptools as it arrives.

``gateway.upstream`` pools these; nothing else uses them. The connection records the state of the exchange in
progress (head, queued body chunks, completion, error) and wakes whoever waits on it; it never awaits.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

import httptools

from gateway.transport import (
    UpstreamProtocolError,
    UpstreamReadError,
    UpstreamResponseHeadTooLarge,
    UpstreamStaleConnection,
)

if TYPE_CHECKING:
    from gateway.upstream import Origin, UpstreamPool

READ_HIGH_WATER = 64 * 1024  # body bytes waiting for the consumer before the socket is paused
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
_OWN_HEADERS = frozenset({b"host", b"content-length", b"transfer-encoding"})  # framing is ours to write
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")  # a space or CR/LF in the target would split the request


class Connection(asyncio.Protocol):
    """One keep-alive connection and the state of the exchange in progress on it (fed by httptools)."""

    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.paused = False
        self.max_head_bytes = pool._max_head_bytes
        self.max_headers = pool._max_headers
        self._begin(None, reused=False, head_only=False)

    def _begin(self, parser: httptools.HttpResponseParser | None, *, reused: bool, head_only: bool) -> None:
        self.parser = parser  # None while idle
        self.reused = reused
        self.head_only = head_only
        self.got_bytes = False
        self.head_done = False
        self.head_room = self.max_head_bytes  # response-head bytes still allowed (1xx heads included)
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
        if not self.head_done:
            room = self.head_room - len(data)
            if room < 0:
                self._feed_to_head_limit(data)
                return
            self.head_room = room
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

    def _feed_to_head_limit(self, data: bytes) -> None:
        """Feed only the bytes the head limit allows; if the head is still unfinished there, give up."""
        allowed = self.head_room
        self.data_received(data[:allowed])
        if self.head_done:
            if self.error is None:
                self.data_received(data[allowed:])  # body bytes: no head limit applies any more
        elif self.error is None:
            where = self.origin.name
            self._fail(UpstreamResponseHeadTooLarge(f"{where} sent over {self.max_head_bytes} bytes of head"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.pool._conns.discard(self)
        if self.parser is None or self.complete or self.error is not None:
            self._wake()
            return
        where = self.origin.name
        if not self.head_done:
            if self.reused and not self.got_bytes:
                self.error = UpstreamStaleConnection(
                    f"{where} closed a reused keep-alive connection before any response byte"
                )
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
        headers = self.headers
        if len(headers) >= self.max_headers:
            error = UpstreamResponseHeadTooLarge(f"{self.origin.name} sent over {self.max_headers} headers")
            self._fail(error)
            raise error  # stops the parser; data_received keeps the error already recorded
        headers.append((name.lower(), value))

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
            self.until_eof = close_delimited(self.headers)
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


def close_delimited(headers: list[tuple[bytes, bytes]]) -> bool:
    """True when neither Content-Length nor a final chunked coding frames the body (RFC 9112 §6.3)."""
    for name, value in headers:
        if name == b"content-length":
            return False
        if name == b"transfer-encoding" and value.rstrip().lower().endswith(b"chunked"):
            return False
    return True


def encode_head(
    method: str, target: str, host: bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes
) -> bytes:
    if _BAD_TARGET.search(target):
        raise ValueError(f"invalid request target: {target!r}")
    parts = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method.encode("ascii"), target.encode("latin-1"), host)]
    if body or method in _METHODS_WITH_BODY:
        parts.append(b"content-length: %d\r\n" % len(body))
    parts.extend(b"%s: %s\r\n" % (name, value) for name, value in headers if name not in _OWN_HEADERS)
    parts.append(b"\r\n")
    return b"".join(parts)
