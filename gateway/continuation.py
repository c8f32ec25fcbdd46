"""The gateway-enforced thinking budget: two generations on the same backend, one response for the client.

Phase 1 is the client's request with its token limit lowered to the budget, so the engine itself stops there
and reports exact usage (how reasoning tokens are counted: the engine's ``usage.completion_tokens``; every
phase-1 token is reasoning while no answer has started). If it stops for that limit, phase 2 continues the
same assistant turn on the same backend (its prefix cache holds prompt and reasoning): the reasoning so far
plus the early-stop phrase (which closes the thought) as an assistant prefix,
``continue_final_message: true``, ``add_generation_prompt: false``, thinking off. If the answer had already
begun, phase 2 continues the answer. Whatever phase 2 emits is answer: reasoning-labelled deltas
are relabelled as content.

The client gets one response or one stream: phase 1's id, reasoning then content, phase 2's finish reason,
usage with the prompt counted once (phase 1's) and the completion tokens of both phases. A client disconnect
cancels the proxy's task; ``Proxy._finish`` closes ``ctx.upstream`` (the phase in progress), which stops the
engine's work.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Send

from backends.dialects import DIALECTS
from config.settings import Dialect, ThinkingConfig, TimeoutConfig
from gateway.context import RequestContext, canonical_json
from gateway.errors import BadRequest, UpstreamError, UpstreamReplyTooLarge, UpstreamTimeout
from gateway.metrics import Metrics
from gateway.outcomes import RequestOutcome
from gateway.proxy import upstream_headers
from gateway.reasoning import normalise, reasoning_of, write_reasoning
from gateway.relay import (
    DONE,
    MAX_REPLY_BYTES,
    Expiry,
    SilenceWatch,
    body,
    read_reply,
    response_head,
    send_error,
    sse_error,
)
from gateway.sse import EventSplitter, Overflow
from gateway.transport import TransportResponse, UpstreamTransport, UpstreamTransportError

if TYPE_CHECKING:
    from gateway.budgets import Thinking

LIMIT_FIELDS = ("max_completion_tokens", "max_tokens")


def client_limit(body: dict[str, Any]) -> tuple[str, int | None]:
    """(the token-limit field the client used, its value); ``max_tokens`` and None when it set neither."""
    for name in LIMIT_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return name, value
    return "max_tokens", None


def continues(body: dict[str, Any], thinking: Thinking) -> bool:
    """Phase 1 stops at the budget rather than at the client's own limit."""
    _, limit = client_limit(body)
    return thinking.budget is not None and (limit is None or thinking.budget < limit)


def shape_phase1(body: dict[str, Any], thinking: Thinking) -> None:
    """Phase 1 of a gateway-enforced request, on the attempt's copy of the body."""
    n = body.get("n")
    if n not in (None, 1):
        raise BadRequest("a gateway-enforced thinking budget needs n=1", param="n")
    if not continues(body, thinking):
        return  # the client's own limit binds first: one generation, relayed as it is
    assert thinking.budget is not None
    name, _ = client_limit(body)
    body[name] = thinking.budget
    if body.get("stream") is True:
        options = body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}


@dataclass(slots=True)
class _Phase:
    """What a phase produced, as the client will see it."""

    envelope: dict[str, Any] = field(default_factory=dict)  # id, object, created, model of phase 1
    reasoning: list[str] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    finish: str | None = None
    usage: dict[str, Any] | None = None

    def completion_tokens(self) -> int:
        value = (self.usage or {}).get("completion_tokens")
        return value if isinstance(value, int) else len(self.reasoning) + len(self.content)


