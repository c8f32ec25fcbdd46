"""Shared-state port: where affinity pins and conversation counts live.

``MemoryAffinityStore`` (the default) keeps them in this process; ``gateway.redis_store.RedisAffinityStore``
shares them between workers and replicas behind the same port. The routing decision itself stays pure: the
store only supplies the snapshot (``view``) and applies what the policy decided (``commit``).

Cost contract for shared stores: ``view`` and ``commit`` are at most one round trip each; a routed request
calls ``view`` once and ``commit`` at most once per attempt (a retry that moves the pin commits again).
``started``/``finished`` are plain functions called by the registry's leases: they change local counts,
published with the store's next round trip or heartbeat. So a routed request costs at most two round trips
(three on the retry path). A view is a snapshot: later changes to the store never show through it.
``/v1/responses`` adds one each way (gateway/ownership.py): ``own`` once per stored answer, ``owner`` once
per request naming a stored response (which then commits no pin).

Each store announces the pins its commits claim or move on ``changes`` (``backends.changes``). The admin
plane asks the port what it needs and never the concrete type: ``admin_channel`` (may runtime changes be
published for other replicas, and where), ``pin``/``forget`` (off the request path: their cost is not
under the contract above), ``backends_changed``/``forget_backend`` (a backend added or removed at runtime).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from redis.asyncio import Redis

from backends.changes import ChangeKind, Changes
from config.settings import RoutingConfig
from gateway.redis_keys import RedisKeys
from routing.affinity import AffinityTable
from routing.types import Decision, PinAction

# For ``commit`` (once per placed request): on Python 3.11 every ``PinAction.X`` / ``ChangeKind.X`` is a class
# attribute load through ``EnumType.__getattr__``'s slow hook (~0.25 us each).
_TOUCH, _CLAIM, _MOVE = PinAction.TOUCH, PinAction.CLAIM, PinAction.MOVE
_PIN = ChangeKind.PIN


# Slotted, not frozen (as ``routing.types.RouteRequest``): one is built per routed request, and a frozen
# dataclass's ``__init__`` sets each field through ``object.__setattr__`` (~5k instructions for these
# three). The proxy and the policies treat it as a read-only snapshot.
@dataclass(slots=True)
class StoreView:
    pinned: str | None
    conversations: Mapping[str, int]
    #: In-flight counts shared across replicas; None means "use this process's own counts".
    in_flight: Mapping[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Pin:
    backend: str
    expires_in_s: float | None  # None: the pin has no expiry


@dataclass(frozen=True, slots=True)
class AdminChannel:
    """Where runtime backend changes are published for the other replicas (a shared store's Redis)."""

    redis: Redis
    keys: RedisKeys


class AffinityStore(Protocol):
    #: Announces every pin a commit claims or moves.
    changes: Changes
    #: Whether ``commit`` is a round trip (other requests are routed while it is awaited): the proxy then
    #: counts the decision on its backend until the commit returns. A store without it is taken as True.
    commit_is_round_trip: bool

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

    # -- /v1/responses ids: which engine holds each one's state (gateway/ownership.py) --------------

    async def own(self, response_id: str, backend: str) -> None:
        """Record ``backend`` as the owner of ``response_id`` for ``routing.response_owner_ttl_s``; visible
        to every replica sharing the store once this returns. One round trip; never raises."""
        ...

    async def owner(self, response_id: str) -> str | None:
        """The backend that owns ``response_id``, or None (never recorded, expired). One round trip."""
        ...

    async def aclose(self) -> None: ...

    # -- the admin plane (never on the request path) ----------------------------------------------

    def admin_channel(self) -> AdminChannel | None:
        """Where runtime changes are published for other replicas; None: this store is not shared."""
        ...

    async def pin(self, key: str) -> Pin | None:
        """The pin of ``key`` and how long it has left, or None."""
        ...

    async def forget(self, key: str) -> str | None:
        """Drop the pin of ``key``; the backend it named, or None if there was none."""
        ...

    def backends_changed(self, backends: Sequence[str]) -> None:
        """The configured backends after a runtime addition or removal (no I/O)."""
        ...

    async def forget_backend(self, backend: str) -> None:
        """A removed backend's shared counts go (its pins stay: they re-pin on their next turn)."""
        ...


class MemoryAffinityStore:
    commit_is_round_trip = False  # its commit never suspends: nothing is routed in between

    def __init__(
        self,
        cfg: RoutingConfig,
        clock: Callable[[], float] = time.monotonic,
        changes: Changes | None = None,
    ) -> None:
        self.table = AffinityTable(cfg.affinity_ttl_s, cfg.affinity_max_entries)
        #: /v1/responses id -> the backend holding its state (no pin: never counted as a conversation).
        self.owners = AffinityTable(cfg.response_owner_ttl_s, cfg.affinity_max_entries)
        self.clock = clock
        self.changes = changes if changes is not None else Changes()

    async def start(self) -> None:
        return None

    async def view(self, key: str | None) -> StoreView:
        pinned = self.table.get(key, self.clock()) if key is not None else None
        return StoreView(pinned, dict(self.table.counts()))  # a copy: the table changes under later awaits

    async def commit(self, key: str, decision: Decision) -> str:
        assert decision.backend is not None
        now = self.clock()
        if decision.pin is _TOUCH:
            self.table.touch(key, now)
        elif decision.pin is _CLAIM:
            winner = self.table.claim(key, decision.backend, now)
            self.changes.notify(_PIN, key, winner)
            return winner
        elif decision.pin is _MOVE:
            self.table.move(key, decision.backend, now)
            self.changes.notify(_PIN, key, decision.backend)
        return decision.backend

    def started(self, backend: str) -> None:
        return None

    def finished(self, backend: str) -> None:
        return None

    async def own(self, response_id: str, backend: str) -> None:
        self.owners.move(response_id, backend, self.clock())

    async def owner(self, response_id: str) -> str | None:
        return self.owners.get(response_id, self.clock())

    def status(self) -> dict[str, object]:
        return {"backend": "memory", "degraded": False, "entries": len(self.table)}

    async def aclose(self) -> None:
        return None

    def admin_channel(self) -> AdminChannel | None:
        return None

    async def pin(self, key: str) -> Pin | None:
        now = self.clock()
        backend = self.table.get(key, now)
        entry = self.table.entry(key)
        if backend is None or entry is None:
            return None
        return Pin(backend, max(0.0, entry[1] - now))

    async def forget(self, key: str) -> str | None:
        self.table.expire(self.clock())
        return self.table.forget(key)

    def backends_changed(self, backends: Sequence[str]) -> None:
        return None

    async def forget_backend(self, backend: str) -> None:
        return None
