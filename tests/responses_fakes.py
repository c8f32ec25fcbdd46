"""A fake engine serving OpenAI Responses with a per-process store, as vLLM does with
``VLLM_ENABLE_RESPONSES_API_STORE=1``: a ``previous_response_id`` it did not make is its 404.

Events and fields are spelled as vLLM's serving_responses and the openai SDK's types spell them: the
response object's ``id`` first, named SSE events (``event: response.created`` ...), no ``[DONE]``.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from upstreams import FakeEngine


def not_found(rid: str) -> JSONResponse:
    error = {"message": f"Response with id '{rid}' not found.", "type": "invalid_request_error"}
    return JSONResponse({"error": {**error, "param": "response_id", "code": 404}}, 404)


@dataclass
class ResponsesEngine(FakeEngine):
    """``FakeEngine`` plus ``/v1/responses``: usage ``input_tokens=7``, ``cached_tokens=5``,
    ``output_tokens`` = the words of its reply; ``break_stream``: the connection drops after one delta."""

    stored: dict[str, dict[str, Any]] = field(default_factory=dict)
    inputs: dict[str, list[Any]] = field(default_factory=dict)
    seq: int = 0
    break_stream: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def app(self) -> Starlette:
        base = super().app()
        own = [
            Route("/v1/responses", self._create, methods=["POST"]),
            Route("/v1/responses/{rid}", self._get, methods=["GET", "DELETE"]),
            Route("/v1/responses/{rid}/cancel", self._cancel, methods=["POST"]),
            Route("/v1/responses/{rid}/input_items", self._input_items, methods=["GET"]),
        ]
        return Starlette(routes=[*own, *base.routes])

    def _note(self, request: Request, raw: bytes) -> None:
        target = request.scope["raw_path"].decode("latin-1")
        if request.scope["query_string"]:
            target += "?" + request.scope["query_string"].decode("latin-1")
        self.paths.append(f"{request.method} {target}")
        self.raw.append(raw)
        self.headers.append(dict(request.headers))

    async def _create(self, request: Request) -> Response:
        raw = await request.body()
        self._note(request, raw)
        body = json.loads(raw)
        self.requests.append(body)
        previous = body.get("previous_response_id")
        if previous is not None and previous not in self.stored:
            return not_found(previous)
        with self.lock:
            self.seq += 1
            rid = f"resp_{self.name}{self.seq:04d}"
        text = f"{self.name} says {self.seq}"
        response = self._response(rid, body, text)
        if body.get("store", True):
            self.stored[rid] = response
            self.inputs[rid] = body["input"] if isinstance(body["input"], list) else [body["input"]]
        if body.get("stream"):
            return StreamingResponse(self._events(response, text), media_type="text/event-stream")
        return JSONResponse(response)

    def _response(self, rid: str, body: dict[str, Any], text: str) -> dict[str, Any]:
        item = {
            "id": f"msg_{rid}",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
        usage = {
            "input_tokens": 7,
            "input_tokens_details": {"cached_tokens": 5},
            "output_tokens": len(text.split()),
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 7 + len(text.split()),
        }
        return {
            "id": rid,
            "object": "response",
            "created_at": 0,
            "model": body.get("model"),
            "status": "completed",
            "output": [item],
            "previous_response_id": body.get("previous_response_id"),
            "tools": [],
            "parallel_tool_calls": True,
            "tool_choice": "auto",
            "usage": usage,
        }

    async def _events(self, response: dict[str, Any], text: str) -> AsyncIterator[bytes]:
        head = {**response, "status": "in_progress", "output": [], "usage": None}
        item_id = response["output"][0]["id"]
        events: list[dict[str, Any]] = [{"type": "response.created", "response": head}]
        for word in text.split(" "):
            events.append(
                {"type": "response.output_text.delta", "item_id": item_id, "output_index": 0,
                 "content_index": 0, "delta": word + " ", "logprobs": []}
            )  # fmt: skip
        events.append({"type": "response.completed", "response": response})
        for n, event in enumerate(events):
            if self.break_stream and n == 2:
                raise ConnectionAbortedError("fake engine died mid-stream")
            event["sequence_number"] = n
            yield f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()

    async def _get(self, request: Request) -> Response:
        self._note(request, await request.body())
        rid = request.path_params["rid"]
        if rid not in self.stored:
            return not_found(rid)
        if request.method == "DELETE":
            del self.stored[rid]
            return JSONResponse({"id": rid, "object": "response", "deleted": True})
        return JSONResponse(self.stored[rid])

    async def _cancel(self, request: Request) -> Response:
        self._note(request, await request.body())
        rid = request.path_params["rid"]
        if rid not in self.stored:
            return not_found(rid)
        return JSONResponse({**self.stored[rid], "status": "cancelled"})

    async def _input_items(self, request: Request) -> Response:
        self._note(request, await request.body())
        rid = request.path_params["rid"]
        if rid not in self.inputs:
            return not_found(rid)
        return JSONResponse({"object": "list", "data": self.inputs[rid], "has_more": False})
