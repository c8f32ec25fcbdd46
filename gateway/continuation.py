"""The gateway-enforced thinking budget: two generations on the same backend, one response for the client.

Phase 1 is the client's request with its token limit lowered to the budget, so the engine itself stops there
and reports exact usage (how reasoning tokens are counted: the engine's ``usage.completion_tokens``; every
phase-1 token is reasoning while no answer has started). If it stops for that limit, phase 2 continues the
same assistant turn on the same backend (its prefix cache holds prompt and reasoning): the reasoning so far
plus the early-stop phrase (which closes the thought) as an assistant prefix,
``continue_final_message: true``, ``add_generation_prompt: false``, thinking off. If the answer had already
begun, phase 2 continues the answer. Whatever phase 2 emits is answer: reasoning-labelled deltas
are relabelled as content.

A body filter of the one relay (gateway/relay.py's ``Relay``): phase 2 is its follow-up exchange on the same
lease, so the output guard, the observation tap (tokens, TTFT, learning), first-byte and prefill accounting
see both phases like any answer. The client gets one response or one stream: phase 1's id, reasoning then
content, phase 2's finish reason, usage with the prompt counted once (phase 1's, its
``prompt_tokens_details`` kept) and the completion tokens of both phases.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from backends.dialects import DIALECTS
from config.settings import Dialect, ThinkingConfig
from gateway.context import Attempt, RequestContext, canonical_json
from gateway.errors import BadRequest, UpstreamError, UpstreamReplyTooLarge
from gateway.metrics import Metrics
from gateway.observe import Usage
from gateway.phases import BodyFilter, BodyFilterBase
from gateway.reasoning import normalise, reasoning_of, write_reasoning
from gateway.relay import DONE
from gateway.sse import Event, Overflow, Piece, Pieces
from gateway.thinking import Thinking

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
    """The module: a stitching filter for each attempt with a gateway-enforced budget (``Draft.enforced``)."""

    def __init__(self, cfg: ThinkingConfig, metrics: Metrics) -> None:
        self.cfg = cfg
        self.metrics = metrics

    def body_filter(self, ctx: RequestContext, attempt: Attempt, status: int, sse: bool) -> BodyFilter | None:
        if attempt.translated is not None:
            return None  # stitched as chat inside the translation's filter (``stitch``)
        if attempt.draft.enforced is None:
            return None  # the common attempt: no budget enforced here, nothing to stitch
        return self.stitch(ctx, attempt, status)

    def stitch(self, ctx: RequestContext, attempt: Attempt, status: int) -> BodyFilter | None:
        """The stitching filter of an enforced attempt, over chat answers: the client's chat body, or a
        translated attempt's own chat body (``Draft.phase1_source``), is what phase 2 continues."""
        thinking = attempt.draft.enforced
        original = attempt.draft.phase1_source or ctx.body
        if thinking is None or status != 200 or original is None:
            return None
        return _Stitch(self, original, thinking, attempt, stream=original.get("stream") is True)

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


