"""Anthropic Messages on the simulator (``/v1/messages``, ``/v1/messages/count_tokens``), as vLLM serves it.

The request is rendered through the chat template (system, then tools, then the messages in order), so turns
of one session extend the previous turn's prompt and hit the prefix cache exactly as chat does. A system block
starting ``x-anthropic-billing-header`` is dropped before templating (vLLM does), unless the engine keeps it
(``keep_billing_block``, as llama.cpp does): then the prompt changes from its first tokens on every request.

Usage follows vLLM: ``input_tokens`` = prompt - cache read - cache creation; ``message_start`` carries the
prompt total and no cache fields, the final ``message_delta`` (and the JSON Message) carry all four.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from backends.sim.config import SimConfig
from backends.sim.engine import RequestUsage
from backends.sim.protocol import (
    Endpoint,
    SimRequest,
    bad_request,
    chat_prompt,
    context_tokens,
    json_object,
    model_of,
    optional_bool,
    optional_int,
)
from backends.sim.text import FinishReason, OutputPlan, OutputSpec, PieceKind
from backends.sim.tokens import tokenize

BILLING_PREFIX = "x-anthropic-billing-header"
THINKING_TYPES = frozenset({"enabled", "disabled", "adaptive"})
STOP_REASONS = {FinishReason.STOP: "end_turn", FinishReason.LENGTH: "max_tokens"}


# -- request ------------------------------------------------------------------------------------------------


def _system_text(system: Any, keep_billing: bool) -> str | None:
    if system is None or isinstance(system, str):
        return system or None
    if not isinstance(system, list):
        raise bad_request("'system' must be a string or a list of text blocks")
    texts = []
    for block in system:
        if (
            not isinstance(block, Mapping)
            or block.get("type") != "text"
            or not isinstance(block.get("text"), str)
        ):
            raise bad_request("each 'system' block must be {'type': 'text', 'text': <string>}")
        if keep_billing or not block["text"].startswith(BILLING_PREFIX):
            texts.append(block["text"])
    return "\n".join(texts) or None


def _tool_result_text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "\n".join(str(b.get("text", "")) for b in content if isinstance(b, Mapping))
    raise bad_request("'tool_result' content must be a string or a list of blocks")


def _image_part(block: Mapping[str, Any]) -> dict[str, Any]:
    source = block.get("source")
    if not isinstance(source, Mapping):
        raise bad_request("an 'image' block needs a 'source' object")
    url = (
        source.get("url")
        if source.get("type") == "url"
        else f"data:{source.get('media_type')};{source.get('data')}"
    )
    return {"type": "image_url", "image_url": {"url": url}}


def _message(message: Any) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (tool results become ``tool`` messages, as vLLM does)."""
    if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
        raise bad_request("each message needs 'role' 'user' or 'assistant'")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request("message 'content' must be a string or a list of blocks")
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, Mapping) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image_part(block))
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input", {}), sort_keys=True)
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block.get("name"), "arguments": arguments}})  # fmt: skip
        elif kind == "tool_result":
            results.append({"role": "tool", "content": _tool_result_text(block.get("content"))})
        elif kind not in ("thinking", "redacted_thinking"):
            raise bad_request(f"unsupported content block type {kind!r}")
    out = results
    if parts or calls:
        out = [*results, {"role": role, "content": parts, **({"tool_calls": calls} if calls else {})}]
    return out


def chat_messages(body: Mapping[str, Any], cfg: SimConfig) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list")
    system = _system_text(body.get("system"), cfg.keep_billing_block)
    out = [{"role": "system", "content": system}] if system else []
    for message in messages:
        out.extend(_message(message))
    return out


def _thinking(body: Mapping[str, Any], cfg: SimConfig) -> tuple[bool, int | None]:
    thinking = body.get("thinking")
    if thinking is None:
        return cfg.reasoning, None
    if not isinstance(thinking, Mapping) or thinking.get("type") not in THINKING_TYPES:
        raise bad_request(f"'thinking.type' must be one of {sorted(THINKING_TYPES)}")
    if thinking["type"] == "disabled":
        return False, None
    return True, optional_int(thinking, "budget_tokens", 0)


def render_prompt(body: Mapping[str, Any], cfg: SimConfig) -> str:
    return chat_prompt(chat_messages(body, cfg), body)


