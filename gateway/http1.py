"""One HTTP/1.1 client connection: request framing, and the response parsed by httptools as it arrives.

``gateway.upstream`` pools these; nothing else uses them. The connection records the state of the exchange in
progress (head, queued body chunks, completion, error) and wakes whoever waits on it; it never awaits. It
knows nothing of the pool: it is given the origin's name (for its errors), its head limits and the set of
open connections it belongs to while its socket is open.
"""

from __future__ import annotations

import asyncio
import re
import select
from collections.abc import Sequence
from typing import NoReturn, cast

import httptools

from gateway.transport import (
    UpstreamProtocolError,
    UpstreamReadError,
    UpstreamResponseHeadTooLarge,
    UpstreamStaleConnection,
)

READ_HIGH_WATER = 64 * 1024  # body bytes waiting for the consumer before the socket is paused
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
_OWN_HEADERS = frozenset({b"host", b"content-length", b"transfer-encoding"})  # framing is ours to write
_BAD_TARGET = re.compile(r"[\x00-\x20\x7f]")  # a space or CR/LF in the target would split the request
_NO_BODY_STATUSES = frozenset({204, 304})  # and every 1xx (RFC 9110 §6.4.1): the head ends the response
_CONNECTION_HEADERS = frozenset({b"connection", b"proxy-connection"})


class _AfterTheEnd(Exception):
    """Raised in a parser callback to stop httptools once the response is over: the bytes after it answer
    nothing we sent, so they are neither parsed nor reported."""


