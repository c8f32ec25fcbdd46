"""Shared-state port: where affinity pins and conversation counts live.

``MemoryAffinityStore`` (the default) keeps them in this process; ``gateway.redis_store.RedisAffinityStore``
shares them between workers and replicas behind the same port. The routing decision itself stays pure: the
store only supplies the snapshot (``view``) and applies what the policy decided (``commit``).

Cost contract for shared stores: ``view`` and ``commit`` are at most one round trip each; a routed request
calls ``view`` once and ``commit`` at most once per attempt (a retry that moves the pin commits again).
``started``/``finished`` are plain functions called by the registry's leases: they change local counts,
published with the store's next round trip or heartbeat. So a routed request costs at most two round trips
(three on the retry path). A view is a snapshot: later changes to the store never show through it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from config.settings import RoutingConfig
from routing.affinity import AffinityTable
from routing.types import Decision, PinAction


@dataclass(frozen=True, slots=True)
class StoreView:
    pinned: str | None
    conversations: Mapping[str, int]
    #: In-flight counts shared across replicas; None means "use this process's own counts".
    in_flight: Mapping[str, int] | None = None


class AffinityStore(Protocol):
    async def start(self) -> None:
        """Connect and start background work (called by the app's lifespan). Must not raise on outages."""
        ...

    async def view(self, key: str | None) -> StoreView:
        """The pin for ``key`` (None: don't look one up) and the per-backend counts."""
        ...

    async def commit(self, key: str, decision: Decision) -> str:
        """Apply ``decision.pin``; return the backend to use (a CLAIM may lose to another replica)."""
        ...

    def started(self, backend: str) -> None:
        """A request to ``backend`` began (called by ``Registry.lease``; no I/O)."""
        ...

    def finished(self, backend: str) -> None:
        """A request to ``backend`` ended (called when the lease is released; no I/O)."""
        ...

    def status(self) -> dict[str, object]:
        """Shown by /readyz: at least {"backend": name, "degraded": bool}."""
        ...

    async def aclose(self) -> None: ...


class MemoryAffinityStore:
    def __init__(self, cfg: RoutingConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.table = AffinityTable(cfg.affinity_ttl_s, cfg.affinity_max_entries)
        self.clock = clock

    async def start(self) -> None:
        return None

    async def view(self, key: str | None) -> StoreView:
        pinned = self.table.get(key, self.clock()) if key is not None else None
        return StoreView(pinned, dict(self.table.counts()))  # a copy: the table changes under later awaits

    async def commit(self, key: str, decision: Decision) -> str:
        assert decision.backend is not None
        now = self.clock()
        if decision.pin is PinAction.TOUCH:
            self.table.touch(key, now)
        elif decision.pin is PinAction.CLAIM:
            return self.table.claim(key, decision.backend, now)
        elif decision.pin is PinAction.MOVE:
            self.table.move(key, decision.backend, now)
        return decision.backend

    def started(self, backend: str) -> None:
        return None

    def finished(self, backend: str) -> None:
        return None

    def status(self) -> dict[str, object]:
        return {"backend": "memory", "degraded": False, "entries": len(self.table)}

    async def aclose(self) -> None:
        return None