def parse_messages(raw: bytes, cfg: SimConfig) -> SimRequest:
    body = json_object(raw)
    model = model_of(body, cfg)
    max_tokens = optional_int(body, "max_tokens", 1)
    if max_tokens is None:
        raise bad_request("'max_tokens' is required")
    prompt_text = render_prompt(body, cfg)
    prompt_tokens = context_tokens(prompt_text, max_tokens, cfg)
    thinking, budget = _thinking(body, cfg)
    spec = OutputSpec(max_tokens=max_tokens, thinking=thinking, thinking_budget=budget)
    stream = optional_bool(body, "stream") or False
    return SimRequest(Endpoint.MESSAGES, model, prompt_text, prompt_tokens, stream, True, spec)


def count_tokens(raw: bytes, cfg: SimConfig) -> dict[str, Any]:
    body = json_object(raw)
    model_of(body, cfg)
    n = len(tokenize(render_prompt(body, cfg)))
    return {"input_tokens": n, "context_management": {"original_input_tokens": n}}


# -- response -----------------------------------------------------------------------------------------------


def usage_body(usage: RequestUsage) -> dict[str, Any]:
    uncached = usage.prompt_tokens - usage.cached_tokens - usage.created_tokens
    return {
        "input_tokens": max(0, uncached),
        "output_tokens": usage.completion_tokens,
        "cache_read_input_tokens": usage.cached_tokens,
        "cache_creation_input_tokens": usage.created_tokens,
    }


def message_body(message_id: str, req: SimRequest, plan: OutputPlan, usage: RequestUsage) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if plan.reasoning:
        content.append(
            {"type": "thinking", "thinking": plan.reasoning_text, "signature": f"sig-{message_id}"}
        )
    if plan.answer:
        content.append({"type": "text", "text": plan.answer_text})
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": req.model,
        "stop_reason": STOP_REASONS[plan.finish_reason],
        "stop_sequence": None,
        "usage": usage_body(usage),
    }


def event(name: str, payload: Mapping[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


@dataclass(slots=True)
class _Blocks:
    """The content block being streamed: its index and kind (None before the first)."""

    index: int = -1
    kind: PieceKind | None = None

    def switch(self, kind: PieceKind) -> list[bytes]:
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        block = {"type": "thinking", "thinking": "", "signature": ""} if kind is PieceKind.REASONING else {
            "type": "text", "text": ""}  # fmt: skip
        out.append(event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                 "content_block": block}))  # fmt: skip
        return out

    def close(self) -> list[bytes]:
        if self.kind is None:
            return []
        self.kind = None
        return [event("content_block_stop", {"type": "content_block_stop", "index": self.index})]


def _delta(index: int, kind: PieceKind, text: str) -> bytes:
    if kind is PieceKind.REASONING:
        delta = {"type": "thinking_delta", "thinking": text}
    else:
        delta = {"type": "text_delta", "text": text}
    return event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def _start(message_id: str, req: SimRequest, usage: RequestUsage) -> bytes:
    message: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": req.model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": 0},
    }
    return event("message_start", {"type": "message_start", "message": message})


async def stream_events(
    message_id: str,
    req: SimRequest,
    plan: OutputPlan,
    usage: RequestUsage,
    pieces: AsyncIterator[tuple[PieceKind, str]],
) -> AsyncIterator[bytes]:
    """The SSE body: message_start, content_block_start, ping, deltas, stops, message_delta, message_stop."""
    blocks = _Blocks()
    started = False
    async for kind, text in pieces:
        if not started:
            started = True
            yield _start(message_id, req, usage)
        if kind is not blocks.kind:
            for chunk in blocks.switch(kind):
                yield chunk
            if blocks.index == 0:
                yield event("ping", {"type": "ping"})
        yield _delta(blocks.index, kind, text)
    if not started:
        yield _start(message_id, req, usage)
    for chunk in blocks.close():
        yield chunk
    delta = {"stop_reason": STOP_REASONS[plan.finish_reason], "stop_sequence": None}
    yield event("message_delta", {"type": "message_delta", "delta": delta, "usage": usage_body(usage)})
    yield event("message_stop", {"type": "message_stop"})
