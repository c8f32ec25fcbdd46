"""``create_app(settings)``: wires the registry, state store, policy, proxy, routes and lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from backends.engine_metrics import SignalScraper
from backends.fleet import Fleet
from backends.health import HealthChecker
from backends.registry import Registry
from config.settings import RoutingConfig, Settings, load_settings
from gateway.budgets import BudgetPolicy, BudgetStep
from gateway.continuation import Continuation
from gateway.endpoints import ChatCompletions, Completions, Endpoint, Passthrough
from gateway.errors import GatewayError, MethodNotAllowed, ModelNotFound, NotFound
from gateway.learning import RoutingFeedback
from gateway.metrics import Metrics
from gateway.proxy import Proxy
from gateway.reasoning import ReasoningRelay
from gateway.redis_store import RedisAffinityStore
from gateway.state import AffinityStore, MemoryAffinityStore
from gateway.upstream import UpstreamPool
from routing.params import RoutingParams
from routing.policies import Policy, make_policy
from routing.policies.least_loaded import LeastLoadedPolicy

log = logging.getLogger("warmroute")

CONFIG_ENV = "WARMROUTE_CONFIG_FILE"


class Gateway:
    """Everything one gateway process owns. Built once from settings; no module-level state."""

    def __init__(
        self, settings: Settings, store: AffinityStore | None = None, *, freeze_gc: bool = False
    ) -> None:
        self.settings = settings
        self.freeze_gc = freeze_gc
        self.store: AffinityStore = store or make_store(settings)
        self.registry = Registry(settings.backends, listener=self.store)  # leases drive the shared counts
        self.metrics = Metrics(self.registry)
        self.metrics.degraded.set_function(lambda: 1.0 if self.store.status().get("degraded") else 0.0)
        params = routing_params(settings.routing)
        self.policy = make_policy(params)
        self.client = httpx.AsyncClient(
            limits=httpx.Limits(
                max_connections=settings.limits.max_connections,
                max_keepalive_connections=settings.limits.max_connections,
            ),
            follow_redirects=False,
        )
        # One lifecycle controller per backend, the one writer of its state; probes and the proxy feed it.
        self.fleet = Fleet(self.registry, settings, self.client)
        self.health = HealthChecker(self.registry, self.client, settings.health, self.fleet)
        # The hot path's own HTTP/1.1 client: httpx costs ~1.4 ms CPU per request here, this ~0.02 ms.
        self.transport = UpstreamPool(
            connect_timeout=settings.timeouts.connect_s,
            max_connections_per_origin=settings.limits.max_connections,
            pool_timeout=settings.upstream.pool_timeout_s,
            idle_timeout=settings.upstream.idle_timeout_s,
            max_response_header_bytes=settings.upstream.max_response_header_bytes,
            max_response_headers=settings.upstream.max_response_headers,
        )
        self.proxy = Proxy(
            settings.timeouts,
            self.registry,
            self.store,
            self.fleet,
            self.metrics,
            self.transport,
            guard=settings.guard,
        )
        # Thinking budgets (gateway/budgets.py): validated by the chat endpoint, shaped per attempt, enforced
        # by the gateway where the engine cannot, reasoning output in the fields clients expect.
        self.budgets = BudgetPolicy(settings.thinking, settings.models)
        self.proxy.steps = (*self.proxy.steps, BudgetStep(self.budgets, self.metrics))
        self.proxy.continuation = Continuation(
            self.transport, settings.timeouts, settings.thinking, self.metrics
        )
        self.proxy.reasoning = ReasoningRelay(settings.thinking.reasoning_fields, self.budgets.thinks)
        # Routing v2 (policy "ttft"): its inputs and learning (gateway/learning.py), engine /metrics signals.
        self.signals: SignalScraper | None = None
        if params.policy == "ttft":
            feedback = RoutingFeedback(self.registry, params, settings.routing.session_header)
            self.proxy.feedback = feedback
            self.proxy.observers = (*self.proxy.observers, feedback)
            self.signals = SignalScraper(self.registry, self.client)
        self.created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        # 1. Connect the shared state store (an unreachable Redis only degrades it; it reconnects itself).
        await self.store.start()
        # 2. Start the lifecycles (managed engines are spawned), probe every backend once and wait for the
        #    canaries that started, so a healthy cluster takes traffic as soon as we listen.
        self.fleet.start()
        await self.health.check_all()
        await self.fleet.settled(self.settings.canary.timeout_s)
        # 3. Everything built so far lives as long as the process: move it out of the collector's sight, so
        #    a full collection walks only what requests allocate (57k objects cost a ~30 ms pause each time).
        if self.freeze_gc:
            gc.collect()
            gc.freeze()
        # 4. Keep probing in the background: one task per backend, so a slow one delays no other.
        self.health.start()
        if self.signals is not None:
            self.signals.start()
        try:
            yield
        finally:
            # Shutdown. uvicorn has stopped accepting and waited up to server.shutdown_grace_s for the
            # requests in flight (``warmroute serve``); under other servers we wait for them here.
            # 5. Let what is still in flight finish, up to the same deadline.
            await self._drained(self.settings.server.shutdown_grace_s)
            # 6. Stop probing (no probe may start a canary or a restart now), then stop the lifecycles:
            #    managed engines get their stop command or SIGTERM, then SIGKILL after stop_timeout_s.
            await self.health.aclose()
            if self.signals is not None:
                await self.signals.aclose()
            await self.fleet.aclose()
            # 7. Close upstream connections and the state store.
            await self.transport.aclose()
            await self.client.aclose()
            await self.store.aclose()

    async def _drained(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while self.registry.total_in_flight() > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # shutdown only, and leases announce nothing


def routing_params(cfg: RoutingConfig) -> RoutingParams:
    """Routing's own frozen copy of its settings (``routing/`` never imports pydantic)."""
    return RoutingParams(
        policy=cfg.policy.value,
        spill_factor=cfg.spill_factor,
        spill_min_in_flight=cfg.spill_min_in_flight,
        repin_on_spill=cfg.repin_on_spill,
        active_window_s=cfg.active_window_s,
        load_share=cfg.load_share,
        stay_margin=cfg.stay_margin,
        speed_half_life_s=cfg.speed_half_life_s,
    )


