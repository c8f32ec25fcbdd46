"""OpenAI Responses on the simulator (``/v1/responses``), as vLLM serves it.

The prompt is the chat-template rendering of instructions (system), tools, then the conversation: with
``previous_response_id``, the stored conversation of that response (its input and its reply) followed by the
new input; otherwise the full ``input``. So a Codex-style session (full input every turn, ``store: false``)
and an SDK-style chain hit the prefix cache turn after turn, as chat does.

Streamed events carry ``sequence_number`` from 0: response.created, response.in_progress, then per output
item (reasoning first when the sim reasons, then the message) output_item.added, content_part.added, the
text deltas, *.done, content_part.done, output_item.done, and response.completed with usage (vLLM sends
response.completed for an incomplete response too, with ``status: "incomplete"``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from backends.sim.config import SimConfig
from backends.sim.engine import RequestUsage
from backends.sim.protocol import (
    REASONING_EFFORTS,
    Endpoint,
    SimError,
    SimRequest,
    bad_request,
    chat_prompt,
    context_tokens,
    json_object,
    model_of,
    optional_bool,
    optional_int,
)
from backends.sim.response_store import ResponseStore, StoredResponse
from backends.sim.text import FinishReason, OutputPlan, OutputSpec, PieceKind

TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal"})
MESSAGE_ROLES = frozenset({"user", "assistant", "system", "developer"})


def not_found(response_id: str) -> SimError:
    """vLLM's answer for an id this process does not hold (another engine's, or before a restart)."""
    return SimError(
        404, f"Response with id '{response_id}' not found.", 404, "invalid_request_error", "response_id"
    )


# -- request ------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    sim: SimRequest
    body: dict[str, Any]
    conversation: tuple[dict[str, Any], ...]  # chat messages after the instructions
    input_items: tuple[dict[str, Any], ...]
    store: bool


def _text_of(part: Mapping[str, Any]) -> dict[str, Any]:
    kind = part.get("type")
    if kind in TEXT_PARTS:
        text = part.get("text", part.get("refusal"))
        if not isinstance(text, str):
            raise bad_request(f"a '{kind}' part needs a string 'text'")
        return {"type": "text", "text": text}
    if kind == "input_image":
        return {"type": "image_url", "image_url": {"url": str(part.get("image_url") or part.get("file_id"))}}
    raise bad_request(f"unsupported content part type {kind!r}")


def _item_message(item: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = item.get("type", "message")
    if kind == "message":
        role, content = item.get("role"), item.get("content")
        if role not in MESSAGE_ROLES:
            raise bad_request(f"an input message needs 'role' in {sorted(MESSAGE_ROLES)}")
        if isinstance(content, list):
            content = [_text_of(p) if isinstance(p, Mapping) else _text_of({}) for p in content]
        elif not isinstance(content, str):
            raise bad_request("an input message's 'content' must be a string or a list of parts")
        return {"role": role, "content": content}
    if kind == "function_call":
        call = {"id": item.get("call_id"), "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")}}  # fmt: skip
        return {"role": "assistant", "content": None, "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        return {"role": "tool", "content": output if isinstance(output, str) else json.dumps(output)}
    if kind == "reasoning":
        return None  # not re-rendered: the template drops earlier turns' reasoning
    raise bad_request(f"unsupported input item type {kind!r}")


def input_items(value: Any, ids: Iterator[int]) -> tuple[dict[str, Any], ...]:
    """``input`` as items, each with an id (the shape ``GET /v1/responses/{id}/input_items`` lists)."""
    if isinstance(value, str):
        value = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": value}]}]
    if not isinstance(value, list) or not value:
        raise bad_request("'input' must be a string or a non-empty list of items")
    items = []
    for item in value:
        if not isinstance(item, Mapping):
            raise bad_request("each input item must be an object")
        item = {"type": "message", **item} if "role" in item and "type" not in item else dict(item)
        items.append({"id": item.get("id") or f"item_{next(ids)}", **item})
    return tuple(items)


def _thinking(body: Mapping[str, Any], cfg: SimConfig) -> bool:
    reasoning = body.get("reasoning")
    if reasoning is None:
        return cfg.reasoning
    if not isinstance(reasoning, Mapping):
        raise bad_request("'reasoning' must be an object")
    effort = reasoning.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(f"'reasoning.effort' must be one of {sorted(REASONING_EFFORTS)}, got {effort!r}")
    return effort != "none" if effort is not None else cfg.reasoning


def parse_responses(
    raw: bytes, cfg: SimConfig, store: ResponseStore | None, ids: Iterator[int]
) -> ResponsesRequest:
    body = json_object(raw)
    model = model_of(body, cfg)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string")
    previous: tuple[dict[str, Any], ...] = ()
    if (previous_id := body.get("previous_response_id")) is not None:
        stored = store.get(str(previous_id)) if store is not None else None
        if stored is None:
            raise not_found(str(previous_id))
        previous = stored.conversation
    items = input_items(body.get("input"), ids)
    conversation = (*previous, *(m for item in items if (m := _item_message(item)) is not None))
    system = [{"role": "system", "content": instructions}] if instructions else []
    prompt_text = chat_prompt([*system, *conversation], body)
    max_tokens = optional_int(body, "max_output_tokens", 1) or cfg.default_max_tokens
    prompt_tokens = context_tokens(prompt_text, max_tokens, cfg)
    spec = OutputSpec(max_tokens=max_tokens, thinking=_thinking(body, cfg))
    stream = optional_bool(body, "stream") or False
    keep = optional_bool(body, "store")
    sim = SimRequest(Endpoint.RESPONSES, model, prompt_text, prompt_tokens, stream, True, spec)
    return ResponsesRequest(sim, body, conversation, items, store is not None and keep is not False)


# -- response -----------------------------------------------------------------------------------------------


def usage_body(usage: RequestUsage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens,
            "cache_write_tokens": usage.created_tokens,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


@dataclass(slots=True)
class ResponseDraft:
    """One response being produced: ids fixed up front, text accumulated as it streams."""

    id: str
    created_at: int
    req: ResponsesRequest
    reasoning_id: str
    message_id: str

    @classmethod
    def new(cls, req: ResponsesRequest, name: str, serial: int, now: int) -> ResponseDraft:
        return cls(f"resp_{name}_{serial}", now, req, f"rs_{name}_{serial}", f"msg_{name}_{serial}")

    def reasoning_item(self, text: str, status: str) -> dict[str, Any]:
        content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
        return {
            "id": self.reasoning_id,
            "type": "reasoning",
            "summary": [],
            "content": content,
            "status": status,
        }

    def message_item(self, text: str | None, status: str) -> dict[str, Any]:
        content = (
            [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        )
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def body(self, plan: OutputPlan | None, usage: RequestUsage | None) -> dict[str, Any]:
        """The Response object: in progress (no plan yet) or finished."""
        b, output, status = self.req.body, [], "in_progress"
        if plan is not None:
            status = "completed" if plan.finish_reason is FinishReason.STOP else "incomplete"
            if plan.reasoning:
                output.append(self.reasoning_item(plan.reasoning_text, "completed"))
            output.append(self.message_item(plan.answer_text, "completed"))
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"),
            "max_output_tokens": self.req.sim.spec.max_tokens,
            "metadata": b.get("metadata") or {},
            "model": self.req.sim.model,
            "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": b.get("reasoning"),
            "store": self.req.store,
            "temperature": b.get("temperature", 1.0),
            "text": b.get("text") or {"format": {"type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "top_p": b.get("top_p", 1.0),
            "truncation": b.get("truncation", "disabled"),
            "usage": None if usage is None or plan is None else usage_body(usage),
            "user": b.get("user"),
        }

    def stored(self, plan: OutputPlan, usage: RequestUsage) -> StoredResponse:
        reply = {"role": "assistant", "content": plan.answer_text}
        return StoredResponse(self.body(plan, usage), (*self.req.conversation, reply), self.req.input_items)


class _Events:
    def __init__(self) -> None:
        self._numbers = itertools.count()

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(self._numbers), **fields}
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def _item_events(
    ev: _Events, draft: ResponseDraft, kind: PieceKind, index: int, opening: bool, text: str
) -> list[bytes]:
    """Opening (added events) or closing (done events) of output item ``index``."""
    reasoning = kind is PieceKind.REASONING
    item_id = draft.reasoning_id if reasoning else draft.message_id
    where = {"output_index": index, "item_id": item_id, "content_index": 0}
    if reasoning:
        part: dict[str, Any] = {"type": "reasoning_text", "text": text}
        item = draft.reasoning_item(text, "completed" if not opening else "in_progress")
        done = ev("response.reasoning_text.done", **where, text=text) if not opening else b""
    else:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = draft.message_item(None if opening else text, "in_progress" if opening else "completed")
        done = ev("response.output_text.done", **where, text=text, logprobs=[]) if not opening else b""
    if opening:
        return [ev("response.output_item.added", output_index=index, item=item),
                ev("response.content_part.added", **where, part=part)]  # fmt: skip
    return [done, ev("response.content_part.done", **where, part=part),
            ev("response.output_item.done", output_index=index, item=item)]  # fmt: skip


async def stream_events(
    draft: ResponseDraft,
    plan: OutputPlan,
    usage: RequestUsage,
    pieces: AsyncIterator[tuple[PieceKind, str]],
) -> AsyncIterator[bytes]:
    ev = _Events()
    opening = draft.body(None, None)
    yield ev("response.created", response=opening)
    yield ev("response.in_progress", response=opening)
    index, kind, text = -1, None, ""
    async for piece_kind, piece in pieces:
        if piece_kind is not kind:
            if kind is not None:
                for chunk in _item_events(ev, draft, kind, index, False, text):
                    yield chunk
            index, kind, text = index + 1, piece_kind, ""
            for chunk in _item_events(ev, draft, kind, index, True, ""):
                yield chunk
        text += piece
        name = (
            "response.reasoning_text.delta" if kind is PieceKind.REASONING else "response.output_text.delta"
        )
        extra: dict[str, Any] = {} if kind is PieceKind.REASONING else {"logprobs": []}
        item_id = draft.reasoning_id if kind is PieceKind.REASONING else draft.message_id
        yield ev(name, output_index=index, item_id=item_id, content_index=0, delta=piece, **extra)
    if kind is not None:
        for chunk in _item_events(ev, draft, kind, index, False, text):
            yield chunk
    yield ev("response.completed", response=draft.body(plan, usage))


def items_page(stored: StoredResponse, order: str, limit: int) -> dict[str, Any]:
    """``GET /v1/responses/{id}/input_items``: newest first unless ``order=asc``, as OpenAI does."""
    items = list(stored.input_items if order == "asc" else reversed(stored.input_items))
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }
