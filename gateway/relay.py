"""The relay phase's parts: the headers an engine gets and those that reach the client, the watch on engine
silence, the bounded read of a non-streamed reply, error messages.

The body itself is pumped by gateway/exchange.py's ``Relay``; what is here has no state beyond one response.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import ClassVar

from starlette.types import Message, Send

from config.settings import TimeoutConfig
from gateway.context import RequestContext
from gateway.errors import GatewayError, UpstreamReplyTooLarge
from gateway.shapes.base import ErrorShape
from gateway.transport import TransportResponse
from routing.types import Reason

SSE = b"text/event-stream"
DONE = b"data: [DONE]\n\n"

#: Largest non-streamed reply read whole to be rewritten (a chat completion is a few KiB; 16 MiB is a very
#: long one with many choices). A larger one is refused, never held.
MAX_REPLY_BYTES = 16 * 1024 * 1024

#: Engine response headers a client relies on (rate limits, back-off, redirects, correlation).
_RELAYED = frozenset({b"retry-after", b"location", b"x-request-id"})
_RELAYED_PREFIX = (b"x-ratelimit-", b"anthropic-ratelimit-")
#: ``x-warmroute-route``'s value per reason (an enum's ``value`` is a Python-level property).
_ROUTE_VALUES = {reason: reason.value.encode() for reason in Reason}


def streamed(upstream: TransportResponse) -> bool:
    """Whether the engine answered an SSE stream."""
    return (upstream.header(b"content-type") or b"").startswith(SSE)


def response_head(
    upstream: TransportResponse, backend: str, reason: Reason, hold_limit: int | None = None
) -> tuple[bool, Message]:
    """(is it an SSE stream, the ``http.response.start`` message for the client). ``hold_limit``: the body is
    held whole (at most that many bytes) and may be rewritten, so its head goes without the engine's
    content-length, and a body the engine says is larger is refused here (``UpstreamReplyTooLarge``)."""
    content_type = length = None
    relayed = []
    for name, value in upstream.headers:  # one pass: the content type is read here too
        if name == b"content-type":
            content_type = value if content_type is None else content_type
        elif name == b"content-length":
            length = value if length is None else length
        elif name in _RELAYED or name.startswith(_RELAYED_PREFIX):
            relayed.append((name, value))
    content_type = content_type or b"application/json"
    sse = content_type.startswith(SSE)
    headers = [(b"content-type", content_type)]
    if sse:
        headers.append((b"cache-control", b"no-cache"))
    headers += relayed
    if length is not None and not sse:
        if hold_limit is None:
            headers.append((b"content-length", length))
        elif length.isdigit() and int(length) > hold_limit:
            raise reply_too_large(backend, hold_limit)
    headers.append((b"x-warmroute-backend", backend.encode()))
    headers.append((b"x-warmroute-route", _ROUTE_VALUES[reason]))
    return sse, {"type": "http.response.start", "status": upstream.status, "headers": headers}


def reply_too_large(backend: str, limit: int) -> UpstreamReplyTooLarge:
    return UpstreamReplyTooLarge(
        f"backend {backend} sent a reply larger than {limit} bytes; the gateway does not hold one that large "
        "to rewrite it (ask for a stream)"
    )


class Expiry(StrEnum):
    SILENCE = "silence"  # the engine sent nothing for read_s
    DEADLINE = "deadline"  # the whole request ran past request_s


class Alarm:
    """A deadline kept by ``Alarms``: ``due`` (loop time); ``check(now)`` at or after it acts and returns
    None, or returns the next time it is due (it moved meanwhile)."""

    __slots__ = ("due",)
    due: float

    def check(self, now: float) -> float | None:
        raise NotImplementedError


class Alarms:
    """A loop's deadlines on one loop timer. A request's deadlines (its head's, its engine's silence) are
    almost never reached, and a loop timer costs ~5k instructions to arm and as much to cancel (uvloop): so
    each is a number in a set, and the one timer is armed for the earliest. When it fires, each alarm due
    checks itself (one that moved says when it is due now) and the timer is armed for the next; an alarm
    earlier than the armed timer re-arms it at once, so every alarm acts at its own time, as on a timer of
    its own. ``of`` gives the running loop's."""

    __slots__ = ("_handle", "_live", "_loop", "_when")

    _by_loop: ClassVar[dict[asyncio.AbstractEventLoop, Alarms]] = {}

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._live: set[Alarm] = set()
        self._handle: asyncio.TimerHandle | None = None
        self._when = math.inf

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Alarms:
        alarms = cls._by_loop.get(loop)
        if alarms is None:
            for old in [old for old in cls._by_loop if old.is_closed()]:
                del cls._by_loop[old]
            alarms = cls._by_loop[loop] = cls(loop)
        return alarms

    def add(self, alarm: Alarm) -> None:
        self._live.add(alarm)
        if alarm.due < self._when:
            self._arm(alarm.due)

    def discard(self, alarm: Alarm) -> None:
        self._live.discard(alarm)  # the timer stays: firing with nothing due costs less than a cancel

    def _arm(self, when: float) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._when = when
        self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle, self._when = None, math.inf
        now, nearest = self._loop.time(), math.inf
        for alarm in list(self._live):  # a copy: those that act leave the set
            if alarm.due <= now:
                due = alarm.check(now)
                if due is None:
                    self._live.discard(alarm)
                    continue
                alarm.due = due
            nearest = min(nearest, alarm.due)
        if nearest < math.inf:
            self._arm(nearest)