def make_store(settings: Settings) -> AffinityStore:
    if settings.redis.url is None:
        return MemoryAffinityStore(settings.routing)
    backends = [b.id for b in settings.backends]
    return RedisAffinityStore(settings.redis, settings.routing, backends)


class HotPath:
    """Sends the generation endpoints straight to their ASGI apps; everything else goes through Starlette.

    Those endpoints answer every error themselves (OpenAI-shaped), so Starlette's router, its two
    exception middlewares and their wrappers around every ``send`` are pure overhead on the hot path.
    """

    def __init__(self, app: Starlette, routes: dict[tuple[str, str], ASGIApp]) -> None:
        self.app = app
        self.state = app.state
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            endpoint = self.routes.get((scope["method"], scope["path"]))
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(settings: Settings, store: AffinityStore | None = None, *, freeze_gc: bool = False) -> HotPath:
    """The ASGI app. ``freeze_gc``: for a serving process (``warmroute serve``), never for tests that build
    many apps in one interpreter (frozen objects are never collected)."""
    gw = Gateway(settings, store, freeze_gc=freeze_gc)
    max_body = settings.limits.max_body_bytes

    def endpoint(cls: type[Endpoint], policy: Policy) -> Endpoint:
        return cls(gw.proxy, settings.routing, max_body, policy, gw.budgets)

    chat = endpoint(ChatCompletions, gw.policy)
    completions = endpoint(Completions, gw.policy)

    async def models(_request: Request) -> Response:
        return JSONResponse(
            {"object": "list", "data": [_model_card(m, gw.created) for m in gw.registry.models()]}
        )

    async def model(request: Request) -> Response:
        name = request.path_params["model"]
        if not gw.registry.serves(name):
            raise ModelNotFound(f"model {name!r} is not served here", param="model")
        return JSONResponse(_model_card(name, gw.created))

    async def healthz(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def readyz(request: Request) -> Response:
        # Served on the API port without auth. Loopback clients (an operator on the host, a local
        # supervisor) get each backend's full lifecycle status (failed canary check and its answer, exit
        # codes, last output lines); anyone else gets ids, states and a short reason, no URLs or output.
        backends = readyz_backends(gw.fleet.status(), _is_loopback(request.client and request.client.host))
        shared = gw.store.status()
        ready = gw.registry.any_ready()
        body = {
            "ready": ready,
            "backends": backends,
            "shared_state": {"backend": shared.get("backend"), "degraded": bool(shared.get("degraded"))},
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(_request: Request) -> Response:
        return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        # A trailing slash reaches the same endpoint (validation and affinity included), never the engine.
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/chat/completions/", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/completions/", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/{rest:path}", endpoint(Passthrough, LeastLoadedPolicy())),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=gw.lifespan,
        exception_handlers={HTTPException: _http_error, GatewayError: _gateway_error, Exception: _unexpected},
    )
    app.state.gateway = gw
    hot: dict[tuple[str, str], ASGIApp] = {}
    for path in ("/v1/chat/completions", "/v1/chat/completions/"):
        hot["POST", path] = chat
    for path in ("/v1/completions", "/v1/completions/"):
        hot["POST", path] = completions
    return HotPath(app, hot)


def create_app_from_env() -> HotPath:
    """uvicorn factory for multi-worker serving: the config path comes from $WARMROUTE_CONFIG_FILE."""
    return create_app(load_settings(os.environ.get(CONFIG_ENV)), freeze_gc=True)


#: /readyz's reason for non-loopback clients is cut here: engine output must not leak through it.
SHORT_REASON_CHARS = 120


def readyz_backends(status: dict[str, dict[str, Any]], detail: bool) -> dict[str, dict[str, Any]]:
    if detail:
        return status
    out: dict[str, dict[str, Any]] = {}
    for bid, st in status.items():
        reason = str(st.get("reason") or "").split(";", 1)[0].split(": ", 1)[0]  # "canary failed", …
        out[bid] = {"state": st["state"], "reason": reason[:SHORT_REASON_CHARS]}
    return out


def _is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _model_card(name: str, created: int) -> dict[str, object]:
    return {"id": name, "object": "model", "created": created, "owned_by": "warmroute"}


async def _gateway_error(_request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GatewayError)
    return Response(exc.body(), status_code=exc.status, media_type="application/json")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        err: GatewayError = MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}")
    elif exc.status_code == 404:
        err = NotFound(f"no route for {request.method} {request.url.path}")
    else:
        err = GatewayError(str(exc.detail))
        err.status = exc.status_code
    return await _gateway_error(request, err)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return await _gateway_error(request, GatewayError("internal error in the gateway; see its log"))
