"""Reasoning output in the field(s) the client expects: vLLM writes ``reasoning``, SGLang, llama.cpp and older
vLLM ``reasoning_content``; either is read, and what ``thinking.reasoning_fields`` names is written."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from backends.dialects import REASONING_FIELDS
from config.settings import ReasoningFields
from gateway.context import Attempt, RequestContext, canonical_json
from gateway.phases import BodyFilter, BodyFilterBase
from gateway.shapes.base import ReasoningRewrite
from gateway.sse import Event, Piece, Pieces, Whole

FIELDS = REASONING_FIELDS  # every dialect's output fields (backends/dialects.py)


def reasoning_of(part: dict[str, Any]) -> str | None:
    """The reasoning text of one message or delta, whichever field the engine used."""
    for name in FIELDS:
        value = part.get(name)
        if isinstance(value, str):
            return value
    return None


def write_reasoning(part: dict[str, Any], text: str | None, fields: ReasoningFields) -> None:
    """Replace the reasoning fields of ``part`` (a message or delta dict of our own) with ``text``."""
    for name in FIELDS:
        part.pop(name, None)
    if text is None:
        return
    if fields is not ReasoningFields.REASONING_CONTENT:
        part["reasoning"] = text
    if fields is not ReasoningFields.REASONING:
        part["reasoning_content"] = text


def normalise(part: dict[str, Any], fields: ReasoningFields) -> dict[str, Any]:
    """A copy of ``part`` with its reasoning (if any) in the configured fields; ``part`` itself unchanged."""
    text = reasoning_of(part)
    if text is None:
        return part
    out = dict(part)
    write_reasoning(out, text, fields)
    return out


class ReasoningRelay:
    """Rewrites relayed responses so reasoning arrives in the configured field(s): a body filter, for the
    shapes whose answers carry reasoning (``ApiShape.reasoning`` says where: chat's choices).

    A stream is rewritten event by event (the relay's one splitter: any SSE line ends, a bounded hold), and
    only events that mention reasoning are parsed: the others, and events too large to hold, pass as the
    engine's own bytes. A non-streamed body is one JSON document: the relay holds it whole (bounded, its head
    held back with it, so a refusal is still a proper error response) and this rewrites it.
    """

    def __init__(self, fields: ReasoningFields, thinks: Callable[[str | None], bool]) -> None:
        self.fields = fields
        self.thinks = thinks
        # Its filters keep no state of a response: one per shape's rewriter and framing, made on first use
        # and shared (a filter object built per response cost ~4k instructions of the ~850k a request takes).
        self._filters: dict[tuple[ReasoningRewrite, bool], BodyFilter] = {}

    def body_filter(self, ctx: RequestContext, attempt: Attempt, status: int, sse: bool) -> BodyFilter | None:
        rewrite = ctx.shape.reasoning  # where the shape's answers keep reasoning (None: nowhere)
        if status != 200 or rewrite is None or ctx.body is None:
            return None
        if not self.thinks(ctx.model):
            return None
        f = self._filters.get((rewrite, sse))
        if f is None:
            f = _Events(self.fields, rewrite) if sse else _Whole(self.fields, rewrite)
            self._filters[rewrite, sse] = f
        return f


class _Events(BodyFilterBase):
    rewrites = True

    def __init__(self, fields: ReasoningFields, rewrite: ReasoningRewrite) -> None:
        self.fields = fields
        self.rewrite = rewrite

    def events(self, pieces: Pieces) -> Pieces:
        # ``find``, not ``in`` (gateway/sse.py says why)
        if type(pieces) is Whole:
            if pieces.raw.find(b"reasoning") < 0:
                return pieces  # the common read: whole events, nothing to rewrite (none cut)
            pieces = pieces.events()
        elif len(pieces) == 1 and pieces[0].raw.find(b"reasoning") < 0:
            return pieces
        return [
            self._event(p) if isinstance(p, Event) and p.raw.find(b"reasoning") >= 0 else p for p in pieces
        ]

    def _event(self, event: Event) -> Piece:
        lines = event.lines()
        if len(lines) != 1 or not lines[0].startswith(b"data:"):
            return event  # several lines, or no data: not a chunk of ours to rewrite
        try:
            doc = json.loads(lines[0][5:])
            self.rewrite(doc, self.fields, True)
        except (ValueError, AttributeError, LookupError, TypeError):
            return event
        newline = event.newline()  # the engine's own framing, so a client reading its way still can
        return Event(b"data: " + canonical_json(doc) + newline + newline)


class _Whole(BodyFilterBase):
    holds = rewrites = True

    def __init__(self, fields: ReasoningFields, rewrite: ReasoningRewrite) -> None:
        self.fields = fields
        self.rewrite = rewrite

    def body(self, data: bytes) -> bytes:
        if data.find(b"reasoning") < 0:  # not ``in`` (gateway/sse.py says why)
            return data  # nothing to rewrite: the engine's own bytes
        try:
            doc = json.loads(data)
            self.rewrite(doc, self.fields, False)
        except (ValueError, LookupError, TypeError):
            return data  # not the shape we know: the engine's own bytes
        return canonical_json(doc)
