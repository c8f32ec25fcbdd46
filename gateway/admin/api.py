"""The admin API's backend handlers, the change long poll, and the operation table (routes and OpenAPI
document come from the table; the routing handlers' entries are ``gateway.admin.routing_api``'s).

Every change is applied to this replica first (``LocalChanges``), then published for the others
(``ChangeFeed``, when Redis is configured); one lock orders changes and the feed's polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import Response

from backends.canary import Canary
from backends.engine_metrics import CACHE_COUNTERS, QUEUE_GAUGES, scrape
from backends.events import Command
from backends.registry import Backend
from config.settings import BackendConfig
from gateway.admin.body import (
    Conflict,
    UnknownBackend,
    Unprocessable,
    json_response,
    read_model,
    validate,
)
from gateway.admin.models import (
    AdmissionView,
    BackendList,
    BackendPatch,
    BackendView,
    CanaryRun,
    ChangeResult,
    ChangesQuery,
    ChangesView,
    HoldRequest,
    HoldResult,
    QuotasView,
    Removed,
)
from gateway.admin.openapi import Handler, Operation
from gateway.admin.ports import AdminPorts
from gateway.admin.routing_api import RoutingApi, routing_operations
from gateway.admin.runtime import LocalChanges
from gateway.admin.sync import ChangeFeed
from gateway.state import StoreView
from gateway.vision import no_embeds

ENGINE_SERIES = (*QUEUE_GAUGES, *CACHE_COUNTERS)
SCRAPE_TIMEOUT_S = 1.0
_COMMANDS = (Command.DRAIN, Command.UNDRAIN, Command.CORDON, Command.UNCORDON, Command.RESET)
_FLAGS = {
    Command.DRAIN: ("drained", True),
    Command.UNDRAIN: ("drained", False),
    Command.CORDON: ("cordoned", True),
    Command.UNCORDON: ("cordoned", False),
}


class AdminApi:
    def __init__(self, gw: AdminPorts, feed: ChangeFeed | None, local: LocalChanges) -> None:
        self.gw = gw
        self.feed = feed
        self.local = local
        self.limit = gw.admin.max_body_bytes
        self.lock = feed.lock if feed is not None else asyncio.Lock()

    # -- backends: read -------------------------------------------------------------------------------

    async def list_backends(self, _request: Request) -> Response:
        view = await self.gw.store.view(None)
        backends = list(self.gw.registry.backends.values())
        scraped = await asyncio.gather(*(self._scrape(b) for b in backends))
        items = [self._view(b, view, s) for b, s in zip(backends, scraped, strict=True)]
        return json_response(BackendList(backends=items))

    async def get_backend(self, request: Request) -> Response:
        backend = self._backend(request)
        scraped = await self._scrape(backend)
        return json_response(self._view(backend, await self.gw.store.view(None), scraped))

    # -- backends: change -----------------------------------------------------------------------------

    async def add_backend(self, request: Request) -> Response:
        cfg = await read_model(request, BackendConfig, self.limit)
        self._check_new(cfg)
        async with self.lock:
            if cfg.id in self.gw.registry.backends:
                raise Conflict(f"backend {cfg.id!r} already exists", param="id")
            backend = self.local.add(cfg)
            propagated = await self._publish(
                cfg.id, config=cfg.model_dump(mode="json"), drained=None, cordoned=None
            )
        result = ChangeResult(backend=await self._fresh_view(backend), propagated=propagated)
        return json_response(result, 201)

    async def remove_backend(self, request: Request) -> Response:
        backend_id = request.path_params["id"]
        async with self.lock:
            if backend_id not in self.gw.registry.backends:
                raise UnknownBackend(backend_id)
            if _is_on_demand(self.gw.registry.backends[backend_id].cfg):
                raise Conflict(
                    f"backend {backend_id!r} is an on-demand engine: its group's scheduler is built from the "
                    "config file at start; remove it there",
                    param="id",
                )
            removal = await self.local.remove(backend_id)
            propagated = await self._publish(backend_id, config=None)
        warnings = [
            f"model {m!r} has no backend now: its requests get 404 until one is added"
            for m in removal.orphaned_models
        ]
        return json_response(
            Removed(
                id=backend_id,
                propagated=propagated,
                in_flight_at_removal=removal.in_flight,
                models_left_without_backend=removal.orphaned_models,
                connections_closed=removal.connections_closed,
                warnings=warnings,
            )
        )

    async def patch_backend(self, request: Request) -> Response:
        patch = await read_model(request, BackendPatch, self.limit)
        async with self.lock:
            backend = self._backend(request)
            cfg = backend.cfg.model_copy(update={"weight": patch.weight})
            self.local.reconfigure(cfg)
            propagated = await self._publish(cfg.id, config=cfg.model_dump(mode="json"))
        return json_response(ChangeResult(backend=await self._fresh_view(backend), propagated=propagated))

    def command(self, command: Command) -> Handler:
        async def handle(request: Request) -> Response:
            async with self.lock:
                backend = self._backend(request)
                self.local.command(backend.id, command)
                # Not published (reset): false with Redis, null without, like any change without Redis.
                propagated: bool | None = None if self.feed is None else False
                if command in _FLAGS:
                    flag, value = _FLAGS[command]
                    propagated = await self._publish(backend.id, **{flag: value})
            warnings = []
            if command is Command.RESET:
                warnings.append("reset acts on this replica only (each replica probes its own engines)")
            result = ChangeResult(
                backend=await self._fresh_view(backend), propagated=propagated, warnings=warnings
            )
            return json_response(result)

        return handle

    async def hold(self, request: Request) -> Response:
        req = await read_model(request, HoldRequest, self.limit)
        backend = self._on_demand(request)
        status = self.gw.fleet.hold(backend.id, req.duration_s, req.reason)
        return json_response(HoldResult(id=backend.id, on_demand=status))

    async def release_hold(self, request: Request) -> Response:
        backend = self._on_demand(request)
        return json_response(HoldResult(id=backend.id, on_demand=self.gw.fleet.release_hold(backend.id)))

    def _on_demand(self, request: Request) -> Backend:
        backend = self._backend(request)
        if not _is_on_demand(backend.cfg):
            raise Conflict(f"backend {backend.id!r} is not an on-demand engine: nothing to hold", param="id")
        return backend

    async def run_canary(self, request: Request) -> Response:
        backend = self._backend(request)
        gw = self.gw
        result = await Canary.for_backend(gw.client, backend.cfg, gw.canary).run()
        controller = gw.fleet.controllers.get(backend.id)
        if controller is not None:
            controller.last_canary, controller.last_canary_at = result, time.time()
        note = (
            "out-of-band run: the lifecycle state is unchanged; a DOWN backend is re-admitted by "
            "POST .../reset (health probe, then the canary)"
        )
        run = CanaryRun(
            id=backend.id, passed=result.passed, result=result.as_dict(), state=backend.state.value, note=note
        )
        return json_response(run)

    # -- admission ------------------------------------------------------------------------------------

    async def admission(self, _request: Request) -> Response:
        control = self.gw.admission
        if control is None:
            return json_response(AdmissionView(enabled=False))
        return json_response(AdmissionView(enabled=True, **control.status()))

    async def quotas(self, _request: Request) -> Response:
        quotas = self.gw.quotas
        if quotas is None:
            return json_response(QuotasView(enabled=False))
        return json_response(QuotasView(enabled=True, **(await quotas.status())))

    # -- changes ------------------------------------------------------------------------------------

    async def changes(self, request: Request) -> Response:
        """A long poll on this replica's announcements (``backends.changes``): no polling loop anywhere."""
        query = validate(ChangesQuery, dict(request.query_params))
        changes = self.gw.changes
        if changes.version == query.since and query.wait_s > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(query.wait_s):
                    await changes.changed(query.since)
        return json_response(ChangesView(version=changes.version))

    # -- helpers --------------------------------------------------------------------------------------

    def _backend(self, request: Request) -> Backend:
        backend_id = request.path_params["id"]
        backend = self.gw.registry.backends.get(backend_id)
        if backend is None:
            raise UnknownBackend(backend_id)
        return backend

    def _check_new(self, cfg: BackendConfig) -> None:
        if _is_on_demand(cfg):
            raise Unprocessable(
                "on-demand backends are configured in the config file (their group's scheduler is built at "
                "start); they cannot be added at runtime",
                param="managed.on_demand",
            )
        if cfg.managed is not None and not self.gw.admin.allow_managed:
            raise Unprocessable(
                "managed backends cannot be added at runtime unless admin.allow_managed is true "
                "(it runs a command on this host)",
                param="managed",
            )
        if (why := no_embeds(cfg)) is not None:
            raise Unprocessable(why, param="vision")
        try:
            parts = urlsplit(cfg.url)
            port_ok = parts.port is None or parts.port > 0
        except ValueError:
            port_ok = False
        if not parts.hostname or not port_ok or parts.query or parts.fragment:
            raise Unprocessable(
                "url must be http(s)://host[:port][/path] with a valid host and port", param="url"
            )

    async def _publish(self, backend_id: str, **fields: Any) -> bool | None:
        """True/False: Redis took the change or failed; None: no Redis configured (nothing to propagate)."""
        return None if self.feed is None else await self.feed.publish(backend_id, **fields)

    async def _fresh_view(self, backend: Backend) -> BackendView:
        return self._view(backend, await self.gw.store.view(None), {})

    async def _scrape(self, b: Backend) -> dict[str, float]:
        """The engine's own queue and prefix-cache series (``backends.engine_metrics``), read now; {} when
        it exports none or does not answer within ``SCRAPE_TIMEOUT_S``."""
        headers = {"authorization": f"Bearer {b.cfg.api_key}"} if b.cfg.api_key else None
        try:
            async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                found = await scrape(self.gw.client, b.cfg.url, ENGINE_SERIES, headers)
        except TimeoutError:
            return {}
        return found or {}

    def _view(self, b: Backend, view: StoreView, scraped: dict[str, float]) -> BackendView:
        controller = self.gw.fleet.controllers.get(b.id)
        st: dict[str, Any] = controller.status() if controller is not None else {}
        signals = getattr(b, "signals", None)
        return BackendView(
            id=b.id,
            url=b.cfg.url,
            models=list(b.cfg.models),
            weight=b.cfg.weight,
            dialect=b.cfg.dialect.value,
            source="runtime" if b.id in self.local.runtime_ids else "config",
            state=b.state.value,
            reason=str(st.get("reason", "")),
            routable=bool(st.get("routable", False)),
            drained=bool(st.get("drained", False)),
            cordoned=bool(st.get("cordoned", False)),
            circuit=str(st.get("circuit", "closed")),
            probe_failures=int(st.get("probe_failures", 0)),
            in_flight=b.in_flight,
            in_flight_shared=None if view.in_flight is None else view.in_flight.get(b.id, 0),
            pinned_conversations=view.conversations.get(b.id, 0),
            engine_signals={**scraped, **_as_dict(signals)},
            last_error=b.last_error,
            last_checked=b.last_checked,
            canary=st.get("canary"),
            managed=st.get("managed"),
            on_demand=self._on_demand_status(b.id),
        )

    def _on_demand_status(self, backend_id: str) -> dict[str, Any] | None:
        demand = self.gw.fleet.demand
        if demand is None or backend_id not in demand.schedule.engines:
            return None
        return demand.status(backend_id)


