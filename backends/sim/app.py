"""The simulator's Starlette app: OpenAI endpoints, ``/health``, ``/metrics`` and the ``/sim/*`` admin API.

Routes:

- ``POST /v1/chat/completions``, ``POST /v1/completions`` — streaming (SSE) or JSON
- ``GET /v1/models``, ``GET /health``, ``GET /metrics``
- ``GET|POST|DELETE /sim/faults`` — read, patch (JSON body, see ``FaultsPatch``), reset the fault switches
- ``GET /sim/stats`` — JSON counters; ``POST /reset_prefix_cache`` — empty the prefix cache (vLLM's path)
- ``/v1/messages`` and ``/v1/responses`` (unless turned off): see ``backends.sim.agent_routes``

Every response carries ``x-sim-name: <SimConfig.name>`` so tests can see which engine answered.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backends.sim.agent_routes import AgentHandlers
from backends.sim.config import SimConfig
from backends.sim.engine import EngineStats, RequestUsage, SimEngine, Sleep
from backends.sim.faults import FaultsPatch
from backends.sim.metrics import make_registry, render
from backends.sim.protocol import (
    Endpoint,
    ResponseHead,
    SimError,
    SimRequest,
    bad_request,
    finish_chunk,
    full_response,
    parse_request,
    piece_chunk,
    role_chunk,
    sse,
    usage_chunk,
)
from backends.sim.running import AbortingStream, break_after, run_to_end, start, until_disconnect
from backends.sim.text import OutputPlan

NAME_HEADER = "x-sim-name"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RESPONSE_PATH_PREFIX = "/v1/responses/"
RESPONSE_PATH = RESPONSE_PATH_PREFIX + "{response_id}"


def error_response(error: SimError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class SimHandlers:
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self.cfg = engine.cfg
        self.registry = make_registry(engine)
        self._created = int(time.time())
        self._response_ids = itertools.count(1)

    # -- completions ----------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, Endpoint.CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, Endpoint.COMPLETION)

    async def _complete(self, request: Request, endpoint: Endpoint) -> Response:
        try:
            req = parse_request(await request.body(), endpoint, self.cfg)
            plan = await start(self.engine, req)
        except SimError as exc:
            return error_response(exc)
        prefix = "chatcmpl" if endpoint is Endpoint.CHAT else "cmpl"
        head = ResponseHead(
            f"{prefix}-{self.cfg.name}-{next(self._response_ids)}", int(time.time()), req.model, endpoint
        )
        usage = RequestUsage(len(req.prompt_tokens))
        if req.stream:
            limit = self.engine.faults.current.die_mid_stream_after
            body = break_after(self._sse(req, plan, usage, head), limit)
            return AbortingStream(body, media_type="text/event-stream", headers={"cache-control": "no-cache"})
        done, _ = await until_disconnect(request.receive, run_to_end(self.engine, req, plan, usage))
        if not done:
            return Response(status_code=499)
        return JSONResponse(full_response(head, plan, usage, req.spec.thinking))

    async def _sse(
        self, req: SimRequest, plan: OutputPlan, usage: RequestUsage, head: ResponseHead
    ) -> AsyncGenerator[bytes, None]:
        opened = head.endpoint is not Endpoint.CHAT
        async with aclosing(self.engine.generate(req.prompt_tokens, plan, usage, req.priority)) as pieces:
            async for kind, text in pieces:
                if not opened:
                    opened = True
                    yield sse(role_chunk(head))
                yield sse(piece_chunk(head, kind, text))
        if not opened:
            yield sse(role_chunk(head))
        yield sse(finish_chunk(head, plan.finish_reason))
        if req.include_usage:
            yield sse(usage_chunk(head, usage))
        yield sse("[DONE]")

    # -- engine surface -------------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        data = [
            {
                "id": model,
                "object": "model",
                "created": self._created,
                "owned_by": "warmroute-sim",
                "root": model,
                "max_model_len": self.cfg.max_model_len,
            }
            for model in self.cfg.models
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        return Response(status_code=503 if self.engine.faults.current.health_fail else 200)

    async def metrics(self, request: Request) -> Response:
        return Response(render(self.registry), media_type=METRICS_CONTENT_TYPE)

    async def reset_prefix_cache(self, request: Request) -> Response:
        self.engine.cache.clear()
        return Response(status_code=200)

    # -- admin ----------------------------------------------------------------------------------------------

    async def faults(self, request: Request) -> Response:
        state = self.engine.faults
        if request.method == "DELETE":
            state.reset()
        elif request.method == "POST":
            try:
                state.apply(FaultsPatch.model_validate_json(await request.body() or b"{}"))
            except ValidationError as exc:
                return error_response(bad_request(f"invalid faults body: {exc}"))
        return JSONResponse(state.as_dict())

    async def stats(self, request: Request) -> Response:
        return JSONResponse(self.engine.snapshot())

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            Route("/sim/faults", self.faults, methods=["GET", "POST", "DELETE"]),
            Route("/sim/stats", self.stats, methods=["GET"]),
        ]


class CountAndTag:
    """Counts requests per route path (unknown paths as ``other``; ``/v1/responses/<id>...`` under
    ``/v1/responses/{response_id}``) and adds the engine-name header."""

    def __init__(self, app: ASGIApp, stats: EngineStats, known_paths: frozenset[str], name: str) -> None:
        self.app = app
        self.stats = stats
        self.known_paths = known_paths
        self.header = (NAME_HEADER.encode(), name.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if path.startswith(RESPONSE_PATH_PREFIX):
            path = RESPONSE_PATH
        self.stats.paths[path if path in self.known_paths else "other"] += 1

        async def tagged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, tagged_send)


def create_sim_app(cfg: SimConfig, *, sleep: Sleep | None = None) -> Starlette:
    """One simulated engine. ``sleep`` replaces ``asyncio.sleep`` for the modelled delays (tests record them);
    it receives seconds already multiplied by ``cfg.time_scale``."""
    handlers = SimHandlers(SimEngine(cfg, sleep))
    routes = [*handlers.routes(), *AgentHandlers(handlers.engine).routes()]
    app = Starlette(routes=routes)
    app.state.engine = handlers.engine
    app.state.registry = handlers.registry
    app.add_middleware(
        CountAndTag,
        stats=handlers.engine.stats,
        known_paths=frozenset(route.path for route in routes),
        name=cfg.name,
    )
    return app


def engine_of(app: Starlette) -> SimEngine:
    engine: Any = app.state.engine
    assert isinstance(engine, SimEngine)
    return engine
