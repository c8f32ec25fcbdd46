"""What the gateway saw of one answered request, handed to observers when the request is finished.

The proxy's relay feeds every upstream chunk to a ``ResponseTap`` (cheap: it keeps a bounded tail and
counts SSE events); ``finish`` turns it into one ``Observation`` and gives it to each ``Observer``
(metrics: tokens and TTFT; routing: learned engine speed). Observers are synchronous and do no I/O: they
run in the relay's ``finally`` on the event loop.

``usage`` is what the engine reported (the last ``"usage"`` object of the body or stream), ``None`` when it
reported none (a stream without ``stream_options.include_usage``, an error body, a broken stream).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.outcomes import RequestOutcome
from routing.types import Reason

# The usage object sits in the last few hundred bytes of a body or stream (vLLM, SGLang and llama.cpp put it
# in the final chunk); 4 KiB is room for it plus a trailing `[DONE]` and a long finish chunk.
_TAIL_BYTES = 4096
_USAGE = b'"usage"'
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, when the engine reports it


@dataclass(frozen=True, slots=True)
class Observation:
    backend: str
    model: str | None
    key: str  # the conversation key
    reason: Reason  # why this backend was chosen
    outcome: RequestOutcome
    status: int  # the engine's HTTP status (0: no response)
    streamed: bool
    duration_s: float  # request start (gateway) to the end of the relay
    first_byte_s: float | None  # request start to the engine's first body byte
    events: int  # SSE ``data:`` events relayed (about one per token for a streamed chat)
    body_bytes: int  # bytes relayed
    usage: Usage | None


class Observer(Protocol):
    def observe(self, obs: Observation) -> None: ...


class ResponseTap:
    """Fed each relayed chunk; remembers a bounded tail and counts SSE events. O(chunk) in C per feed."""

    __slots__ = ("_tail", "body_bytes", "events")

    def __init__(self) -> None:
        self._tail = b""
        self.events = 0
        self.body_bytes = 0

    def feed(self, chunk: bytes) -> None:
        self.body_bytes += len(chunk)
        self.events += chunk.count(b"data: ")
        tail = self._tail + chunk
        self._tail = tail[-_TAIL_BYTES:] if len(tail) > _TAIL_BYTES else tail

    def usage(self) -> Usage | None:
        return parse_usage(self._tail)


def parse_usage(tail: bytes) -> Usage | None:
    """The last well-formed ``"usage": {...}`` object in ``tail``, or None (null, absent, cut off, odd)."""
    at = tail.rfind(_USAGE)
    while at >= 0:
        usage = _usage_at(tail, at + len(_USAGE))
        if usage is not None:
            return usage
        at = tail.rfind(_USAGE, 0, at)
    return None


def _usage_at(tail: bytes, at: int) -> Usage | None:
    text = tail[at : at + _TAIL_BYTES].decode("utf-8", "replace").lstrip()
    if not text.startswith(":"):
        return None
    try:
        value, _ = _DECODER.raw_decode(text[1:].lstrip())
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None  # "usage": null in every chunk but the last one
    prompt, completion = _count(value, "prompt_tokens"), _count(value, "completion_tokens")
    if prompt is None or completion is None:
        return None
    details = value.get("prompt_tokens_details")
    cached = _count(details, "cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt, completion, cached)


def _count(obj: dict[str, Any], name: str) -> int | None:
    value = obj.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None
