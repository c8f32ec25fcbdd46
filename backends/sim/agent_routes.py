"""The simulator's coding-agent routes: Anthropic Messages and OpenAI Responses, each natively (vLLM-like).

- ``POST /v1/messages``, ``POST /v1/messages/count_tokens`` (``SimConfig.messages_api``); errors in
  Anthropic's shape ``{"type": "error", "error": {"type", "message"}}``.
- ``POST /v1/responses``, ``GET|DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``,
  ``GET /v1/responses/{id}/input_items`` (``SimConfig.responses_api``); errors in OpenAI's shape. The store
  (``SimConfig.responses_store``) lives in this process only.

A shape turned off has no routes: 404, as an engine without that endpoint answers.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from backends.sim import messages, responses
from backends.sim.engine import RequestUsage, SimEngine
from backends.sim.protocol import SimError, SimRequest, bad_request
from backends.sim.response_store import ResponseStore
from backends.sim.running import AbortingStream, break_after, run_to_end, start, until_disconnect
from backends.sim.text import OutputPlan

SSE_HEADERS = {"cache-control": "no-cache"}
DEFAULT_ITEMS_LIMIT = 20


def _anthropic_error(error: SimError) -> JSONResponse:
    return JSONResponse(error.anthropic_body(), status_code=error.status)


def _openai_error(error: SimError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class AgentHandlers:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.cfg = engine.cfg
        self.store = ResponseStore() if engine.cfg.responses_store else None
        self._serials = itertools.count(1)

    def _stream(self, body: AsyncGenerator[bytes, None]) -> AbortingStream:
        limit = self.engine.faults.current.die_mid_stream_after
        return AbortingStream(break_after(body, limit), media_type="text/event-stream", headers=SSE_HEADERS)

    async def _finish(self, request: Request, req: SimRequest, plan: OutputPlan, usage: RequestUsage) -> bool:
        done, _ = await until_disconnect(request.receive, run_to_end(self.engine, req, plan, usage))
        return done

    # -- Messages -----------------------------------------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        try:
            req = messages.parse_messages(await request.body(), self.cfg)
            plan = await start(self.engine, req)
        except SimError as exc:
            return _anthropic_error(exc)
        message_id = f"msg_{self.cfg.name}_{next(self._serials)}"
        usage = RequestUsage(len(req.prompt_tokens))
        if req.stream:
            return self._stream(self._message_sse(message_id, req, plan, usage))
        if not await self._finish(request, req, plan, usage):
            return Response(status_code=499)
        return JSONResponse(messages.message_body(message_id, req, plan, usage))

    async def _message_sse(
        self, message_id: str, req: SimRequest, plan: OutputPlan, usage: RequestUsage
    ) -> AsyncGenerator[bytes, None]:
        async with aclosing(self.engine.generate(req.prompt_tokens, plan, usage)) as pieces:
            async for chunk in messages.stream_events(message_id, req, plan, usage, pieces):
                yield chunk

    async def count_tokens(self, request: Request) -> Response:
        try:
            return JSONResponse(messages.count_tokens(await request.body(), self.cfg))
        except SimError as exc:
            return _anthropic_error(exc)

    # -- Responses ----------------------------------------------------------------------------------------

    async def create_response(self, request: Request) -> Response:
        try:
            req = responses.parse_responses(await request.body(), self.cfg, self.store, self._serials)
            plan = await start(self.engine, req.sim)
        except SimError as exc:
            return _openai_error(exc)
        draft = responses.ResponseDraft.new(req, self.cfg.name, next(self._serials), int(time.time()))
        usage = RequestUsage(len(req.sim.prompt_tokens))
        if req.sim.stream:
            return self._stream(self._response_sse(draft, plan, usage))
        if not await self._finish(request, req.sim, plan, usage):
            return Response(status_code=499)
        self._keep(draft, plan, usage)
        return JSONResponse(draft.body(plan, usage))

    def _keep(self, draft: responses.ResponseDraft, plan: OutputPlan, usage: RequestUsage) -> None:
        if self.store is not None and draft.req.store:
            self.store.put(draft.stored(plan, usage))

    async def _response_sse(
        self, draft: responses.ResponseDraft, plan: OutputPlan, usage: RequestUsage
    ) -> AsyncGenerator[bytes, None]:
        async with aclosing(self.engine.generate(draft.req.sim.prompt_tokens, plan, usage)) as pieces:
            async for chunk in responses.stream_events(draft, plan, usage, pieces):
                if chunk.startswith(b"event: response.completed"):
                    self._keep(draft, plan, usage)  # stored before the client can send the follow-up
                yield chunk

    def _stored(self, request: Request, then: Callable[[str, Any], Response]) -> Response:
        response_id = str(request.path_params["response_id"])
        stored = self.store.get(response_id) if self.store is not None else None
        if stored is None:
            return _openai_error(responses.not_found(response_id))
        return then(response_id, stored)

    async def get_response(self, request: Request) -> Response:
        return self._stored(request, lambda _id, stored: JSONResponse(stored.response))

    async def delete_response(self, request: Request) -> Response:
        def delete(response_id: str, _stored: Any) -> Response:
            assert self.store is not None
            self.store.delete(response_id)
            return JSONResponse({"id": response_id, "object": "response", "deleted": True})

        return self._stored(request, delete)

    async def cancel_response(self, request: Request) -> Response:
        # The sim runs no background responses: every stored one is finished, as vLLM answers for those.
        error = SimError(400, "Cannot cancel a synchronous response.", 400, param="response_id")
        return self._stored(request, lambda _id, _stored: _openai_error(error))

    async def input_items(self, request: Request) -> Response:
        order = request.query_params.get("order", "desc")
        try:
            limit = int(request.query_params.get("limit", DEFAULT_ITEMS_LIMIT))
        except ValueError:
            return _openai_error(bad_request("'limit' must be an integer"))
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            return _openai_error(bad_request("'order' must be asc or desc and 'limit' within 1..100"))
        return self._stored(
            request, lambda _id, stored: JSONResponse(responses.items_page(stored, order, limit))
        )

    def routes(self) -> list[Route]:
        out: list[Route] = []
        if self.cfg.messages_api:
            out += [
                Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            ]
        if self.cfg.responses_api:
            out += [
                Route("/v1/responses", self.create_response, methods=["POST"]),
                Route("/v1/responses/{response_id}", self.get_response, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"]),
                Route("/v1/responses/{response_id}/cancel", self.cancel_response, methods=["POST"]),
                Route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"]),
            ]
        return out