class _Stitch(BodyFilterBase):
    """One enforced attempt: phase 1 relayed with our cut hidden, phase 2 (the follow-up) as answer."""

    rewrites = True

    def __init__(
        self,
        owner: Continuation,
        original: dict[str, Any],
        thinking: Thinking,
        attempt: Attempt,
        *,
        stream: bool,
    ) -> None:
        self.owner, self.original, self.attempt, self.stream = owner, original, attempt, stream
        self.holds = not stream
        self.go_on = continues(original, thinking)
        options = original.get("stream_options")
        self.want_usage = isinstance(options, dict) and options.get("include_usage") is True
        self.phase, self.tail = _Phase(), _Phase()
        self.second = self.done = False
        self.first_doc: dict[str, Any] | None = None  # a non-streamed phase 1, completed by phase 2

    @property
    def backend(self) -> str:
        return self.attempt.backend.id

    # -- streamed ---------------------------------------------------------------------------------------

    def events(self, pieces: Pieces) -> Pieces:
        out: list[Piece] = []
        for piece in pieces:  # a ``Whole`` read's events too
            if isinstance(piece, Overflow):
                raise UpstreamReplyTooLarge(f"backend {self.backend} sent an event too large to hold")
            data = piece.data() if isinstance(piece, Event) else None
            if data is None or self.done:
                continue  # a comment, bytes between events, an event never ended, anything after [DONE]
            if data.strip() == b"[DONE]":
                self.done = True
                continue
            chunk = self._parsed(data)
            try:
                emitted = self._phase2_chunk(chunk) if self.second else self._phase1_chunk(chunk)
            except (KeyError, IndexError, TypeError, AttributeError) as exc:
                raise self._broken(exc) from None
            if emitted is not None:
                out.append(Event(b"data: " + canonical_json(emitted) + b"\n\n"))
        return out

    def _phase1_chunk(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        phase = self.phase
        if not phase.envelope:
            phase.envelope = {k: chunk.get(k) for k in ("id", "object", "created", "model")}
        if _take_usage(chunk, phase):
            return None
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        _accumulate(phase, delta)
        phase.finish = choice.get("finish_reason") or phase.finish
        if (
            phase.finish == "length" and self.go_on
        ):  # our cut, not the client's: phase 2 goes on with the turn
            if not delta:
                return None
            choice["finish_reason"] = None
        choice["delta"] = normalise(delta, self.owner.cfg.reasoning_fields)
        return chunk

    def _phase2_chunk(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        if _take_usage(chunk, self.tail):
            return None
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        text = (reasoning_of(delta) or "") + (delta.get("content") or "")
        finish = choice.get("finish_reason")
        if not text and not finish:
            return None  # phase 2's role chunk: the client already had one
        choice["delta"] = {"content": text} if text else {}
        return {**chunk, **self.phase.envelope}

    def end(self) -> list[Piece]:
        if not self.stream:
            return []
        truncated = self.second
        usage = _usage(self.phase.usage, self.tail.usage) if truncated else self.phase.usage
        self._count(truncated=truncated, usage=usage)
        if not self.want_usage or usage is None:
            return [Event(DONE)]
        doc = {**self.phase.envelope, "choices": [], "usage": usage}
        return [Event(b"data: " + canonical_json(doc) + b"\n\n"), Event(DONE)]

    # -- non-streamed -----------------------------------------------------------------------------------

    def body(self, data: bytes) -> bytes:
        if self.second:
            return self._stitched(self._parsed(data))
        first = self._parsed(data)
        try:
            choice = first["choices"][0]
            message = choice["message"]
            self.phase = _Phase(
                reasoning=[reasoning_of(message) or ""], content=[message.get("content") or ""]
            )
            self.phase.usage = first.get("usage")
            self.phase.finish = choice.get("finish_reason")
            if self.phase.finish != "length" or not self.go_on:
                choice["message"] = normalise(message, self.owner.cfg.reasoning_fields)
                self._count(truncated=False, usage=self.phase.usage)
                return canonical_json(first)
        except (KeyError, IndexError, TypeError) as exc:
            raise self._broken(exc) from None
        self.first_doc = first
        return b""  # held: phase 2 completes it

    def _stitched(self, second: dict[str, Any]) -> bytes:
        first = self.first_doc
        assert first is not None
        try:
            choice, choice2 = first["choices"][0], second["choices"][0]
            answer = (reasoning_of(choice2["message"]) or "") + (choice2["message"].get("content") or "")
            out_message = dict(choice["message"])
            reasoning = "".join(self.phase.reasoning) or None
            write_reasoning(out_message, reasoning, self.owner.cfg.reasoning_fields)
            out_message["content"] = "".join(self.phase.content) + answer
            choice["message"] = out_message
            choice["finish_reason"] = choice2.get("finish_reason")
        except (KeyError, IndexError, TypeError) as exc:
            raise self._broken(exc) from None
        first["usage"] = _usage(self.phase.usage, second.get("usage"))
        self._count(truncated=True, usage=first["usage"])
        return canonical_json(first)

    # -- the follow-up ----------------------------------------------------------------------------------

    def follow_up(self) -> dict[str, Any] | None:
        if self.second:
            return None
        if self.stream and (self.phase.finish != "length" or not self.go_on):
            return None
        if not self.stream and self.first_doc is None:
            return None
        dialect = self.attempt.backend.cfg.dialect
        return self.owner.phase2_body(self.original, self.phase, stream=self.stream, dialect=dialect)

    def continued(self) -> None:
        self.second, self.done = True, False

    # -- accounting -------------------------------------------------------------------------------------

    def _count(self, *, truncated: bool, usage: dict[str, Any] | None) -> None:
        phase = self.phase
        tokens = (
            phase.completion_tokens() if truncated and not "".join(phase.content) else len(phase.reasoning)
        )
        self.owner.metrics.thinking(truncated=truncated, reasoning_tokens=tokens)
        self.attempt.usage = _as_usage(usage)  # what the observers learn from, asked for or not

    def _parsed(self, data: bytes) -> dict[str, Any]:
        try:
            doc = json.loads(data)
        except ValueError as exc:
            raise self._broken(exc) from None
        if not isinstance(doc, dict):
            raise self._broken(TypeError())
        return doc

    def _broken(self, exc: Exception) -> UpstreamError:
        return UpstreamError(
            f"backend {self.backend} failed during a budgeted generation: {type(exc).__name__}"
        )


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
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    details = (first or {}).get("prompt_tokens_details")
    if isinstance(details, dict):
        out["prompt_tokens_details"] = details  # the prompt is phase 1's: so is what of it was cached
    return out


def _as_usage(usage: dict[str, Any] | None) -> Usage | None:
    if usage is None:
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt, completion, cached if isinstance(cached, int) else None)
