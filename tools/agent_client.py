"""One streamed ``/v1/messages`` or ``/v1/responses`` request, timed as ``tools.client`` times chat.

TTFT is the time to the first event that carries text (a ``text_delta``/``thinking_delta``, or
``response.output_text.delta``/``response.reasoning_text.delta``). Usage comes from the final
``message_delta`` (prompt = input + cache read + cache creation; cached = cache read) or
``response.completed`` (``input_tokens``, ``input_tokens_details.cached_tokens``). The engine that answered
is the gateway's ``x-warmroute-backend``, else the simulator's ``x-sim-name``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from tools.client import BACKEND_HEADER, ROUTE_HEADER, StreamResult

SIM_NAME_HEADER = "x-sim-name"
MESSAGES_PATH = "/v1/messages"
RESPONSES_PATH = "/v1/responses"
TEXT_EVENTS = frozenset(
    {"content_block_delta", "response.output_text.delta", "response.reasoning_text.delta"}
)


@dataclass(slots=True)
class AgentResult:
    result: StreamResult
    status: int | None = None
    response_id: str | None = None  # Responses: the id a follow-up chains on


@dataclass(slots=True)
class _Reading:
    started: float
    first_at: float | None = None
    last_at: float | None = None
    deltas: int = 0
    reply: list[str] = field(default_factory=list)


def _text(data: Mapping[str, Any]) -> tuple[str | None, bool]:
    """(reply text of this event, whether it carries any generated text)."""
    if data.get("type") == "content_block_delta":
        delta = data.get("delta") or {}
        if delta.get("type") == "text_delta":
            return str(delta.get("text", "")), True
        return None, delta.get("type") == "thinking_delta"
    if data.get("type") == "response.output_text.delta":
        return str(data.get("delta", "")), True
    return None, data.get("type") == "response.reasoning_text.delta"


def _usage(data: Mapping[str, Any], out: AgentResult) -> None:
    r = out.result
    kind = data.get("type")
    if kind == "message_delta" and isinstance(usage := data.get("usage"), Mapping):
        read = int(usage.get("cache_read_input_tokens") or 0)
        created = int(usage.get("cache_creation_input_tokens") or 0)
        r.prompt_tokens = int(usage.get("input_tokens") or 0) + read + created
        r.cached_tokens, r.completion_tokens = read, int(usage.get("output_tokens") or 0)
        r.finish_reason = (data.get("delta") or {}).get("stop_reason")
    elif kind in ("response.created", "response.completed"):
        response = data.get("response") or {}
        out.response_id = response.get("id") or out.response_id
        if kind == "response.completed" and isinstance(usage := response.get("usage"), Mapping):
            r.prompt_tokens = usage.get("input_tokens")
            r.cached_tokens = (usage.get("input_tokens_details") or {}).get("cached_tokens")
            r.completion_tokens = int(usage.get("output_tokens") or 0)
            r.finish_reason = response.get("status")
    elif kind in ("error", "response.failed"):
        r.error = f"error event: {json.dumps(data)[:200]}"


def _apply(data: Mapping[str, Any], out: AgentResult, reading: _Reading) -> None:
    if data.get("type") in TEXT_EVENTS:
        text, generated = _text(data)
        if generated:
            now = time.perf_counter()
            reading.first_at = reading.first_at or now
            reading.last_at = now
            reading.deltas += 1
        if text:
            reading.reply.append(text)
    else:
        _usage(data, out)


async def stream_agent(
    client: httpx.AsyncClient, base_url: str, path: str, body: Mapping[str, Any], headers: Mapping[str, str]
) -> AgentResult:
    """POST ``body`` to ``base_url + path`` and read the SSE stream to the end."""
    out = AgentResult(StreamResult())
    reading = _Reading(time.perf_counter())
    try:
        async with client.stream("POST", base_url + path, json=body, headers=dict(headers)) as response:
            out.status = response.status_code
            out.result.backend = response.headers.get(BACKEND_HEADER) or response.headers.get(SIM_NAME_HEADER)
            out.result.route = response.headers.get(ROUTE_HEADER)
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                out.result.error = f"HTTP {response.status_code}: {text[:200]}"
            else:
                async for line in response.aiter_lines():
                    if line.startswith("data:") and out.result.error is None:
                        _apply(json.loads(line[5:]), out, reading)
    except httpx.HTTPError as exc:
        out.result.error = f"{type(exc).__name__}: {exc}"[:200]
    except ValueError as exc:
        out.result.error = f"bad event: {exc}"[:200]
    r = out.result
    r.e2e_s = time.perf_counter() - reading.started
    if reading.first_at is not None:
        r.ttft_s = reading.first_at - reading.started
        r.decode_s = (reading.last_at or reading.first_at) - reading.first_at
    elif r.error is None:
        r.error = "stream ended without any text"
    r.reply = "".join(reading.reply)
    return out
