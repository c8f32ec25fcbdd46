"""``create_app(settings)``: wires the registry, state store, policy, proxy, routes and lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from backends.changes import Changes
from backends.engine_metrics import SignalScraper
from backends.fleet import Fleet
from backends.health import HealthChecker
from backends.kv_events import KvEventSubscriber, KvEventsUnavailable, require_kv_extra
from backends.managed import BackendController
from backends.registry import Registry
from config.settings import BackendConfig, ConfigError, RoutingConfig, Settings, VisionMode
from gateway.admin import Admin
from gateway.admin.ports import AdminPorts
from gateway.admission import AdmissionControl
from gateway.auth import AccessGuard, AdminAccess, ClientKeys, log_admin_access
from gateway.budgets import BudgetPolicy, BudgetStep
from gateway.context import RequestContext
from gateway.continuation import Continuation
from gateway.endpoints import Endpoint, Passthrough, StoredResponse
from gateway.errors import GatewayError, MethodNotAllowed, ModelNotFound, NotFound
from gateway.guard import OutputGuard
from gateway.identity import SessionIdentity
from gateway.inbound import BodyBudget
from gateway.learning import RoutingFeedback
from gateway.metrics import KvEventsMetrics, Metrics, OnDemandMetrics
from gateway.ownership import OWNER_POLICY, ResponseOwnership
from gateway.proxy import Proxy
from gateway.quotas import LocalQuotas, Quotas
from gateway.readiness import readyz_endpoint
from gateway.reasoning import ReasoningRelay
from gateway.redis_quotas import RedisQuotas
from gateway.redis_store import RedisAffinityStore
from gateway.shapes.base import OPENAI_ERRORS, ApiShape
from gateway.shapes.table import PASSTHROUGH, RESPONSES, SHAPES
from gateway.sidecar import SidecarClient, SidecarHost
from gateway.state import AffinityStore, MemoryAffinityStore
from gateway.status_page import StatusPage
from gateway.translation import Translation
from gateway.upstream import UpstreamPool
from gateway.vision import VisionRouting, VisionStep, no_embeds
from gateway.volatile import VolatileStrip
from gateway.waiting import WaitingRoom
from routing.kvindex import KvIndex
from routing.params import RoutingParams
from routing.policies import make_policy
from routing.policies.least_loaded import LeastLoadedPolicy
from routing.policies.unpinned import UnpinnedPolicy
from routing.volatile import rules_for

log = logging.getLogger("warmroute")


class Gateway:
    """Everything one gateway process owns. Built once from settings; no module-level state."""

    def __init__(
        self,
        settings: Settings,
        store: AffinityStore | None = None,
        *,
        freeze_gc: bool = False,
        modules: Sequence[object] = (),
    ) -> None:
        """``modules``: further request-path modules (gateway/phases.py), after the configured ones."""
        self.settings = settings
        self.freeze_gc = freeze_gc
        self.store: AffinityStore = store or make_store(settings, Changes())
        #: The one announcement of state changes: the store's pins and the fleet's lifecycles.
        self.changes = self.store.changes
        self.registry = Registry(settings.backends, listener=self.store)  # leases drive the shared counts
        self.metrics = Metrics(self.registry)
        #: Request-body bytes this worker holds, over every body route (``limits.max_held_body_bytes``).
        self.body_budget = BodyBudget(settings.limits.max_held_body_bytes)
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
        self.fleet = Fleet(self.registry, settings, self.client, make=self._controller, changes=self.changes)
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
        # Thinking budgets (gateway/budgets.py): validated by the chat endpoint, shaped per attempt, enforced
        # by the gateway where the engine cannot, reasoning output in the fields clients expect.
        self.budgets = BudgetPolicy(settings.thinking, settings.models, self.metrics.thinking_ignored)
        # On-demand engines (backends/ondemand.py): requests for their models wait in the waiting room.
        self.waiting: WaitingRoom | None = None
        if self.fleet.demand is not None:
            self.fleet.demand.metrics = OnDemandMetrics(self.metrics.registry)
            self.waiting = WaitingRoom(self.fleet, settings.on_demand, _hold_trust(settings))
        # Admission per backend (gateway/admission.py): engines get what they can start; the rest waits here.
        self.admission: AdmissionControl | None = None
        if settings.admission.enabled:
            metrics = self.metrics.admitting(list(settings.admission.classes))
            self.admission = AdmissionControl(settings.admission, metrics)
        # Quotas per client key (gateway/quotas.py): only when a key has one; shared through Redis if set.
        self.quotas = make_quotas(settings, self.store, self.metrics)
        self.sidecar, vision = self._vision(settings)
        # Routing v2 (policy "ttft"): its inputs and learning (gateway/learning.py), engine /metrics signals.
        self.feedback: RoutingFeedback | None = None
        self.signals: SignalScraper | None = None
        self.kv, kv_metrics, self.kv_subscribers = self._kv_events(settings, params)
        if params.policy == "ttft":
            self.feedback = RoutingFeedback(self.registry, params, kv=self.kv, kv_metrics=kv_metrics)
            self.signals = SignalScraper(self.registry, self.client)
        self.proxy = Proxy(
            settings.timeouts,
            self.registry,
            self.store,
            self.fleet,
            self.metrics,
            self.transport,
            self._modules(settings, vision, modules),
            hide_engine_errors=settings.server.hide_engine_errors,
        )
        self.created = int(time.time())
        self.admin: Admin | None = None  # the /admin API (create_app builds it: it needs the endpoints)

    def _modules(
        self, settings: Settings, vision: Sequence[object], extra: Sequence[object]
    ) -> tuple[object, ...]:
        """The request path's features, in order (gateway/phases.py sorts them by phase): within a phase the
        first listed runs first (images are encoded before the budget is spelled; the guard sees the engine's
        own events, before reasoning fields are rewritten and phases stitched)."""
        guard = settings.guard
        volatile = rules_for(settings.routing.volatile_prefixes)
        continuation = Continuation(settings.thinking, self.metrics)
        return (
            # First: its prepare step makes a translated attempt's draft chat before any other step shapes
            # it, and its body filter gives every later filter and the observers the client's shape (an
            # enforced budget's two chat phases stitched before that, by ``continuation``).
            Translation(stitching=continuation),
            self.metrics,  # tokens, TTFT, requests by model and route reason
            *([self.quotas] if self.quotas is not None else []),  # first: over quota, nothing waits or wakes
            ResponseOwnership(self.store, self.registry),  # before the waiting room: an unknown id waits not
            *([self.waiting] if self.waiting is not None else []),
            *([self.admission] if self.admission is not None else []),  # after the waiting room: its send
            *vision,
            # Volatile system text (the billing block) off the bodies of engines that would keep it.
            *([VolatileStrip(volatile, self.metrics)] if volatile else []),
            BudgetStep(self.budgets, self.metrics),
            *([self.feedback] if self.feedback is not None else []),
            *([OutputGuard(guard, self.metrics)] if guard.enabled else []),
            ReasoningRelay(settings.thinking.reasoning_fields, self.budgets.thinks),
            continuation,
            *extra,
        )

    def _kv_events(
        self, settings: Settings, params: RoutingParams
    ) -> tuple[KvIndex | None, KvEventsMetrics | None, list[KvEventSubscriber]]:
        """Engines' KV cache events (backends/kv_events.py): one index, one subscriber per backend that has
        ``kv_events``. Only the ttft policy reads them; others are told so once and subscribe to nothing."""
        subscribed = [b for b in settings.backends if b.kv_events is not None]
        if not subscribed:
            return None, None, []
        if params.policy != "ttft":
            log.warning("backends[].kv_events is ignored: routing.policy %s does not read it", params.policy)
            return None, None, []
        try:
            require_kv_extra()
        except KvEventsUnavailable as exc:
            raise ValueError(str(exc)) from None
        kv = KvIndex()
        metrics = self.metrics.kv_events(kv)
        subs = []
        for b in subscribed:
            assert b.kv_events is not None
            on_batch = functools.partial(kv.settle, b.id)
            subs.append(KvEventSubscriber(b.id, b.kv_events, kv.engine(b.id), metrics, on_batch))
        return kv, metrics, subs

    def _controller(self, cfg: BackendConfig, *args: Any) -> BackendController:
        """Each lifecycle controller reports its transitions to the metrics (canaries, restarts)."""
        controller = BackendController.from_settings(cfg, *args)
        controller.on_transition = self.metrics.transition
        return controller

    async def scrape(self) -> bytes:
        """The /metrics body. Pinned-conversation counts are read first: from Redis, that is a round trip."""
        self.metrics.backends.conversations = (await self.store.view(None)).conversations
        return generate_latest(self.metrics.registry)

    def _vision(self, settings: Settings) -> tuple[SidecarHost | None, list[object]]:
        """Images (gateway/vision.py): kept from text-only backends, encoded by the sidecar for ``embeds``
        ones. With every backend ``native`` (the default) no module is made and no request is looked at."""
        cfg = settings.sidecar
        self.encoder: SidecarClient | None = None
        host = None if cfg is None else SidecarHost(cfg, settings, self.client)
        modes = {b.vision for b in settings.backends}
        refused = [why for b in settings.backends if (why := no_embeds(b)) is not None]
        if refused:
            raise ValueError("; ".join(refused))
        modules: list[object] = []
        if modes - {VisionMode.NATIVE}:
            modules.append(VisionRouting(self.registry, host))
        if VisionMode.EMBEDS in modes:
            assert cfg is not None and host is not None  # settings refuse embeds without a sidecar
            self.encoder = SidecarClient(cfg, self.client, host)
            modules.append(VisionStep(self.encoder))
        return host, modules

    @contextlib.asynccontextmanager
    async def lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        # 1. Connect the shared state store (an unreachable Redis only degrades it; it reconnects itself).
        await self.store.start()
        #    With Redis, backends other replicas changed at runtime are applied before the fleet starts.
        if self.admin is not None:
            await self.admin.start()
        # 2. Start the lifecycles (managed engines are spawned), probe every backend once and wait for the
        #    canaries that started, so a healthy cluster takes traffic as soon as we listen.
        self.fleet.start()
        if self.sidecar is not None:
            self.sidecar.start()  # a managed sidecar is spawned; image requests wait for its first probe
        await asyncio.gather(self.health.check_all(), *([self.sidecar.check()] if self.sidecar else []))
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
        for sub in self.kv_subscribers:
            sub.start()
        try:
            yield
        finally:
            # Shutdown. uvicorn has stopped accepting and waited up to server.shutdown_grace_s for the
            # requests in flight (``warmroute serve``); under other servers we wait for them here.
            # 5. Let what is still in flight finish, up to the same deadline.
            await self._drained(self.settings.server.shutdown_grace_s)
            if self.admin is not None:
                await self.admin.aclose()  # no runtime change is applied from here on
            # 6. Stop probing (no probe may start a canary or a restart now), then stop the lifecycles:
            #    managed engines (and a managed sidecar) get their stop command or SIGTERM, then SIGKILL
            #    after stop_timeout_s.
            await self.health.aclose()
            if self.signals is not None:
                await self.signals.aclose()
            await asyncio.gather(*(sub.aclose() for sub in self.kv_subscribers))
            await asyncio.gather(self.fleet.aclose(), *([self.sidecar.aclose()] if self.sidecar else []))
            # 7. Close upstream connections and the state store (quota finishes still being sent, first).
            if self.quotas is not None and isinstance(self.quotas.store, RedisQuotas):
                await self.quotas.store.drained()
            await self.transport.aclose()
            await self.client.aclose()
            await self.store.aclose()

    async def _drained(self, grace_s: float) -> None:
        deadline = time.monotonic() + grace_s
        while self.registry.total_in_flight() > 0 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # shutdown only, and leases announce nothing


def _hold_trust(settings: Settings) -> Callable[[RequestContext], bool]:
    """Who may send ``x-warmroute-hold``: the client keys named in ``on_demand.hold_clients``, or (none
    named) every client that passed authentication."""
    trusted = frozenset(settings.on_demand.hold_clients)
    if not trusted:
        return lambda _ctx: True
    return lambda ctx: ctx.client in trusted


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


def make_quotas(settings: Settings, store: AffinityStore, metrics: Metrics) -> Quotas | None:
    """Quotas when a key has one: in this process, or in Redis beside the affinity store (its pool, and
    its replica id, whose lease tells whether a replica's in-flight requests still count)."""
    if not settings.quotas.keys:
        return None
    quotas = Quotas(settings.quotas, LocalQuotas(), metrics.quotas())
    if isinstance(store, RedisAffinityStore):
        shared = store
        quotas.store = RedisQuotas(
            shared.client, shared.keys, shared.replica, quotas.unavailable, lambda: shared.degraded
        )
    return quotas


def make_store(settings: Settings, changes: Changes | None = None) -> AffinityStore:
    if settings.redis.url is None:
        return MemoryAffinityStore(settings.routing, changes=changes)
    backends = [b.id for b in settings.backends]
    return RedisAffinityStore(settings.redis, settings.routing, backends, changes=changes)


def shape_paths(served: Mapping[str, Endpoint]) -> Iterator[tuple[str, Endpoint]]:
    """Each shape's path, and with a trailing slash: it reaches the same endpoint (validation and affinity
    included), never the engine."""
    for path, ep in served.items():
        yield path, ep
        yield path + "/", ep


def shape_routes(served: Mapping[str, Endpoint]) -> list[Route]:
    return [Route(path, ep, methods=["POST"]) for path, ep in shape_paths(served)]


def stored_routes(endpoint: Callable[..., StoredResponse]) -> list[Route]:
    """A stored response's own routes (before the passthrough fallback), to the engine that owns it; each
    answers every method itself (a wrong one is its 405)."""
    base = RESPONSES.path + "/{response_id}"
    return [
        Route(base, endpoint("GET", "HEAD", "DELETE")),
        Route(base + "/cancel", endpoint("POST")),
        Route(base + "/input_items", endpoint("GET", "HEAD")),
    ]


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


def create_app(
    settings: Settings,
    store: AffinityStore | None = None,
    *,
    freeze_gc: bool = False,
    modules: Sequence[object] = (),
    shapes: Sequence[ApiShape] = SHAPES,
) -> AccessGuard:
    """The ASGI app. ``freeze_gc``: for a serving process (``warmroute serve``), never for tests that build
    many apps in one interpreter (frozen objects are never collected). ``modules``: further request-path
    modules, after the configured ones (gateway/phases.py). ``shapes``: the API shapes served, one endpoint
    each (gateway/shapes/table.py); every other /v1 route is passed through."""
    gw = Gateway(settings, store, freeze_gc=freeze_gc, modules=modules)
    access = AdminAccess.from_settings(settings)
    max_body = settings.limits.max_body_bytes

    def endpoint(shape: ApiShape) -> Endpoint:
        limits = settings.limits
        policy = gw.policy if shape.key is not None else LeastLoadedPolicy()  # no conversations: least loaded
        if not shape.pins:
            policy = UnpinnedPolicy(policy)  # where its conversation is, never pinning (a token count)
        args = (shape, gw.proxy, settings.routing, max_body, policy, gw.budgets)
        return Endpoint(*args, limits.max_json_values, gw.body_budget, identity=identity, keying=gw.metrics)

    identity = SessionIdentity.from_config(settings.routing)  # one for every endpoint

    served = {shape.path: endpoint(shape) for shape in shapes}  # one endpoint per shape, holding it
    limits = settings.limits
    passthrough = Passthrough(
        {**{path: ep.shape.errors for path, ep in served.items()}, "/v1/models": OPENAI_ERRORS},
        PASSTHROUGH,
        gw.proxy,
        settings.routing,
        max_body,
        LeastLoadedPolicy(),
        gw.budgets,
        limits.max_json_values,
        gw.body_budget,
    )
    gw.admin = Admin(
        AdminPorts(
            registry=gw.registry,
            fleet=gw.fleet,
            health=gw.health,
            store=gw.store,
            metrics=gw.metrics,
            transport=gw.transport,
            client=gw.client,
            changes=gw.changes,
            admin=settings.admin,
            canary=settings.canary,
            policy=settings.routing.policy.value,
            endpoints=served,
            feedback=gw.feedback,
            admission=gw.admission,
            quotas=gw.quotas,
        )
    )
    status = StatusPage(gw.registry, gw.fleet, gw.store, gw.metrics, settings.routing.spill_min_in_flight)

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

    async def metrics(_request: Request) -> Response:
        return Response(await gw.scrape(), media_type=CONTENT_TYPE_LATEST)

    def stored_response(*methods: str) -> StoredResponse:
        args = (RESPONSES, gw.proxy, settings.routing, max_body, OWNER_POLICY, gw.budgets)
        return StoredResponse(frozenset(methods), *args, limits.max_json_values, gw.body_budget)

    stored = [] if RESPONSES not in shapes else stored_routes(stored_response)
    routes = [
        *shape_routes(served),
        *stored,
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model, methods=["GET"]),
        Route("/v1/{rest:path}", passthrough),  # every other /v1 route: the PASSTHROUGH shape
        Route("/healthz", healthz, methods=["GET"]),
        Route(
            "/readyz", readyz_endpoint(gw.registry, gw.fleet, gw.store, gw.sidecar, access), methods=["GET"]
        ),
        Route("/metrics", metrics, methods=["GET"]),
        # Behind the AccessGuard, like every path under /admin.
        Mount("/admin", routes=[*gw.admin.routes, Route("/status", status.page, methods=["GET"])]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=gw.lifespan,
        exception_handlers={
            HTTPException: _http_error,
            GatewayError: _gateway_error,
            ClientDisconnect: _client_gone,  # here, not in the catch-all: that one logs and re-raises
            Exception: _unexpected,
        },
    )
    app.state.gateway = gw
    hot: dict[tuple[str, str], ASGIApp] = {("POST", path): ep for path, ep in shape_paths(served)}
    log_admin_access(access)
    names = settings.auth.keys()
    unknown = sorted(set(settings.quotas.keys) - set(names.values()))
    if unknown:  # a typo would leave that key without its quota, silently
        raise ConfigError(f"quotas.keys: {', '.join(unknown)}: no client key of that name (auth.client_keys)")
    clients = ClientKeys(names)
    errors = {path: ep.shape.errors for path, ep in served.items()}  # a refusal on a route, in its shape
    return AccessGuard(HotPath(app, hot), access, clients, gw.metrics.clients.counts, errors)


@dataclass(frozen=True, slots=True)
class ServingApp:
    """uvicorn's app factory for ``warmroute serve``: builds the app from settings already validated.

    uvicorn pickles its Config, this factory with it, into each worker it spawns; a worker unpickles the
    parent's ``Settings`` (no validation, no file or environment read) instead of loading them again. So a
    process loads its settings once, and every worker runs exactly what the parent checked, even if the file
    changed since.
    """

    settings: Settings

    def __call__(self) -> AccessGuard:
        return create_app(self.settings, freeze_gc=True)


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


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client left mid-body: nobody to answer, nothing worth a traceback."""
    log.debug("client disconnected during %s %s", request.method, request.url.path)
    return Response(status_code=400)


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    return await _gateway_error(request, GatewayError("internal error in the gateway; see its log"))
