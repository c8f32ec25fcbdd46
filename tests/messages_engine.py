"""A fake engine that also serves Anthropic Messages (``/v1/messages``, ``/v1/messages/count_tokens``) the way
vLLM's and Anthropic's own do: named SSE events, usage split between ``message_start`` (input and cache
fields) and the last ``message_delta`` (output tokens), ``stop_reason``, Anthropic-shaped errors.

Scripted like ``FakeEngine``: ``chunks`` text deltas, ``answer_status``, ``die_after`` (break the stream after
that many deltas), ``pad`` (bytes added to each delta, to push the stream's head out of a tail buffer).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from upstreams import FakeEngine

#: What every answer reports: 3 uncached + 5 read from the cache + 2 written to it = 10 prompt tokens.
START_USAGE = {
    "input_tokens": 3,
    "output_tokens": 1,
    "cache_read_input_tokens": 5,
    "cache_creation_input_tokens": 2,
}
COUNTED = 42  # what the token count answers


@dataclass
class AnthropicEngine(FakeEngine):
    pad: int = 0
    stop_reason: str = "end_turn"
    repeat: str | None = None  # every text delta is this (a degenerate engine)

    def app(self) -> Starlette:  # type: ignore[override]
        routes: list[BaseRoute] = [
            Route("/v1/messages", self._messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self._count, methods=["POST"]),
        ]
        return Starlette(routes=routes + list(super().app().routes))

    def _record(self, request: Request, raw: bytes) -> dict[str, Any]:
        self.raw.append(raw)
        self.paths.append(request.scope["raw_path"].decode("latin-1"))
        self.headers.append(dict(request.headers))
        body: dict[str, Any] = json.loads(raw)
        self.requests.append(body)
        return body

    async def _count(self, request: Request) -> Response:
        self._record(request, await request.body())
        return JSONResponse({"input_tokens": COUNTED, "served_by": self.name})

    async def _messages(self, request: Request) -> Response:
        body = self._record(request, await request.body())
        if self.answer_status is not None:
            error = {
                "type": "error",
                "error": {"type": "api_error", "message": f"engine says {self.answer_status}"},
            }
            return JSONResponse(error, self.answer_status)
        if body.get("stream"):
            return StreamingResponse(self._events(body), media_type="text/event-stream")
        self.completed += 1
        return JSONResponse(self.message(body))

    def text(self, i: int) -> str:
        return self.repeat if self.repeat is not None else f"{self.name}-{i} " + "x" * self.pad

    def message(self, body: dict[str, Any]) -> dict[str, Any]:
        return {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "content": [{"type": "text", "text": "".join(self.text(i) for i in range(self.chunks))}],
            "model": body.get("model"),
            "stop_reason": self.stop_reason,
            "stop_sequence": None,
            "usage": {**START_USAGE, "output_tokens": self.chunks + 1},
        }

    async def _events(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        self.active += 1
        done = False
        try:
            start = {
                "type": "message_start",
                "message": {**self.message(body), "content": [], "stop_reason": None, "usage": START_USAGE},
            }
            yield event("message_start", start)
            block = {"type": "text", "text": ""}
            yield event(
                "content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}
            )
            yield event("ping", {"type": "ping"})
            for i in range(self.chunks):
                if self.die_after is not None and i >= self.die_after:
                    raise ConnectionAbortedError("fake engine died mid-stream")
                delta = {"type": "text_delta", "text": self.text(i)}
                yield event(
                    "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}
                )
            yield event("content_block_stop", {"type": "content_block_stop", "index": 0})
            end = {"stop_reason": self.stop_reason, "stop_sequence": None}
            usage = {"output_tokens": self.chunks + 1}
            yield event("message_delta", {"type": "message_delta", "delta": end, "usage": usage})
            yield event("message_stop", {"type": "message_stop"})
            done = True
            self.completed += 1
        finally:
            self.active -= 1
            if not done:
                self.cancelled += 1


def event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()