class Continuation:
    def __init__(
        self, transport: UpstreamTransport, timeouts: TimeoutConfig, cfg: ThinkingConfig, metrics: Metrics
    ) -> None:
        self.transport = transport
        self.timeouts = timeouts
        self.cfg = cfg
        self.metrics = metrics

    async def relay(self, ctx: RequestContext, upstream: TransportResponse, send: Send) -> None:
        """Answer ``ctx`` from phase 1's response ``upstream`` (and phase 2 if needed).

        Engine silence and the request deadline are timed as on the proxy's own relay (``SilenceWatch``).
        """
        assert ctx.body is not None and ctx.task is not None
        watch = SilenceWatch.for_request(ctx, self.timeouts)

        async def timed_send(message: Message) -> None:
            watch.sending = True  # a slow client is not a silent engine
            await send(message)
            watch.chunk_sent()

        timed = _Timed(upstream, watch)
        try:
            if ctx.body.get("stream") is True:
                await self._stream(ctx, timed, timed_send)
            else:
                await self._whole(ctx, timed, timed_send)
        except asyncio.CancelledError:
            if watch.fired is None:
                raise  # the client left, or the server is stopping
            ctx.task.uncancel()
            why = "went silent" if watch.fired is Expiry.SILENCE else "did not finish in time"
            await self._failed(ctx, send, UpstreamTimeout(f"backend {_backend(ctx)} {why}"))
        except TimeoutError:
            await self._failed(ctx, send, UpstreamTimeout(f"backend {_backend(ctx)} sent no continuation"))
        except (UpstreamTransportError, ValueError, KeyError, IndexError, TypeError) as exc:
            what = f"backend {_backend(ctx)} failed during a budgeted generation: {type(exc).__name__}"
            await self._failed(ctx, send, UpstreamError(what))
        except UpstreamError as err:
            await self._failed(ctx, send, err)
        finally:
            watch.cancel()

    # -- non-streamed -------------------------------------------------------------------------------------

    async def _whole(self, ctx: RequestContext, upstream: TransportResponse, send: Send) -> None:
        assert ctx.body is not None and ctx.thinking is not None
        first = json.loads(await _read(ctx, upstream))
        ctx.first_byte_at = ctx.first_byte_at or time.monotonic()
        choice = first["choices"][0]
        message = choice["message"]
        phase = _Phase(reasoning=[reasoning_of(message) or ""], content=[message.get("content") or ""])
        phase.usage = first.get("usage")
        if choice.get("finish_reason") != "length" or not continues(ctx.body, ctx.thinking):
            choice["message"] = normalise(message, self.cfg.reasoning_fields)
            self._count(ctx, phase, truncated=False)
            await self._send_json(ctx, upstream, send, first)
            return
        second_resp = await self._phase2(ctx, upstream, phase, stream=False)
        if second_resp.status != 200:
            await self._send_raw(ctx, second_resp, send, await _read(ctx, second_resp))
            return
        second = json.loads(await _read(ctx, second_resp))
        choice2 = second["choices"][0]
        answer = (reasoning_of(choice2["message"]) or "") + (choice2["message"].get("content") or "")
        out_message = dict(message)
        write_reasoning(out_message, "".join(phase.reasoning) or None, self.cfg.reasoning_fields)
        out_message["content"] = "".join(phase.content) + answer
        choice["message"] = out_message
        choice["finish_reason"] = choice2.get("finish_reason")
        first["usage"] = _usage(phase.usage, second.get("usage"))
        self._count(ctx, phase, truncated=True)
        await self._send_json(ctx, second_resp, send, first)

    async def _send_json(
        self, ctx: RequestContext, upstream: TransportResponse, send: Send, payload: dict[str, Any]
    ) -> None:
        await self._send_raw(ctx, upstream, send, canonical_json(payload))

    async def _send_raw(
        self, ctx: RequestContext, upstream: TransportResponse, send: Send, data: bytes
    ) -> None:
        _, head = response_head(upstream, _backend(ctx), ctx.reason)
        head["headers"] = [(k, v) for k, v in head["headers"] if k != b"content-length"]
        head["headers"].append((b"content-length", str(len(data)).encode()))
        ctx.responded = True
        await send(head)
        ctx.finishing = True
        await send(body(data, more=False))
        ctx.outcome = RequestOutcome.OK if upstream.status < 400 else RequestOutcome.HTTP_4XX
        if upstream.status >= 500:
            ctx.outcome = RequestOutcome.HTTP_5XX

    # -- streamed -----------------------------------------------------------------------------------------

    async def _stream(self, ctx: RequestContext, upstream: TransportResponse, send: Send) -> None:
        assert ctx.body is not None and ctx.thinking is not None
        options = ctx.body.get("stream_options")
        want_usage = isinstance(options, dict) and options.get("include_usage") is True
        go_on = continues(ctx.body, ctx.thinking)
        _, head = response_head(upstream, _backend(ctx), ctx.reason)
        ctx.responded = True
        await send(head)
        phase = _Phase()
        async for chunk in _chunks(ctx, upstream):
            ctx.first_byte_at = ctx.first_byte_at or time.monotonic()
            if not phase.envelope:
                phase.envelope = {k: chunk.get(k) for k in ("id", "object", "created", "model")}
            if _take_usage(chunk, phase):
                continue
            choice = chunk["choices"][0]
            delta = choice.get("delta") or {}
            _accumulate(phase, delta)
            phase.finish = choice.get("finish_reason") or phase.finish
            if phase.finish == "length" and go_on:  # our cut, not the client's: phase 2 goes on with the turn
                if not delta:
                    continue
                choice["finish_reason"] = None
            choice["delta"] = normalise(delta, self.cfg.reasoning_fields)
            await _emit(send, chunk)
        if phase.finish != "length" or not go_on:
            self._count(ctx, phase, truncated=False)
            await self._end(ctx, send, phase.usage if want_usage else None, phase.envelope)
            return
        second = await self._phase2(ctx, upstream, phase, stream=True)
        if second.status != 200:
            raise UpstreamError(f"backend {_backend(ctx)} refused the continuation ({second.status})")
        tail = _Phase()
        async for chunk in _chunks(ctx, second):
            if _take_usage(chunk, tail):
                continue
            choice = chunk["choices"][0]
            delta = choice.get("delta") or {}
            text = (reasoning_of(delta) or "") + (delta.get("content") or "")
            finish = choice.get("finish_reason")
            if not text and not finish:
                continue  # phase 2's role chunk: the client already had one
            choice["delta"] = {"content": text} if text else {}
            await _emit(send, {**chunk, **phase.envelope})
        self._count(ctx, phase, truncated=True)
        usage = _usage(phase.usage, tail.usage) if want_usage else None
        await self._end(ctx, send, usage, phase.envelope)

    async def _end(
        self, ctx: RequestContext, send: Send, usage: dict[str, Any] | None, envelope: dict[str, Any]
    ) -> None:
        ctx.finishing = True
        tail = DONE
        if usage is not None:
            tail = b"data: " + canonical_json({**envelope, "choices": [], "usage": usage}) + b"\n\n" + DONE
        await send(body(tail, more=False))
        ctx.outcome = RequestOutcome.OK

    # -- phase 2 ------------------------------------------------------------------------------------------

    async def _phase2(
        self, ctx: RequestContext, first: TransportResponse, phase: _Phase, *, stream: bool
    ) -> TransportResponse:
        """Close phase 1 (the engine stops), then send the continuation to the same backend."""
        assert ctx.body is not None and ctx.lease is not None
        await first.aclose()
        ctx.upstream = None
        backend = ctx.lease.backend
        phase2 = self.phase2_body(ctx.body, phase, stream=stream, dialect=backend.cfg.dialect)
        payload = canonical_json(phase2)
        forward = ctx.client is None or backend.cfg.forward_client_key
        headers = upstream_headers(ctx.headers, backend.cfg.api_key, forward)
        watch = first.watch if isinstance(first, _Timed) else None
        if watch is not None:
            watch.sending = True  # waiting for the head is timed by first_byte_s, as on a first attempt
        async with asyncio.timeout(self.timeouts.first_byte_s):
            response = await self.transport.request("POST", backend.cfg.url, ctx.path, headers, payload)
        ctx.upstream = response  # closed by Proxy._finish: a disconnect now stops phase 2
        if watch is None:
            return response
        watch.chunk_sent()
        return _Timed(response, watch)

    def phase2_body(
        self, original: dict[str, Any], phase: _Phase, *, stream: bool, dialect: Dialect = Dialect.OPENAI
    ) -> dict[str, Any]:
        out = {k: v for k, v in original.items() if k not in ("thinking_budget", "reasoning_effort")}
        reasoning, content = "".join(phase.reasoning), "".join(phase.content)
        prefix = self.cfg.open_marker + reasoning
        prefix += self.cfg.close_marker + content if content else self.cfg.early_stop
        out["messages"] = [*original["messages"], {"role": "assistant", "content": prefix}]
        out.update(DIALECTS[dialect].continuation)  # vLLM: continue_final_message, no generation prompt
        kwargs = original.get("chat_template_kwargs")
        out["chat_template_kwargs"] = {
            **(kwargs if isinstance(kwargs, dict) else {}),
            "enable_thinking": False,
        }
        name, limit = client_limit(original)
        if limit is not None:
            out[name] = max(1, limit - phase.completion_tokens())
        out["stream"] = stream
        if stream:
            options = original.get("stream_options")
            out["stream_options"] = {**(options if isinstance(options, dict) else {}), "include_usage": True}
        return out

    # -- accounting and failure ---------------------------------------------------------------------------

    def _count(self, ctx: RequestContext, phase: _Phase, *, truncated: bool) -> None:
        tokens = (
            phase.completion_tokens() if truncated and not "".join(phase.content) else len(phase.reasoning)
        )
        self.metrics.thinking(truncated=truncated, reasoning_tokens=tokens)

    async def _failed(self, ctx: RequestContext, send: Send, err: UpstreamError) -> None:
        ctx.outcome = RequestOutcome.MID_STREAM_ERROR if ctx.responded else RequestOutcome.UPSTREAM_ERROR
        ctx.finishing = True
        if not ctx.responded:
            ctx.responded = True
            await send_error(send, err)
        elif ctx.body is not None and ctx.body.get("stream") is True:
            await send(sse_error(err))
        # a non-streamed body whose head is gone: returning unfinished makes the server close the connection


