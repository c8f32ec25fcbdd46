"""Backend changes at runtime, applied to one replica: add, remove, operator commands, weight.

``LocalChanges`` is the one place that knows every part a backend touches (registry, lifecycle controller,
health probing, shared counts, pooled connections, metric series). The admin API calls it for a change
made here; the change feed (``gateway.admin.sync``) calls it for a change another replica made. Every
method is idempotent in effect, so applying a change twice (ours, echoed back by the feed) is harmless.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from backends.changes import ChangeKind
from backends.events import Command, Operator
from backends.registry import Backend
from config.settings import BackendConfig
from gateway.admin.ports import AdminPorts

log = logging.getLogger("warmroute.admin")


@dataclass(slots=True)
class Removal:
    backend: Backend
    in_flight: int
    orphaned_models: list[str]
    connections_closed: int


@dataclass(slots=True)
class LocalChanges:
    gw: AdminPorts
    #: Backends this replica runs that were added at runtime (the rest came from the config file).
    runtime_ids: set[str] = field(default_factory=set)

    def add(self, cfg: BackendConfig) -> Backend:
        """Register and start a backend; ValueError if its id is taken. It takes traffic once its health
        probe and canary pass, like any backend at start-up."""
        gw = self.gw
        gw.fleet.add(cfg)
        backend = gw.registry.backends[cfg.id]
        self._share_counts()
        gw.health.watch(backend)  # idempotent: the checker's own start() finds it watched
        self.runtime_ids.add(cfg.id)
        log.warning("backend %s added at runtime (%s, models %s)", cfg.id, cfg.url, ", ".join(cfg.models))
        return backend

    async def remove(self, backend_id: str) -> Removal:
        """Unregister a backend and clean up after it; KeyError if unknown."""
        gw = self.gw
        backend = await gw.fleet.remove(backend_id)  # from now on no request is routed there
        await gw.health.unwatch(backend_id)
        self._share_counts()
        await gw.store.forget_backend(backend_id)
        gw.metrics.forget_backend(backend_id)
        closed = gw.transport.close_origin(backend.cfg.url)
        self.runtime_ids.discard(backend_id)
        orphaned = [m for m in backend.cfg.models if not gw.registry.serves(m)]
        log.warning(
            "backend %s removed at runtime (%d requests still in flight there%s)",
            backend_id,
            backend.in_flight,
            f"; models now without a backend: {', '.join(orphaned)}" if orphaned else "",
        )
        return Removal(backend, backend.in_flight, orphaned, closed)

    def command(self, backend_id: str, command: Command) -> None:
        """An operator command to the backend's lifecycle; KeyError if unknown."""
        self.gw.fleet.controllers[backend_id].send(Operator(command))

    def reconfigure(self, cfg: BackendConfig) -> Backend:
        """A config change that needs no restart (weight); ValueError if it changes url or models."""
        backend = self.gw.registry.reconfigure(cfg)
        self.gw.changes.notify(ChangeKind.RECONFIGURED, cfg.id)
        log.warning("backend %s reconfigured at runtime (weight %g)", cfg.id, cfg.weight)
        return backend

    def _share_counts(self) -> None:
        self.gw.store.backends_changed(list(self.gw.registry.backends))
