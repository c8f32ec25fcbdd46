"""The one relay: the answered attempt's response, through its body filters, to the client.

Per response one ``EventSplitter`` (gateway/sse.py) cuts an SSE stream into events as the engine's bytes
arrive; the attempt's body filters (gateway/phases.py) see them in module order (the output guard, reasoning
fields, continuation stitching), then the observation tap. While no filter rewrites, the engine's reads go on
as they came and the filters only look. A non-streamed body goes on chunk by chunk, or whole (bounded: at most
``max_reply_bytes`` is ever held) when a filter holds it; its head then waits for it, so a refusal on the way
is still a proper error response.

A filter may ask for a follow-up exchange on the same lease once the engine's body ended (the gateway-enforced
thinking budget's phase 2): its response goes through the same filters, so the guard, the tap (tokens, TTFT,
learning) and first-byte accounting see the whole answer.

Engine silence is timed on the bytes the engine sends (``read_s``), whatever a filter holds back; the client's
reading is not timed; ``request_s`` bounds the whole, follow-up included. A failure after bytes were sent ends
an SSE stream with an error event and ``[DONE]``, never a hang.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from starlette.types import Message, Send

from config.settings import TimeoutConfig
from gateway.context import RequestContext, canonical_json
from gateway.errors import (
    EngineFailed,
    NoHealthyBackend,
    UpstreamError,
    UpstreamReplyTooLarge,
    UpstreamTimeout,
)
from gateway.not_found import relay_404
from gateway.observe import HeadTap, ResponseTap
from gateway.outcomes import RequestOutcome
from gateway.phases import BodyFilter, BodyFilterBase, BodyFilters
from gateway.relay import (
    MAX_REPLY_BYTES,
    Expiry,
    SilenceWatch,
    body,
    reply_too_large,
    response_head,
    send_error,
    sse_error,
    streamed,
    upstream_headers,
)
from gateway.sse import MAX_EVENT_BYTES, EventSplitter, Piece, Pieces, Unended, Whole, as_list
from gateway.transport import TransportResponse, UpstreamReadError, UpstreamTransport, UpstreamTransportError

log = logging.getLogger("warmroute.proxy")


class HealthFeed(Protocol):
    def outcome(self, backend_id: str, ok: bool) -> None: ...


@dataclass(frozen=True, slots=True)
class RelayLimits:
    max_reply_bytes: int = MAX_REPLY_BYTES  # largest non-streamed body held whole for a filter
    max_event_bytes: int = MAX_EVENT_BYTES  # largest SSE event held back whole by the splitter


class Relay:
    def __init__(
        self,
        timeouts: TimeoutConfig,
        transport: UpstreamTransport,
        feed: HealthFeed,
        filters: Sequence[BodyFilters],
        *,
        tap: bool,
        hide_engine_errors: bool = False,
        limits: RelayLimits | None = None,
    ) -> None:
        self.timeouts = timeouts
        self.transport = transport
        self.feed = feed
        self.factories = tuple(filters)
        self.tap = tap  # observers are configured: every answer is tapped
        self.hide_engine_errors = hide_engine_errors  # an engine's 5xx body stays here (internal names)
        self.limits = limits or RelayLimits()

    async def answer(self, ctx: RequestContext, upstream: TransportResponse, send: Send) -> None:
        assert ctx.lease is not None
        if self.hide_engine_errors and upstream.status >= 500:
            await self._withhold(ctx, upstream, send)
            return
        if upstream.status == 404 and ctx.body is None:  # a forwarded route the engine does not serve
            await relay_404(ctx, upstream, send, self.timeouts.read_s)
            ctx.outcome = RequestOutcome.HTTP_4XX
            return
        sse = streamed(upstream)
        filters = self._filters(ctx, upstream.status, sse)
        held = False  # a filter reads the whole body first: its head then goes without the engine's size
        if not sse:
            for f in filters:
                held = held or f.holds
        try:
            result = await self._pump(ctx, upstream, sse, held, send, filters)
        finally:
            for f in filters:
                if f.own_close:
                    f.close()
        if not isinstance(result, UpstreamError):
            assert ctx.upstream is not None
            ctx.outcome = answered(ctx.upstream.status)
            ctx.finishing = True
            await send(body(result, more=False))
        elif not ctx.responded:  # a body held whole was refused before its head went: a proper error response
            ctx.outcome = outcome_of(result)
            ctx.finishing = ctx.responded = True
            await send_error(send, result, ctx.shape.errors)
        else:
            ctx.outcome = RequestOutcome.MID_STREAM_ERROR
            if sse:
                ctx.finishing = True
                await send(sse_error(result, ctx.shape.errors))
            else:
                # A non-streamed body's status line is gone: returning without finishing makes the server
                # close the connection, which is the only honest signal left.
                log.warning("%s; closing the client connection", result.message)

    def _filters(self, ctx: RequestContext, status: int, sse: bool) -> tuple[BodyFilter, ...]:
        assert ctx.attempt is not None
        out = [f for m in self.factories if (f := m.body_filter(ctx, ctx.attempt, status, sse)) is not None]
        if self.tap:
            route = ctx.route
            reply, shape = route is not None and route.first_turn and route.teaches, ctx.shape
            if shape.usage_head:  # its usage is split between the first event and the last
                ctx.tap = HeadTap(shape.usage_head, reply, shape.reply)
            else:
                ctx.tap = ResponseTap(reply, shape.reply)
            out.append(_Tap(ctx.tap))
        return tuple(out)

    async def _withhold(self, ctx: RequestContext, upstream: TransportResponse, send: Send) -> None:
        """An engine 5xx answered generically; its body is never read (the proxy's finish closes it)."""
        assert ctx.lease is not None
        backend = ctx.lease.backend.id
        log.warning("backend %s answered %d; its body is withheld from the client", backend, upstream.status)
        ctx.outcome = RequestOutcome.HTTP_5XX
        ctx.finishing = ctx.responded = True
        failed = EngineFailed(backend, upstream.status, upstream.header(b"retry-after"))
        await send_error(send, failed, ctx.shape.errors)

    # -- the pump -----------------------------------------------------------------------------------------

    async def _pump(
        self,
        ctx: RequestContext,
        upstream: TransportResponse,
        sse: bool,
        held: bool,
        send: Send,
        filters: tuple[BodyFilter, ...],
    ) -> bytes | UpstreamError:
        """Send the head and the body; the last body bytes to send when it ended properly, else why not."""
        assert ctx.lease is not None and ctx.task is not None
        backend = ctx.lease.backend.id
        watch = SilenceWatch.for_request(ctx, self.timeouts)
        try:
            return await self._exchanges(ctx, upstream, sse, held, send, watch, filters)
        except asyncio.CancelledError:
            if watch.fired is None:
                raise  # the client left, or the server is stopping
            ctx.task.uncancel()
            failure: str = f"sent nothing for {self.timeouts.read_s:g}s"
            if watch.fired is Expiry.DEADLINE:
                failure = f"did not finish within request_s={self.timeouts.request_s:g}s"
            error: UpstreamError = UpstreamTimeout(f"backend {backend} {failure}")
        except UpstreamReplyTooLarge as exc:
            log.warning("%s", exc.message)
            return exc  # the engine answered: too large to rewrite is no failure of its health
        except UpstreamReadError as exc:
            log.warning("backend %s broke mid-response: %s", backend, exc)
            error = UpstreamError(f"backend {backend} failed mid-stream (the connection broke)")
        except UpstreamError as exc:
            return exc  # a filter ended the answer (the guard, a malformed phase): the engine did answer
        finally:
            watch.cancel()
        self.feed.outcome(backend, False)  # the engine broke or went silent mid-answer
        return error

    async def _exchanges(
        self,
        ctx: RequestContext,
        upstream: TransportResponse,
        sse: bool,
        held: bool,
        send: Send,
        watch: SilenceWatch,
        filters: tuple[BodyFilter, ...],
    ) -> bytes:
        """The engine's body, then each follow-up a filter asks for; the last bytes to send. A ``held`` body's
        head (unsized) goes once the body is read."""
        assert ctx.lease is not None
        backend = ctx.lease.backend.id
        limit = self.limits.max_reply_bytes if held else None
        _, head = response_head(upstream, backend, ctx.reason, limit)
        if not held:
            await _send_head(ctx, send, head, watch)
        kept, response = [], upstream
        while True:
            if held:
                kept.append(await self._whole(ctx, response, watch, filters))
            else:
                await self._body(ctx, response, sse, send, watch, filters)
            for f in filters:
                if f.own_follow_up and (payload := f.follow_up()) is not None:
                    break
            else:
                break
            for f in filters:
                if f.own_continued:
                    f.continued()
            response = await self._follow(ctx, response, payload, watch, filters)
        ended = _ended(filters)
        tail = b"".join([p.raw for p in ended]) if ended else b""
        if not held:
            return tail
        if response is not upstream:  # the last exchange's status (the first one's head is unsized already)
            _, head = response_head(response, backend, ctx.reason, limit)
        await _send_head(ctx, send, head, watch)
        # Its size is no longer the engine's: sent unsized, the server frames it. It goes as the answer's
        # last message (one write, the chunk and the end together).
        return kept[0] + tail if len(kept) == 1 else b"".join(kept) + tail

    async def _body(
        self,
        ctx: RequestContext,
        response: TransportResponse,
        sse: bool,
        send: Send,
        watch: SilenceWatch,
        filters: tuple[BodyFilter, ...],
    ) -> None:
        """One exchange's body, relayed as it comes: a stream event by event, a plain body chunk by chunk."""
        assert ctx.lease is not None and ctx.attempt is not None
        attempt = ctx.attempt
        splitter = EventSplitter(self.limits.max_event_bytes) if sse and filters else None
        rewrites = False
        for f in filters:  # not ``any()``: a generator per response
            rewrites = rewrites or f.rewrites
        clock = watch.loop.time
        opening = ctx.shape.opening if sse else None
        # The engine's reads, each proof it is alive whatever a filter holds back (an event not ended yet).
        # The per-read bookkeeping is inline: a generator layer per read cost more than a filter.
        async for chunk in response.aiter_raw():
            if ctx.first_byte_at is None and (opening is None or not opening(chunk)):
                ctx.first_byte_at = time.monotonic()
                ctx.lease.first_byte()  # its prefill is no longer queued on the engine
            if splitter is None:
                for f in filters:
                    chunk = f.body(chunk)
            else:
                pieces = splitter.feed(chunk)
                for f in filters:  # _through, inline
                    if not pieces:
                        break
                    pieces = f.events(pieces)
                if rewrites or attempt.cut:
                    # A cut read goes on as its whole events only: the bytes of an event it ends inside are
                    # regenerated by the follow-up, and half an event before it would garble the stream.
                    if type(pieces) is Whole:  # no filter changed the read: it goes on as it came
                        chunk = pieces.raw
                    else:
                        chunk = pieces[0].raw if len(pieces) == 1 else b"".join([p.raw for p in pieces])
            if chunk:
                # No stamp of the read needed: nothing awaits between it and ``sending``, and the watch is
                # stamped once the client took the chunk.
                watch.sending = True
                await send(body(chunk, more=True))
                watch.chunk_sent()
            else:
                watch.last = clock()  # held back, but heard
            if attempt.cut:
                break  # a filter ended this exchange here; its follow-up goes on
        rest = b"" if splitter is None else splitter.close()
        if rest:
            pieces = _through(filters, [Unended(rest)])
            if rewrites and pieces:
                watch.sending = True
                await send(body(b"".join(p.raw for p in pieces), more=True))
                watch.chunk_sent()

    async def _whole(
        self,
        ctx: RequestContext,
        response: TransportResponse,
        watch: SilenceWatch,
        filters: tuple[BodyFilter, ...],
    ) -> bytes:
        """The whole body, through the filters; ``UpstreamReplyTooLarge`` as soon as it passes the limit
        (never held). Each read is proof the engine is alive, as in ``_body``."""
        assert ctx.lease is not None
        limit, parts, size = self.limits.max_reply_bytes, [], 0
        clock = watch.loop.time
        async for chunk in response.aiter_raw():
            watch.last = clock()
            if ctx.first_byte_at is None:
                ctx.first_byte_at = time.monotonic()
                ctx.lease.first_byte()
            size += len(chunk)
            if size > limit:
                raise reply_too_large(ctx.lease.backend.id, limit)
            parts.append(chunk)
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        for f in filters:
            data = f.body(data)
        return data

    async def _follow(
        self,
        ctx: RequestContext,
        done: TransportResponse,
        payload: dict[str, Any],
        watch: SilenceWatch,
        filters: tuple[BodyFilter, ...],
    ) -> TransportResponse:
        """Close the exchange that ended (the engine stops), let each filter get ready (a paused stream waits
        for its seat: not engine silence), then send the follow-up on the same lease."""
        assert ctx.lease is not None
        await done.aclose()
        ctx.upstream = None
        watch.sending = True
        for f in filters:
            await f.before_follow_up()
        backend = ctx.lease.backend
        forward = ctx.client is None or backend.cfg.forward_client_key
        headers = upstream_headers(ctx.headers, ctx.first, backend.cfg.api_key, forward)
        path = (
            ctx.path if ctx.attempt is None else ctx.attempt.path
        )  # where this attempt's first exchange went
        watch.sending = True  # waiting for its head is timed by first_byte_s, as on a first attempt
        try:
            async with asyncio.timeout(self.timeouts.first_byte_s):
                response = await self.transport.request(
                    "POST", backend.cfg.url, path, headers, canonical_json(payload)
                )
        except TimeoutError:
            raise UpstreamTimeout(f"backend {backend.id} sent no continuation in time") from None
        except UpstreamTransportError as exc:
            raise UpstreamError(f"backend {backend.id} failed before continuing: {exc}") from None
        ctx.upstream = response  # closed by the proxy's finish: a disconnect now stops the follow-up
        watch.chunk_sent()
        if response.status != 200:
            raise UpstreamError(f"backend {backend.id} refused the continuation ({response.status})")
        return response


class _Tap(BodyFilterBase):
    """The observation tap, last: it sees what the client gets."""

    __slots__ = ("tap",)

    def __init__(self, tap: ResponseTap) -> None:
        self.tap = tap

    def events(self, pieces: Pieces) -> Pieces:
        self.tap.take(pieces)
        return pieces

    def body(self, data: bytes) -> bytes:
        if data:
            self.tap.feed(data)
        return data


def _through(filters: tuple[BodyFilter, ...], pieces: Pieces) -> Pieces:
    for f in filters:
        if not pieces:
            break
        pieces = f.events(pieces)
    return pieces


def _ended(filters: tuple[BodyFilter, ...]) -> list[Piece]:
    """What the filters send after the last exchange, each filter's tail seen by the filters after it."""
    out: list[Piece] = []
    for f in filters:
        if out:
            out = as_list(f.events(out))
        if f.own_end:
            out = out + f.end()  # never ``+=``: ``out`` may be a filter's own list
    return out


async def _send_head(ctx: RequestContext, send: Send, head: Message, watch: SilenceWatch) -> None:
    ctx.responded = True
    watch.sending = True  # a client slow to take it is not a silent engine
    await send(head)
    watch.chunk_sent()


#: Every answer's outcome, loaded once: an enum class attribute is a slow load on 3.11 (backends/breaker.py).
_OK = RequestOutcome.OK


def answered(status: int) -> RequestOutcome:
    if status < 400:
        return _OK
    return RequestOutcome.HTTP_4XX if status < 500 else RequestOutcome.HTTP_5XX


def outcome_of(err: Exception) -> RequestOutcome:
    if isinstance(err, UpstreamTimeout):
        return RequestOutcome.UPSTREAM_TIMEOUT
    if isinstance(err, UpstreamError):
        return RequestOutcome.UPSTREAM_ERROR
    if isinstance(err, NoHealthyBackend):
        return RequestOutcome.NO_BACKEND
    return RequestOutcome.REJECTED
