"""Registry of configured backends, their states and their in-flight counts.

Single-threaded by design (one event loop): counters are plain ints mutated without awaits in between.
The registry knows nothing of routing rules; it produces ``Candidate`` snapshots for ``routing`` to decide on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from backends.signals import EngineSignals
from config.settings import BackendConfig
from routing.types import BackendState, Candidate

#: Engine signals older than this are ignored (a scrape every 2 s; three missed ones make them stale).
SIGNALS_MAX_AGE_S = 6.0


@dataclass(slots=True)
class Backend:
    cfg: BackendConfig
    state: BackendState = BackendState.STARTING  # written by its lifecycle controller (backends.fleet)
    circuit_open: bool = False  # its breaker refuses requests: routing sees it as DOWN
    in_flight: int = 0
    last_error: str | None = None  # of the last failed health probe (the probe's own log de-duplication)
    last_checked: float | None = None
    #: Estimated uncached prompt tokens of requests here that have had no first byte yet (the ttft policy).
    prefilling: int = 0
    prefill_tps: float = 0.0  # learned (gateway.learning); 0: unknown
    retention: float = 1.0  # learned share of expected cached prefix the engine held (gateway.learning)
    signals: EngineSignals | None = None  # the last scrape of its /metrics (backends.engine_metrics)
    placed_at: float = float("-inf")  # monotonic time it was last given a new conversation (``placed``)
    #: Conversations competing for its KV cache (recently active; gateway.learning); -1: unknown.
    competing: int = -1
    #: ``cfg.id`` (a re-configured backend keeps its id), a plain attribute: the request path reads it ~6
    #: times, and a property is a Python call each time.
    id: str = field(init=False)

    def __post_init__(self) -> None:
        self.id = self.cfg.id

    @property
    def routing_state(self) -> BackendState:
        """What routing is shown: an open circuit takes a READY backend out like an outage would."""
        return BackendState.DOWN if self.circuit_open else self.state


class LeaseListener(Protocol):
    """Told of every lease taken and released (the shared-state store publishes the counts). No I/O."""

    def started(self, backend: str) -> None: ...

    def finished(self, backend: str) -> None: ...


class _NoListener:
    def started(self, backend: str) -> None:
        return None

    def finished(self, backend: str) -> None:
        return None


@dataclass(slots=True)
class Lease:
    """One request's claim on a backend's capacity: the only in-flight ledger. ``release`` is idempotent."""

    backend: Backend
    listener: LeaseListener
    released: bool = field(default=False)
    prefill_tokens: int = 0  # counted in ``backend.prefilling`` until the first byte (or the release)
    queued_tokens: int = 0  # ``backend.prefilling`` ahead of this request when it was sent
    #: Called once at the engine's first byte (not on a release without one): the learned prefill rate's
    #: busy time, taken in the order first bytes come (``gateway.learning``).
    on_first_byte: Callable[[], None] | None = None

    def prefill(self, tokens: int) -> None:
        """This request will prefill about ``tokens`` uncached tokens: queue them until its first byte."""
        self.queued_tokens = self.backend.prefilling
        self.prefill_tokens = tokens
        self.backend.prefilling += tokens

    def first_byte(self) -> None:
        hook = self.on_first_byte
        if hook is not None:
            self.on_first_byte = None
            hook()
        if self.prefill_tokens:
            self.backend.prefilling -= self.prefill_tokens
            self.prefill_tokens = 0

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.on_first_byte = None  # released without a first byte (or after it): nothing to time
            self.first_byte()
            self.backend.in_flight -= 1
            self.listener.finished(self.backend.id)


class _Backends(dict[str, Backend]):
    """The registered backends. ``[id]`` also finds one removed at runtime, so a request routed just before
    the removal still gets its lease and finishes; ``in``, ``get`` and iteration see registered ones only."""

    def __init__(self) -> None:
        super().__init__()
        self.retired: dict[str, Backend] = {}

    def __missing__(self, backend_id: str) -> Backend:
        return self.retired[backend_id]  # KeyError for an id never known


class Registry:
    def __init__(self, configs: Iterable[BackendConfig], listener: LeaseListener | None = None) -> None:
        self.listener: LeaseListener = listener or _NoListener()
        self._registered = _Backends()
        self.backends: dict[str, Backend] = self._registered
        self._by_model: dict[str, list[Backend]] = {}
        for c in configs:
            self.add(c)

    # -- runtime changes (the admin API): the snapshot routing sees changes with the next request ------

    def add(self, cfg: BackendConfig) -> Backend:
        """Register a backend (STARTING until its lifecycle says otherwise); ValueError if the id is taken."""
        if cfg.id in self.backends:
            raise ValueError(f"backend {cfg.id!r} already exists")
        b = self.backends[cfg.id] = Backend(cfg)
        self._registered.retired.pop(cfg.id, None)
        for model in cfg.models:
            self._by_model.setdefault(model, []).append(b)
        return b

    def remove(self, backend_id: str) -> Backend:
        """Unregister a backend; KeyError if unknown. Its leases still release into the returned object, and
        its conversations' pins stay: routing no longer finds the pinned backend (``repin_removed``)."""
        b = self._registered.retired[backend_id] = self.backends.pop(backend_id)
        for model in b.cfg.models:
            left = [x for x in self._by_model[model] if x is not b]
            if left:
                self._by_model[model] = left
            else:
                del self._by_model[model]
        return b

    def reconfigure(self, cfg: BackendConfig) -> Backend:
        """Replace the config of a backend whose models and URL stay the same (weight, say)."""
        b = self.backends[cfg.id]
        if (cfg.url, cfg.models) != (b.cfg.url, b.cfg.models):
            raise ValueError("url and models cannot change in place; remove and add the backend")
        b.cfg = cfg
        return b

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def serves(self, model: str) -> bool:
        return model in self._by_model

    def for_model(self, model: str | None) -> list[Backend]:
        if model is None:
            return list(self.backends.values())
        return self._by_model.get(model, [])

    def candidates(
        self,
        model: str | None,
        conversations: Mapping[str, int],
        in_flight: Mapping[str, int] | None,
        now: float,
    ) -> tuple[Candidate, ...]:
        """The one snapshot every policy decides on: each backend serving ``model`` with every signal.

        ``conversations``: per backend, pinned ones (affinity) or active ones (ttft); ``in_flight``: counts
        shared by other replicas, replacing the local ones (None: this process's leases); ``now``: monotonic
        time, for the engine signals' freshness. A policy reads the fields it needs; the others cost a slot.
        """
        count = conversations.get
        out = []
        for b in self.for_model(model):
            cfg, s = b.cfg, b.signals
            waiting, capacity = -1, 0
            if s is not None:
                if s.waiting is not None and now - s.at <= SIGNALS_MAX_AGE_S:
                    waiting = int(s.waiting)
                if s.kv_capacity is not None:  # a configuration: it does not go stale
                    capacity = int(s.kv_capacity)
            flying = b.in_flight if in_flight is None else in_flight.get(cfg.id, 0)
            out.append(Candidate(cfg.id, b.routing_state, flying, count(cfg.id, 0), cfg.weight,
                                 b.prefilling, b.prefill_tps, waiting, b.retention, capacity,
                                 b.placed_at, b.competing))  # fmt: skip
        return tuple(out)

    def placed(self, backend_id: str, now: float) -> None:
        """``backend_id`` was given a new conversation at ``now`` (monotonic): ``Candidate.placed_at``."""
        b = self.backends.get(backend_id)
        if b is not None:
            b.placed_at = now

    def lease(self, backend_id: str) -> Lease:
        """Count one request on ``backend_id`` until the returned lease is released."""
        b = self.backends[backend_id]
        b.in_flight += 1
        self.listener.started(backend_id)
        return Lease(b, self.listener)

    def any_ready(self) -> bool:
        return any(b.routing_state is BackendState.READY for b in self.backends.values())

    def total_in_flight(self) -> int:
        return sum(b.in_flight for b in self.backends.values())