class Connection(asyncio.Protocol):
    """One keep-alive connection and the state of the exchange in progress on it (fed by httptools)."""

    def __init__(
        self, origin: str, open_conns: set[Connection], *, max_head_bytes: int, max_headers: int
    ) -> None:
        self.origin = origin  # scheme://host[:port][/prefix], as the pool was asked for it
        self.open_conns = open_conns  # joined in connection_made, left in connection_lost
        self.transport: asyncio.Transport | None = None
        #: The loop it runs on, from ``connection_made``: on Python 3.11 every ``asyncio.get_running_loop()``
        #: is a ``getpid()`` system call, and a request asked for it three times here.
        self.loop: asyncio.AbstractEventLoop | None = None
        self.idle_since = 0.0  # ``loop.time()`` when it went idle
        self.paused = False
        self.max_head_bytes = max_head_bytes
        self.max_headers = max_headers
        self._poller: select.poll | None = None  # this socket's, for ``readable`` (made once it is open)
        # The parser of the last exchange, kept for the next one once that exchange ended cleanly (llhttp
        # is then at a message start, as a new one is): building a parser per request cost ~1 us.
        self._spare: httptools.HttpResponseParser | None = None
        self._begin(None, reused=False, head_only=False)

    def _begin(self, parser: httptools.HttpResponseParser | None, *, reused: bool, head_only: bool) -> None:
        self.parser = parser  # None while idle
        self.reused = reused
        self.head_only = head_only
        self.got_bytes = False
        self.head_done = False
        self.head_room = self.max_head_bytes  # response-head bytes still allowed (1xx heads included)
        self.complete = False  # the whole response arrived (for HEAD: its head)
        self.ended = False  # the parser reached the end of the response: the connection is in step again
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
        assert self.transport is not None and self.loop is not None
        parser, self._spare = self._spare or httptools.HttpResponseParser(self), None
        self._begin(parser, reused=reused, head_only=head_only)
        self.waiter = waiter = self.loop.create_future()
        if len(body) <= 16384:
            self.transport.write(data + body)  # one send() for the common small request
        else:
            # Still one send() (a writev, no copy): in two, the engine woke for the head alone and again for
            # the body, and the gateway could lose its core between the two.
            self.transport.writelines((data, body))
        return waiter

    def release(self) -> bool:
        """Make the connection idle; False (and the transport aborted) if it cannot be reused."""
        if not self.ended or not self.keep_alive or self.extra or self.closing or self.error is not None:
            self.abort()
            return False
        self._spare = self.parser  # it saw the whole response and nothing after it
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

    def readable(self) -> bool:
        """Bytes or an EOF wait on this idle socket that the event loop has not read yet: reused, the
        connection would take them for the next request's answer. One ``poll()``, on this socket only (its
        poll object is made once, when the connection opens: not per request)."""
        poller = self._poller
        return poller is not None and bool(poller.poll(0))

    def resume(self) -> None:
        self.paused = False
        if not self.closing:
            assert self.transport is not None
            self.transport.resume_reading()

    async def wait(self) -> None:
        assert self.loop is not None
        self.waiter = waiter = self.loop.create_future()
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
        self.loop = asyncio.get_running_loop()  # once per connection: called back on its loop
        self.open_conns.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._poller = poller = select.poll()
            poller.register(sock.fileno(), select.POLLIN)

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
            self._fail(bad(f"malformed response from {self.origin}: {exc}"))
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
            where = self.origin
            self._fail(UpstreamResponseHeadTooLarge(f"{where} sent over {self.max_head_bytes} bytes of head"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.open_conns.discard(self)
        if self.parser is None or self.complete or self.error is not None:
            self._wake()
            return
        where = self.origin
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
        if self.ended:  # a second response in the same read: it must not override the first one's head
            self.extra = True
            raise _AfterTheEnd
        self.headers = []  # also drops a 1xx response's headers

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self.headers
        if len(headers) >= self.max_headers:
            error = UpstreamResponseHeadTooLarge(f"{self.origin} sent over {self.max_headers} headers")
            self._fail(error)
            raise error  # stops the parser; data_received keeps the error already recorded
        headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        status = self.parser.get_status_code()
        if not 100 <= status <= 599:  # llhttp takes any three digits
            self._stop(UpstreamProtocolError(f"{self.origin} answered with status {status:03d}"))
        if status < 200:  # informational (103 Early Hints): llhttp goes on to the real response
            return
        self.status = status
        self.head_done = True
        self.keep_alive = keep_alive = self.parser.should_keep_alive()
        if self.head_only or status in _NO_BODY_STATUSES:
            # Content-Length frames nothing here; relayed, it would promise the client a body.
            self.headers = [(name, value) for name, value in self.headers if name != b"content-length"]
        if self.head_only:
            self.complete = True  # llhttp does not know the request was HEAD: it may wait for a body
        elif not keep_alive:  # keep-alive already means framed; only now can the body run to the close
            self.until_eof = needs_eof(status, self.headers)
        self._wake()

    def on_body(self, body: bytes) -> None:
        if not self.head_done:  # llhttp reads a body that a 1xx or 0xx head announces
            self._stop(UpstreamProtocolError(f"{self.origin} sent a body with an interim response"))
        if self.complete:  # bytes after a HEAD response
            self.extra = True
            return
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.head_done:
            self.complete = self.ended = True

    def _stop(self, error: Exception) -> NoReturn:
        """Record ``error`` and stop the parser; data_received keeps the error already recorded."""
        self._fail(error)
        raise error


def needs_eof(status: int, headers: Sequence[tuple[bytes, bytes]]) -> bool:
    """True when the body runs until the server closes (RFC 9112 §6.3: no Content-Length, and no
    Transfer-Encoding whose final coding is chunked), decided by llhttp itself so that we never disagree
    with the parser on where a body ends: the same head, as HTTP/1.1 without Connection, keeps the
    connection alive exactly when its body is framed. Only asked for a response that closes the
    connection (a keep-alive one is framed by definition)."""
    fields = b"".join(b"%s: %s\r\n" % (n, v) for n, v in headers if n not in _CONNECTION_HEADERS)
    probe = httptools.HttpResponseParser(_NoCallbacks())
    probe.feed_data(b"HTTP/1.1 %d -\r\n%s\r\n" % (status, fields))
    return not probe.should_keep_alive()


class _NoCallbacks:
    """A parser protocol that wants nothing reported (httptools calls only the methods it finds)."""


def encode_head(
    method: str, target: str, host: bytes, headers: Sequence[tuple[bytes, bytes]], body: bytes
) -> bytes:
    if _BAD_TARGET.search(target):
        raise ValueError(f"invalid request target: {target!r}")
    parts = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (method.encode("ascii"), target.encode("latin-1"), host)]
    if body or method in _METHODS_WITH_BODY:
        parts.append(b"content-length: %d\r\n" % len(body))
    for name, value in headers:  # not ``extend`` of a generator: a frame resumed per header
        if name not in _OWN_HEADERS:
            parts.append(b"%s: %s\r\n" % (name, value))
    parts.append(b"\r\n")
    return b"".join(parts)