def _as_dict(signals: Any) -> dict[str, Any]:
    if signals is None:
        return {}
    if isinstance(signals, dict):
        return dict(signals)
    with contextlib.suppress(TypeError):
        return dict(vars(signals))
    slots = getattr(signals, "__slots__", ())
    return {name: getattr(signals, name, None) for name in slots}


def _is_on_demand(cfg: BackendConfig) -> bool:
    return cfg.managed is not None and cfg.managed.on_demand


def operations(api: AdminApi, routing: RoutingApi) -> list[Operation]:
    ops = [
        Operation(
            "GET", "/backends", api.list_backends, "Every backend with its state and load", BackendList
        ),
        Operation(
            "POST",
            "/backends",
            api.add_backend,
            "Add a backend (a config backends[] entry)",
            ChangeResult,
            BackendConfig,
            201,
            (400, 409, 413, 422),
        ),
        Operation(
            "GET", "/backends/{id}", api.get_backend, "One backend in detail", BackendView, errors=(404,)
        ),
        Operation(
            "PATCH",
            "/backends/{id}",
            api.patch_backend,
            "Change a backend's weight",
            ChangeResult,
            BackendPatch,
            errors=(400, 404, 413, 422),
        ),
        Operation(
            "DELETE",
            "/backends/{id}",
            api.remove_backend,
            "Remove a backend; its conversations re-pin",
            Removed,
            errors=(404,),
        ),
    ]
    for command in _COMMANDS:
        summary = f"Operator command: {command.value}"
        ops.append(
            Operation(
                "POST",
                f"/backends/{{id}}/{command.value}",
                api.command(command),
                summary,
                ChangeResult,
                errors=(404,),
            )
        )
    ops += [
        Operation(
            "POST",
            "/backends/{id}/canary",
            api.run_canary,
            "Run the canary checks now",
            CanaryRun,
            errors=(404,),
        ),
        Operation(
            "POST",
            "/backends/{id}/hold",
            api.hold,
            "Hold an on-demand engine loaded; its group refuses swaps meanwhile",
            HoldResult,
            HoldRequest,
            errors=(400, 404, 409, 413, 422),
        ),
        Operation(
            "DELETE",
            "/backends/{id}/hold",
            api.release_hold,
            "Release an on-demand engine's hold",
            HoldResult,
            errors=(404, 409),
        ),
        *routing_operations(routing),
        Operation(
            "GET", "/admission", api.admission, "Admission queues per class, backends, keys", AdmissionView
        ),
        Operation("GET", "/quotas", api.quotas, "Quota windows per client key (read-only)", QuotasView),
        Operation(
            "GET",
            "/changes",
            api.changes,
            "Wait for a backend state change, addition, removal or pin (long poll)",
            ChangesView,
            errors=(422,),
            query=ChangesQuery,
        ),
    ]
    return ops