class _Timed:
    """A response whose every chunk tells the silence watch the engine is alive."""

    __slots__ = ("inner", "watch")

    def __init__(self, inner: TransportResponse, watch: SilenceWatch) -> None:
        self.inner = inner
        self.watch = watch

    @property
    def status(self) -> int:
        return self.inner.status

    @property
    def headers(self) -> Sequence[tuple[bytes, bytes]]:
        return self.inner.headers

    def header(self, name: bytes) -> bytes | None:
        return self.inner.header(name)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner.aiter_raw():
            self.watch.chunk_sent()
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


def _backend(ctx: RequestContext) -> str:
    return "" if ctx.lease is None else ctx.lease.backend.id


def _accumulate(phase: _Phase, delta: dict[str, Any]) -> None:
    text = reasoning_of(delta)
    if text:
        phase.reasoning.append(text)
    content = delta.get("content")
    if isinstance(content, str) and content:
        phase.content.append(content)


def _take_usage(chunk: dict[str, Any], phase: _Phase) -> bool:
    """Record a chunk's usage; True for the usage-only chunk (no choices), which is never relayed as is."""
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        phase.usage = usage
        chunk.pop("usage")
    return not chunk.get("choices")


def _usage(first: dict[str, Any] | None, second: dict[str, Any] | None) -> dict[str, Any]:
    prompt = int((first or {}).get("prompt_tokens", 0))
    completion = int((first or {}).get("completion_tokens", 0)) + int(
        (second or {}).get("completion_tokens", 0)
    )
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _emit(send: Send, chunk: dict[str, Any]) -> None:
    await send(body(b"data: " + canonical_json(chunk) + b"\n\n", more=True))


async def _read(ctx: RequestContext, response: TransportResponse) -> bytes:
    return await read_reply(response.aiter_raw(), MAX_REPLY_BYTES, _backend(ctx))


async def _chunks(ctx: RequestContext, response: TransportResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of an SSE stream, up to ``[DONE]``."""
    splitter = EventSplitter()
    async for raw in response.aiter_raw():
        for piece in splitter.feed(raw):
            if isinstance(piece, Overflow):
                raise UpstreamReplyTooLarge(
                    f"backend {_backend(ctx)} sent an event larger than {splitter.max_event} bytes"
                )
            data = piece.data()
            if data is None:
                continue  # a comment, or bytes between events
            if data.strip() == b"[DONE]":
                return
            yield json.loads(data)
