"""One streamed chat completion, timed the way the routing benchmark needs it.

TTFT is the time from sending the request to the first chunk that carries text (content or reasoning): the
empty role chunk some engines send first does not count. Decode time runs from that chunk to the last one
with text, so per-stream decode speed is (tokens - 1) / decode time. Usage (prompt, cached and completion
tokens) comes from the final usage chunk (``stream_options.include_usage``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

BACKEND_HEADER = "x-warmroute-backend"
ROUTE_HEADER = "x-warmroute-route"


@dataclass(slots=True)
class StreamResult:
    """What one streamed request did. Times are seconds; ``error`` is None on success."""

    ttft_s: float | None = None
    decode_s: float | None = None
    e2e_s: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    backend: str | None = None
    route: str | None = None
    finish_reason: str | None = None
    error: str | None = None
    reply: str = field(default="", repr=False)

    @property
    def decode_tps(self) -> float | None:
        """Per-stream decode speed: tokens after the first, over the time between first and last token."""
        if self.decode_s is None or self.decode_s <= 0 or self.completion_tokens < 2:
            return None
        return (self.completion_tokens - 1) / self.decode_s


@dataclass(slots=True)
class _Progress:
    started: float
    first_at: float | None = None
    last_at: float | None = None
    text_chunks: int = 0
    reply: list[str] = field(default_factory=list)


def chat_body(model: str, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def stream_chat(
    client: httpx.AsyncClient,
    base_url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str] | None = None,
) -> StreamResult:
    """POST ``body`` to ``{base_url}/v1/chat/completions`` and read the SSE stream to the end."""
    result = StreamResult()
    progress = _Progress(time.perf_counter())
    try:
        async with client.stream(
            "POST", f"{base_url}/v1/chat/completions", json=body, headers=headers
        ) as response:
            result.backend = response.headers.get(BACKEND_HEADER)
            result.route = response.headers.get(ROUTE_HEADER)
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {text[:200]}"
            else:
                await _read_events(response, result, progress)
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"[:200]
    _finish(result, progress)
    return result


async def _read_events(response: httpx.Response, result: StreamResult, progress: _Progress) -> None:
    event = "message"
    done = False
    async for line in response.aiter_lines():
        if done:
            # The body is read to its end, as the openai SDK does after [DONE] on HTTP/1.1. Hanging up at
            # [DONE], before the server ends the response, is a client leaving mid-answer to a gateway that
            # has not read its engine's end yet: it then counts a disconnect and learns nothing of the turn
            # (a first reply unrecorded, so the next turn loses its hint), about 1 request in 450.
            continue
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                done = True  # still check below that some text came: an empty answer has no TTFT
                continue
            if event == "error":
                result.error = f"error event: {data[:200]}"
                return
            _apply_chunk(json.loads(data), result, progress)
            event = "message"
    if result.error is None and progress.first_at is None:
        result.error = "stream ended without any text"


def _apply_chunk(chunk: dict[str, Any], result: StreamResult, progress: _Progress) -> None:
    if "error" in chunk:
        result.error = f"error chunk: {json.dumps(chunk['error'])[:200]}"
        return
    usage = chunk.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.completion_tokens = usage.get("completion_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = details.get("cached_tokens")
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        content = delta.get("content")
        thought = delta.get("reasoning_content") or delta.get("reasoning")
        if content or thought:
            now = time.perf_counter()
            if progress.first_at is None:
                progress.first_at = now
            progress.last_at = now
            progress.text_chunks += 1
        if content:
            progress.reply.append(content)
        if choice.get("finish_reason"):
            result.finish_reason = choice["finish_reason"]


def _finish(result: StreamResult, progress: _Progress) -> None:
    result.e2e_s = time.perf_counter() - progress.started
    if progress.first_at is not None:
        result.ttft_s = progress.first_at - progress.started
        result.decode_s = (progress.last_at or progress.first_at) - progress.first_at
    if not result.completion_tokens:
        result.completion_tokens = progress.text_chunks  # no usage chunk: one token per text chunk
    result.reply = "".join(progress.reply)
