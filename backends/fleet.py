"""``Fleet``: one ``BackendController`` per configured backend, and the seams to everything that feeds them.

The controllers are the one writer of each backend's lifecycle; ``Fleet`` mirrors every change into the
registry's ``Backend`` (what routing reads) and is the sink of the health checker (probe results become
``ProbeOk``/``ProbeFailed`` events) and of the proxy (request outcomes feed the circuit breaker).

Mirroring rule: ``Backend.state`` is the lifecycle state, and ``Backend.circuit_open`` is set while the
circuit is open; ``Registry.candidates`` shows such a backend to routing as DOWN, so it takes no new work and
its pinned conversations re-pin (``repin_unhealthy``) until the breaker lets a trial through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

import httpx

from backends.breaker import CircuitState
from backends.changes import ChangeKind, Changes
from backends.demand import Claim, Demand, on_demand, scheduler_policy
from backends.events import ConfigRemoved, ProbeFailed, ProbeOk
from backends.lifecycle import Lifecycle
from backends.managed import BackendController
from backends.registry import Backend, Registry
from config.settings import BackendConfig, Settings
from routing.types import BackendState

log = logging.getLogger("warmroute.fleet")


class Fleet:
    """Owns the controllers: ``start()`` and ``aclose()`` in the app's lifespan."""

    def __init__(
        self,
        registry: Registry,
        settings: Settings,
        client: httpx.AsyncClient,
        make: Callable[..., BackendController] = BackendController.from_settings,
        changes: Changes | None = None,
    ) -> None:
        self.registry = registry
        #: Announces every lifecycle state change, addition and removal (``backends.changes``).
        self.changes = changes if changes is not None else Changes()
        self.settings = settings
        self.controllers: dict[str, BackendController] = {}
        self._client = client
        self._make = make
        self._started = False
        self.demand: Demand | None = None  # on-demand engines (backends/ondemand.py), if any is configured
        for cfg in settings.backends:
            self._control(cfg, registry.backends[cfg.id])
        if any(on_demand(cfg) for cfg in settings.backends):
            self.demand = Demand(scheduler_policy(settings), self.controllers, self._in_flight)

    def start(self) -> None:
        self._started = True
        for controller in self.controllers.values():
            controller.start()

    # -- runtime changes (the admin API) ------------------------------------------------------------------

    def add(self, cfg: BackendConfig) -> BackendController:
        """Register ``cfg`` with a controller (started at once if the fleet runs); ValueError if taken."""
        controller = self._control(cfg, self.registry.add(cfg))
        self.changes.notify(ChangeKind.ADDED, cfg.id)
        if self._started:
            controller.start()
        return controller

    async def remove(self, backend_id: str) -> Backend:
        """Unregister a backend (no new request is routed to it from now on), then end its lifecycle: a
        managed engine is stopped. KeyError if unknown. Requests in flight there finish on their own."""
        controller = self.controllers.pop(backend_id)
        backend = self.registry.remove(backend_id)
        self.changes.notify(ChangeKind.REMOVED, backend_id)
        controller.send(ConfigRemoved())
        await controller.aclose()
        return backend

    def _control(self, cfg: BackendConfig, backend: Backend) -> BackendController:
        controller = self._make(cfg, self.settings, self._client, self._mirror(backend))
        self.controllers[cfg.id] = controller
        return controller

    async def aclose(self) -> None:
        """Stop every controller at once: managed engines get their stop command or SIGTERM, then SIGKILL."""
        if self.demand is not None:
            await self.demand.aclose()
        await asyncio.gather(*(c.aclose() for c in self.controllers.values()))

    async def settled(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until no backend is running its canary: at start-up, so that a
        healthy cluster takes traffic as soon as the gateway listens."""
        with contextlib.suppress(TimeoutError):
            await self.changes.wait(
                lambda: all(c.lifecycle.state is not BackendState.CANARY for c in self.controllers.values()),
                timeout_s,
            )

    # -- the health checker's sink ------------------------------------------------------------------------

    def probed(self, backend_id: str, error: str | None) -> None:
        controller = self.controllers.get(backend_id)
        if controller is not None:
            controller.send(ProbeOk() if error is None else ProbeFailed(error))

    # -- the proxy's feed ---------------------------------------------------------------------------------

    def admit(self, backend_id: str) -> bool:
        """May a new request go to this backend now (takes the breaker's single half-open trial)?"""
        controller = self.controllers.get(backend_id)
        return controller is None or controller.admit_request()

    def outcome(self, backend_id: str, ok: bool) -> None:
        """A success, or a failure only the engine explains."""
        controller = self.controllers.get(backend_id)
        if controller is not None:
            controller.record_request(ok)

    def answer_failed(self, backend_id: str, client: str) -> None:
        """An HTTP 5xx no other engine confirmed: a failure, counted per client (``backends.breaker``)."""
        controller = self.controllers.get(backend_id)
        if controller is not None:
            controller.record_request(False, client)

    def abstain(self, backend_id: str) -> None:
        """A failure that was the request's own: nothing for the breaker."""
        controller = self.controllers.get(backend_id)
        if controller is not None:
            controller.abstain_request()

    def unreachable(self, backend_id: str, error: str) -> None:
        """A connect error on real traffic: a breaker failure, and conclusive for health (nothing listens
        there), so it counts as ``fail_threshold`` failed probes: DOWN at once, its pins move."""
        controller = self.controllers.get(backend_id)
        if controller is not None:
            controller.record_request(False)
            for _ in range(controller.policy.fail_threshold):
                controller.send(ProbeFailed(error))

    # -- on-demand engines ----------------------------------------------------------------------------------

    async def ready_for(self, model: str | None) -> Claim | None:
        """None at once unless ``model`` is served on demand; else wait for a READY engine (starting one) and
        return the claim the request holds until it is finished. Raises ``demand.EngineUnavailable``."""
        if self.demand is None or model is None or not self.demand.serves(model):
            return None
        return await self.demand.ready_for(model)

    def hold(self, backend_id: str, duration_s: float, reason: str) -> dict[str, Any]:
        """Keep an on-demand engine loaded (start it if stopped) and its group refusing swaps for
        ``duration_s``; other models of the group get a 503 naming the hold. ``KeyError``: not on demand;
        ``ValueError``: ``duration_s`` not above 0."""
        if self.demand is None:
            raise KeyError(backend_id)
        return self.demand.hold(backend_id, duration_s, reason)

    def release_hold(self, backend_id: str) -> dict[str, Any]:
        if self.demand is None:
            raise KeyError(backend_id)
        return self.demand.release_hold(backend_id)

    def startable(self) -> bool:
        """Can a request be served by starting an engine (for /readyz: a zoo of stopped engines is ready)?"""
        return self.demand is not None and bool(self.demand.policy.engines)

    # -- read side ------------------------------------------------------------------------------------------

    def status(self) -> dict[str, dict[str, Any]]:
        out = {bid: c.status() for bid, c in self.controllers.items()}
        if self.demand is not None:
            for bid in self.demand.schedule.engines:
                out[bid]["on_demand"] = self.demand.status(bid)
        return out

    def _in_flight(self, ids: Iterable[str]) -> dict[str, int]:
        return {bid: self.registry.backends[bid].in_flight for bid in ids if bid in self.registry.backends}

    def _mirror(self, backend: Backend) -> Callable[[Lifecycle], None]:
        def on_change(lc: Lifecycle) -> None:
            backend.state = lc.state
            backend.circuit_open = lc.circuit is CircuitState.OPEN
            if self.demand is not None:
                self.demand.lifecycle_changed(backend.id, lc)
            self.changes.notify(ChangeKind.STATE, backend.id, lc.state.value)  # after the mirror

        return on_change