class SilenceWatch(Alarm):
    """Cancels ``task`` when the engine is silent for ``read_s`` or the loop time passes ``deadline``.

    Time spent waiting for the client to take a chunk (``sending``) is not engine silence: a slow reader
    must not be blamed on a healthy engine. Lazy on purpose: a chunk costs two attribute stores, and the
    watch is checked (on the loop's ``Alarms``) at most once per ``read_s``, not once per chunk.
    """

    __slots__ = ("_alarms", "_task", "deadline", "fired", "last", "loop", "read_s", "sending")

    def __init__(self, task: asyncio.Task[None], read_s: float, deadline: float) -> None:
        self.loop = loop = task.get_loop()  # not ``asyncio.get_running_loop()``: a ``getpid()`` on 3.11
        self._task = task
        self.read_s = read_s
        self.deadline = deadline
        self.last = loop.time()
        self.sending = False
        self.fired: Expiry | None = None
        self.due = min(deadline, self.last + read_s)
        self._alarms = Alarms.of(loop)
        self._alarms.add(self)

    @classmethod
    def for_request(cls, ctx: RequestContext, timeouts: TimeoutConfig) -> SilenceWatch:
        """The watch of ``ctx``'s relay: ``read_s`` of engine silence, ``request_s`` since it arrived."""
        assert ctx.task is not None
        deadline = ctx.task.get_loop().time() + ctx.remaining(timeouts.request_s)
        return cls(ctx.task, timeouts.read_s, deadline)

    def chunk_sent(self) -> None:
        self.sending = False
        self.last = self.loop.time()

    def cancel(self) -> None:
        self._alarms.discard(self)

    def check(self, now: float) -> float | None:
        if now >= self.deadline:
            self._fire(Expiry.DEADLINE)
            return None
        due = now + self.read_s if self.sending else self.last + self.read_s
        if due <= now:
            self._fire(Expiry.SILENCE)
            return None
        return min(due, self.deadline)

    def _fire(self, why: Expiry) -> None:
        self.fired = why
        self._task.cancel()


class Deadline(Alarm):
    """``asyncio.timeout(delay)``, the same behaviour for the one use per request (an attempt's wait for
    its answer's head): on expiry the task is cancelled, and that ``CancelledError`` leaves the block as
    ``TimeoutError``; a cancel from elsewhere (the client left) stays a cancel. On Python 3.11 the stdlib's
    costs ~29k instructions a use (its state is an enum, each load through ``EnumType``'s slow hook, and a
    loop timer armed and cancelled); this one is a number on the loop's ``Alarms``. ``task``: the task that
    enters it (the current one), where the caller has it: on 3.11 each ``asyncio.current_task()`` and
    ``get_running_loop()`` is a ``getpid()`` system call, and this took three."""

    __slots__ = ("_alarms", "_cancelling", "_expired", "_handle", "_loop", "_task")

    def __init__(self, delay: float, task: asyncio.Task[None] | None = None) -> None:
        if task is None:
            task = asyncio.current_task()
            assert task is not None, "Deadline is entered by a task"
        self._task = task
        self._loop = task.get_loop()
        self.due = self._loop.time() + delay
        self._expired = False

    async def __aenter__(self) -> None:
        task, loop = self._task, self._loop
        self._cancelling = task.cancelling()
        self._alarms: Alarms | None = None
        self._handle: asyncio.Handle | None = None
        if self.due <= loop.time():
            self._handle = loop.call_soon(self._expire)
        else:
            self._alarms = Alarms.of(loop)
            self._alarms.add(self)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if self._alarms is not None:
            self._alarms.discard(self)
        elif self._handle is not None:
            self._handle.cancel()
        if self._expired and self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc  # no other cancel came meanwhile: this one was ours

    def check(self, now: float) -> float | None:
        self._expire()
        return None

    def _expire(self) -> None:
        self._task.cancel()
        self._expired = True


def body(data: bytes, more: bool) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": more}


def sse_error(err: GatewayError, errors: ErrorShape) -> Message:
    """The end of a stream that broke after bytes were sent, in the route's shape (OpenAI: an error event,
    then [DONE])."""
    return body(errors.stream_end(err), more=False)


async def send_error(send: Send, err: GatewayError, errors: ErrorShape) -> None:
    """A whole error response, in the route's shape."""
    payload = errors.body(err)
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [
                (b"content-type", errors.content_type),
                (b"content-length", str(len(payload)).encode()),
                *err.headers(),
            ],
        }
    )
    await send(body(payload, more=False))


def upstream_headers(
    client: Sequence[tuple[bytes, bytes]],
    first: Mapping[bytes, bytes],
    api_key: str | None,
    forward_auth: bool = True,
) -> list[tuple[bytes, bytes]]:
    """What the engine gets: our framing, the client's accept and request id, and the right credentials
    (the client's own Authorization only with ``forward_auth``; the backend's ``api_key`` wins anyway).
    ``client``: the request's headers as sent; ``first``: each one's first value (``ctx.first``)."""
    accept, request_id = first.get(b"accept"), first.get(b"x-request-id")
    auth = first.get(b"authorization") if forward_auth else None
    if accept == b"" or request_id == b"" or auth == b"":  # sent empty first: the first one not empty
        accept = request_id = auth = None
        for name, value in client:
            if name == b"accept":
                accept = accept or value
            elif name == b"x-request-id":
                request_id = request_id or value
            elif name == b"authorization" and forward_auth:
                auth = auth or value
    headers = [
        (b"content-type", b"application/json"),
        (b"accept", accept or b"*/*"),
        (b"accept-encoding", b"identity"),
    ]
    if api_key:
        auth = f"Bearer {api_key}".encode()
    if auth:
        headers.append((b"authorization", auth))
    if request_id:
        headers.append((b"x-request-id", request_id))
    return headers
