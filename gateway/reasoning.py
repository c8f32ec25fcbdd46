"""Reasoning output in the field(s) the client expects: vLLM writes ``reasoning``, SGLang, llama.cpp and older
vLLM ``reasoning_content``; either is read, and what ``thinking.reasoning_fields`` names is written."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.types import Message

from config.settings import ReasoningFields
from gateway.context import RequestContext, canonical_json

CHAT_PATH = "/v1/chat/completions"

FIELDS = ("reasoning", "reasoning_content")


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

    Streams are rewritten event by event, and only events that mention reasoning are parsed: the others pass
    as the engine's own bytes. A non-streamed body is read whole (it is one JSON document) and its
    content-length dropped from the head, since the rewritten body may differ in size.
    """

    def __init__(self, fields: ReasoningFields, thinks: Callable[[str | None], bool]) -> None:
        self.fields = fields
        self.thinks = thinks

    def wrap(
        self, ctx: RequestContext, sse: bool, head: Message, chunks: AsyncIterator[bytes]
    ) -> tuple[Message, AsyncIterator[bytes]]:
        if ctx.body is None or not ctx.path.startswith(CHAT_PATH) or not self.thinks(ctx.model):
            return head, chunks
        if sse:
            return head, self._stream(chunks)
        headers = [(k, v) for k, v in head["headers"] if k != b"content-length"]
        return {**head, "headers": headers}, self._whole(chunks)

    async def _whole(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        raw = b"".join([c async for c in chunks])
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
        pending = b""
        async for raw in chunks:
            if not pending and raw.endswith(b"\n\n") and b"reasoning" not in raw:
                yield raw  # whole events without reasoning: as they came
                continue
            data = pending + raw
            cut = data.rfind(b"\n\n")
            if cut < 0:
                pending = data
                continue
            pending = data[cut + 2 :]
            yield b"".join(self._event(e) for e in data[: cut + 2].split(b"\n\n") if e)
        if pending:
            yield pending

    def _event(self, event: bytes) -> bytes:
        if b"reasoning" in event and event.startswith(b"data: ") and b"\n" not in event:
            try:
                doc = json.loads(event[6:])
                for choice in doc.get("choices") or ():
                    choice["delta"] = normalise(choice.get("delta") or {}, self.fields)
                event = b"data: " + canonical_json(doc)
            except (ValueError, AttributeError, TypeError):
                pass
        return event + b"\n\n"
