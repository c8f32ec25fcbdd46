"""Reasoning output in the field(s) the client expects: vLLM writes ``reasoning``, SGLang, llama.cpp and older
vLLM ``reasoning_content``; either is read, and what ``thinking.reasoning_fields`` names is written."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.types import Message

from backends.dialects import REASONING_FIELDS
from config.settings import ReasoningFields
from gateway.context import RequestContext, canonical_json
from gateway.relay import MAX_REPLY_BYTES, Rewrite, read_reply, reply_too_large
from gateway.sse import MAX_EVENT_BYTES, Event, EventSplitter

CHAT_PATH = "/v1/chat/completions"

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
    """Rewrites relayed chat responses so reasoning arrives in the configured field(s).

    Streams are rewritten event by event (``gateway.sse``: any SSE line ends, a bounded hold), and only
    events that mention reasoning are parsed: the others, and events too large to hold, pass as the engine's
    own bytes. A non-streamed body is one JSON document: it is read whole, up to ``max_reply_bytes`` (more is
    refused with a 502, never held), its head held back with it (so that refusal is a proper error response)
    and its content-length dropped, since the rewritten body may differ in size.
    """

    def __init__(
        self,
        fields: ReasoningFields,
        thinks: Callable[[str | None], bool],
        *,
        max_reply_bytes: int = MAX_REPLY_BYTES,
        max_event_bytes: int = MAX_EVENT_BYTES,
    ) -> None:
        self.fields = fields
        self.thinks = thinks
        self.max_reply_bytes = max_reply_bytes
        self.max_event_bytes = max_event_bytes

    def wrap(self, ctx: RequestContext, sse: bool, head: Message, chunks: AsyncIterator[bytes]) -> Rewrite:
        """What to relay instead; ``UpstreamReplyTooLarge`` when the head says the body is too large."""
        if ctx.body is None or not ctx.path.startswith(CHAT_PATH) or not self.thinks(ctx.model):
            return Rewrite(head, chunks)
        if sse:
            return Rewrite(head, self._stream(chunks))
        backend = "" if ctx.lease is None else ctx.lease.backend.id
        headers = []
        for name, value in head["headers"]:
            if name != b"content-length":
                headers.append((name, value))
            elif value.isdigit() and int(value) > self.max_reply_bytes:  # refused before reading any of it
                raise reply_too_large(backend, self.max_reply_bytes)
        return Rewrite({**head, "headers": headers}, self._whole(chunks, backend), whole=True)

    async def _whole(self, chunks: AsyncIterator[bytes], backend: str) -> AsyncIterator[bytes]:
        raw = await read_reply(chunks, self.max_reply_bytes, backend)
        if b"reasoning" not in raw:
            yield raw  # nothing to rewrite: the engine's own bytes
            return
        try:
            doc = json.loads(raw)
            for choice in doc["choices"]:
                choice["message"] = normalise(choice["message"], self.fields)
        except (ValueError, KeyError, TypeError):
            yield raw  # not the shape we know: the engine's own bytes
            return
        yield canonical_json(doc)

    async def _stream(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        splitter = EventSplitter(self.max_event_bytes)
        async for raw in chunks:
            if b"reasoning" not in raw and splitter.whole(raw):
                yield raw  # whole events without reasoning: as they came
                continue
            pieces = splitter.feed(raw)
            if pieces:
                yield b"".join(self._event(p) if isinstance(p, Event) else p.raw for p in pieces)
        rest = splitter.close()
        if rest:
            yield rest  # an event the engine never ended: as it came

    def _event(self, event: Event) -> bytes:
        if b"reasoning" not in event.raw:
            return event.raw
        lines = event.lines()
        if len(lines) != 1 or not lines[0].startswith(b"data:"):
            return event.raw  # several lines, or no data: not a chunk of ours to rewrite
        try:
            doc = json.loads(lines[0][5:])
            for choice in doc.get("choices") or ():
                choice["delta"] = normalise(choice.get("delta") or {}, self.fields)
        except (ValueError, AttributeError, TypeError):
            return event.raw
        newline = event.newline()  # the engine's own framing, so a client reading its way still can
        return b"data: " + canonical_json(doc) + newline + newline
