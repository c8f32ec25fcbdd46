"""The HTTP/1.1 server protocol: uvicorn's httptools protocol, plus bounds on what one client can do to it.

uvicorn's httptools protocol waits forever for a request head, accepts a head of any size (64 MiB of header
cost 4.7 s of CPU, the event loop frozen meanwhile), waits forever for a body that stops short, and accepts
sockets until the process runs out of file descriptors. ``GatewayHttpProtocol`` adds, per connection:

- a head deadline: from accept (or from the first byte of a keep-alive connection's next request) until
  the request head is complete. A socket that sent nothing is closed; one that sent part of a head gets 408.
  Idle keep-alive connections close after uvicorn's ``timeout_keep_alive``, on one lazy timer (below).
- a head size limit (request line included, counted from the head's first byte wherever it starts in a
  read, pipelined or not) and a header-count limit: 431 as soon as one is crossed.
- heads refused before dispatch (``gateway.framing``): protocol upgrades, a missing or repeated Host,
  transfer codings besides chunked, HTTP/0.9; the connection closes and nothing after them is parsed.
- body deadlines: the longest pause while the client sends a body, and a whole-body deadline that grows
  with the bytes received (a minimum rate); then 408.
- a cap on open connections: the one over it gets 503 and is closed, so idle sockets cannot exhaust the
  process's descriptors. A few connections over the cap may still ask for /healthz (and nothing else),
  so an orchestrator does not kill a gateway that slow clients hold at its cap.

An error for a pipelined request waits until the requests before it are answered, so every answer goes
to the request it belongs to.

Each response's head goes with its first body message, in one write (``gateway.response_cycle``).

Cost on the hot path: one timer per connection (the first head's); later heads and bodies get one only
if a chunk leaves them incomplete; the keep-alive timer is re-armed at most once per
``timeout_keep_alive``; a few comparisons and one ``find`` per received chunk. Errors are
OpenAI-shaped; each logs one line.

It reads its limits and the state a worker's connections share from an ``InboundConfig``
(``gateway.server.GatewayConfig`` is one); under a plain uvicorn Config it applies the defaults.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from config.settings import Settings
from gateway.errors import BadRequest, GatewayError, RequestHeaderTooLarge, RequestTimeout, ServerBusy
from gateway.framing import BodyFrame, ChunkedEnd, FixedLength, head_end, head_refusal
from gateway.response_cycle import HeldHead
from gateway.throttle import LogThrottle

log = logging.getLogger("warmroute.server")

#: After a 431 the client is usually still sending its head. Closing a socket with unread data makes the
#: kernel answer with a reset, which can destroy the 431 before the client reads it; so we stop writing,
#: keep reading and discard for this long (or until the client closes), as nginx's lingering close does.
LINGER_S = 2.0
#: At most one "refused: over the connection cap" line per this many seconds (a flood must not log a flood).
BUSY_LOG_EVERY_S = 10.0
#: Connections over ``max_connections`` that may still ask for /healthz (one request each, then closed),
#: and how long such a connection may take to send its head.
HEALTHZ_RESERVE = 8
HEALTHZ_HEAD_TIMEOUT_S = 1.0
#: The headers ``head_refusal`` and ``_body_frame`` read (every other header is neither's business).
_FRAMING = frozenset({b"host", b"upgrade", b"transfer-encoding", b"content-length"})


@dataclass(frozen=True, slots=True)
class InboundLimits:
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    max_connections: int = 2048
    body_read_timeout_s: float = 30.0
    body_deadline_s: float = 30.0
    body_min_bytes_per_s: int = 16384

    @classmethod
    def from_settings(cls, settings: Settings) -> InboundLimits:
        s = settings.server
        return cls(
            header_timeout_s=s.header_timeout_s,
            max_header_bytes=s.max_header_bytes,
            max_headers=s.max_headers,
            max_connections=s.max_connections,
            body_read_timeout_s=settings.limits.body_read_timeout_s,
            body_deadline_s=settings.limits.body_deadline_s,
            body_min_bytes_per_s=settings.limits.body_min_bytes_per_s,
        )


class _Reserve:
    """How many connections over the cap are open now, for /healthz (shared by a worker's connections)."""

    def __init__(self) -> None:
        self.open = 0


class InboundConfig(uvicorn.Config):
    """uvicorn's Config serving ``GatewayHttpProtocol``, with what the protocol reads: the inbound limits,
    and the state one worker's connections share (the refusal log, the /healthz reserve). Pickled to each
    worker like any uvicorn Config, so each worker has its own."""

    def __init__(self, app: Any, *, limits: InboundLimits, **kwargs: Any) -> None:
        super().__init__(app, http=GatewayHttpProtocol, **kwargs)
        self.inbound_limits = limits
        self.busy_log = LogThrottle(BUSY_LOG_EVERY_S)
        self.healthz_reserve = _Reserve()


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing; the error to answer is on the protocol."""


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head/body deadlines, head limits and checks, and a connection cap.

    State: ``_in_head`` from accept, and again from the end of each request, until its head is complete;
    ``_in_body`` from then until the request's last body byte. ``_discarding`` once we refused something:
    nothing more is parsed. ``_owed``: that refusal, while earlier pipelined requests are still answered.
    """

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if isinstance(config, InboundConfig):
            self.limits = config.inbound_limits
            self.busy_log = config.busy_log
            self.reserve = config.healthz_reserve
        else:
            self.limits = InboundLimits()
            self.busy_log = LogThrottle(BUSY_LOG_EVERY_S)
            self.reserve = _Reserve()
        self._in_head = True
        self._in_body = False
        self._discarding = False
        self._reserved = False  # over the cap, admitted for /healthz only
        self._head_bytes = 0
        self._head_tail = b""  # the last bytes of the head in progress (its end may straddle two reads)
        self._header_count = 0
        self._framing: list[tuple[bytes, bytes]] = []  # the head's headers that frame it (_FRAMING)
        # One Content-Length frame per connection, re-armed for each request (its bodies come one after
        # another): no frame object built per request.
        self._fixed = FixedLength(0)
        self._body: BodyFrame = self._fixed
        self._body_bytes = 0
        self._body_start = 0.0  # minus the time we were not reading: the client is not charged for it
        self._body_at = 0.0
        self._body_checked = 0.0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._refusal: GatewayError | None = None
        self._owed: tuple[GatewayError, bool] | None = None
        self._idle_at: float | None = None  # when the last response completed, until data comes

    # -- connection ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        timeout = self.limits.header_timeout_s
        if len(self.connections) - self.reserve.open >= self.limits.max_connections:
            if self.reserve.open >= HEALTHZ_RESERVE:
                self.transport = transport
                self._discarding = True
                self._write_error(self._busy())
                transport.close()
                self._log_busy()
                return
            self.reserve.open += 1
            self._reserved = True
            timeout = min(timeout, HEALTHZ_HEAD_TIMEOUT_S)
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        timers = (self._head_timer, self._body_timer, self._linger_timer, self.timeout_keep_alive_task)
        self.timeout_keep_alive_task = None
        for timer in timers:
            if timer is not None:
                timer.cancel()
        if self._reserved:
            self._reserved = False
            self.reserve.open -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        if self._in_body:
            self._body_at = self.loop.time()
        # One head, or one body, per feed: the parser never runs on into the next head unseen. Pieces are
        # views: many pipelined requests in one read cost no copies.
        view, pos, size = memoryview(data), 0, len(data)
        while pos < size and not self._discarding:
            if self._in_head:
                end = self._head_piece(data, pos)
            else:
                end = self._body.end(data, pos)
                self._body_bytes += end - pos
            if not self._discarding:
                self._feed(view[pos:end] if pos or end < size else data)
            pos = end
        # Timers only for what is still incomplete after this chunk: a head or body that arrives whole
        # (the common case) costs none. The first head's timer runs from connection_made.
        if self._discarding:
            return
        if self._in_head and self._head_bytes and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)
        elif self._in_body and self._body_timer is None:
            now = self._body_at = self._body_checked = self.loop.time()
            self._body_timer = self.loop.call_later(self._body_time_left(now), self._body_timed_out)

    def _head_piece(self, data: bytes, start: int) -> int:
        """Where the head in progress can end at the earliest; 431 if that is past the limit."""
        end = head_end(self._head_tail, data, start)
        if self._head_bytes + end - start > self.limits.max_header_bytes:
            limit = self.limits.max_header_bytes
            self._refuse(RequestHeaderTooLarge(f"request head is over {limit} bytes (request line included)"))
            return len(data)
        self._head_bytes += end - start  # before the feed: on_headers_complete resets both for the next head
        self._head_tail = (self._head_tail + data[max(start, end - 3) : end])[-3:]
        return end

    def _feed(self, data: bytes | memoryview) -> None:
        """uvicorn's ``data_received``, except that our limits answer their own status, JSON-shaped."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # not reached: on_headers_complete refuses every upgrade
            self._refuse(BadRequest("protocol upgrade is not supported"))
        except httptools.HttpParserError as exc:
            self._refuse(self._refusal or BadRequest(f"invalid HTTP request: {exc}"))

    # -- parser callbacks ---------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._header_count = 0
        self._framing = []
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._refusal = RequestHeaderTooLarge(f"request has more than {self.limits.max_headers} headers")
            raise _Refused
        # uvicorn's ``on_header``, inline (it runs per header), keeping aside the few headers that frame the
        # request: the head's checks and its body's framing then read those, not every header again.
        name = name.lower()
        if name in _FRAMING:
            self._framing.append((name, value))
        elif name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        method = self.parser.get_method()
        refusal = head_refusal(method, self.parser.get_http_version(), self._framing)
        if refusal is None and self._reserved and not _is_healthz(method, self.url):
            refusal = self._busy()
        if refusal is not None:  # still _in_head: the refused request is not dispatched
            self._refusal = refusal
            raise _Refused
        self._in_head = False
        self._in_body = True
        self._head_bytes = 0
        self._head_tail = b""
        self._body = _body_frame(self._framing, self._fixed)
        self._body_bytes = 0
        self._body_start = self.loop.time()
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not before:  # made just now (not an upgrade): its task has not run yet
            self.cycle.transport = HeldHead(self.transport, self.loop)  # type: ignore[assignment]
        if self._reserved:
            self.cycle.keep_alive = False  # one /healthz per reserved connection

    def on_message_complete(self) -> None:
        self._in_body = False
        self._in_head = True
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self._owed is not None and not self.pipeline:  # the last request before the refused one
            err, linger = self._owed
            self._owed = None
            self.server_state.total_requests += 1
            if not self.transport.is_closing():
                self._answer(err, linger)
            return
        # uvicorn's, except for its keep-alive timer: that one is lazy (``_keep_alive_due``).
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.flow.resume_reading()
        if self.pipeline:
            cycle, app = self.pipeline.pop()
            self._start_asgi_task(cycle, app)
            return
        self._idle_at = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self._keep_alive_due)

    # -- keep-alive ---------------------------------------------------------------------------------------
    # uvicorn arms a timer per response and cancels it when the next request's first byte comes: on a busy
    # connection that is a timer (~10k instructions, uvloop) per request. Here one stays armed: data only
    # marks the connection busy, and when the timer fires it closes a connection idle for
    # ``timeout_keep_alive``, re-arms for the rest of an idle spell that started later, or goes (busy: the
    # next response arms one). The connection closes when uvicorn's would.

    def _unset_keepalive_if_required(self) -> None:
        self._idle_at = None

    def _keep_alive_due(self) -> None:
        self.timeout_keep_alive_task = None
        if self._idle_at is None:
            return
        left = self._idle_at + self.timeout_keep_alive - self.loop.time()
        if left > 0:
            self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_due)
            return
        self.timeout_keep_alive_handler()

    # -- deadlines ----------------------------------------------------------------------------------------

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self._discarding or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # The next (pipelined) request started while this one is still answered: not late yet.
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)
            return
        if self._head_bytes == 0:
            self._discarding = True
            self.transport.close()  # nothing was asked: nobody to answer
            return
        timeout = self.limits.header_timeout_s
        self._refuse(RequestTimeout(f"request head not complete within {timeout:g} s"), linger=False)

    def _body_time_left(self, now: float) -> float:
        """Seconds until the body is late: silent too long, or slower than the minimum rate allows."""
        limits = self.limits
        silence = self._body_at + limits.body_read_timeout_s
        whole = self._body_start + limits.body_deadline_s + self._body_bytes / limits.body_min_bytes_per_s
        return min(silence, whole) - now

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self._in_body or self._discarding or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or self.transport.get_protocol() is not self:  # upgraded: not ours any more
            return
        now = self.loop.time()
        if self.flow.read_paused or cycle.waiting_for_100_continue:
            # We are not reading (the app is behind), so the client may not send: charge it nothing.
            self._body_at = now
            self._body_start += now - self._body_checked
        self._body_checked = now
        if cycle.response_complete:  # answered without reading it all; the rest of the body is moot
            self._discarding = True
            self.transport.close()
            return
        left = self._body_time_left(now)
        if left > 0:
            self._body_timer = self.loop.call_later(left, self._body_timed_out)
            return
        limits = self.limits
        if now - self._body_at >= limits.body_read_timeout_s:
            message = f"request body stalled: nothing received for {limits.body_read_timeout_s:g} s"
        else:
            message = (
                f"request body too slow: {self._body_bytes} bytes in {now - self._body_start:.1f} s (the "
                f"limit: {limits.body_deadline_s:g} s plus 1 s per {limits.body_min_bytes_per_s} bytes)"
            )
        self._refuse(RequestTimeout(message), linger=False)

    # -- answering ----------------------------------------------------------------------------------------

    def _refuse(self, err: GatewayError, *, linger: bool = True) -> None:
        """Answer ``err`` (unless a response is already under way), then close; one log line. Nothing
        received after it is parsed. Earlier pipelined requests are answered first."""
        if self._discarding or self.transport.is_closing():
            return
        self._discarding = True
        if isinstance(err, ServerBusy):
            self._log_busy()
        else:
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "client"
            log.info("%s: %d %s: %s", client, err.status, err.code, err.message)
        if self._answer_later():
            self._owed = (err, linger)
            return
        self._answer(err, linger)

    def _answer_later(self) -> bool:
        """True when an earlier request on this connection is still being answered (pipelining)."""
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return False
        if self._in_head:  # the refused request never got a cycle; ``cycle`` is the one before it
            return True
        for queued in self.pipeline:  # the refused request is ``cycle``, queued behind another: drop it
            if queued[0] is cycle:
                self.pipeline.remove(queued)
                return True
        return False

    def _answer(self, err: GatewayError, linger: bool) -> None:
        cycle = self.cycle
        answering = cycle is not None and cycle.response_started and not cycle.response_complete
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() now says http.disconnect; its sends go nowhere
            cycle.message_event.set()
        if answering:
            self.transport.close()
            return
        self._write_error(err)
        if linger and self.transport.can_write_eof():
            self.transport.write_eof()
            self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _busy(self) -> ServerBusy:
        cap = self.limits.max_connections
        return ServerBusy(f"the gateway holds {cap} client connections, its limit; retry later")

    def _log_busy(self) -> None:
        if count := self.busy_log.due(time.monotonic()):
            cap = self.limits.max_connections
            log.warning("refused %d connection(s): over the cap of %d open connections", count, cap)

    def _write_error(self, err: GatewayError) -> None:
        body = err.body()
        head = [STATUS_LINE[err.status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
        head.append(b"connection: close\r\n\r\n")
        self.transport.write(b"".join(head) + body)


def _is_healthz(method: bytes, target: bytes) -> bool:
    return method in (b"GET", b"HEAD") and target.split(b"?", 1)[0] == b"/healthz"


def _body_frame(headers: list[tuple[bytes, bytes]], fixed: FixedLength) -> BodyFrame:
    """How the request's body is framed (``fixed`` re-armed, unless it is chunked); the parser has checked
    the header values by now."""
    length = 0
    for name, value in headers:
        if name == b"transfer-encoding":
            return ChunkedEnd()
        if name == b"content-length" and value.strip().isdigit():
            length = int(value)
    fixed.left = length
    return fixed
