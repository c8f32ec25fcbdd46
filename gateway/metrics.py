"""All Prometheus collectors, in one place, on a per-app registry (several apps can share a process).

Label values come only from enums and configuration (backend ids, reasons), never from client input.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from backends.registry import Registry
from gateway.outcomes import AttemptOutcome, RequestOutcome
from routing.types import BackendState, Reason

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self, backends: Registry) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.decisions = Counter(
            "warmroute_routing_decisions_total", "Routing decisions by reason", ["reason"], registry=r
        )
        self.attempts = Counter(
            "warmroute_upstream_attempts_total",
            "Upstream attempts by backend and outcome (a retried request makes two)",
            ["backend", "outcome"],
            registry=r,
        )
        self.requests = Counter(
            "warmroute_requests_total",
            "Client requests by the backend that answered (empty: none) and outcome",
            ["backend", "outcome"],
            registry=r,
        )
        self.ttfb = Histogram(
            "warmroute_upstream_first_byte_seconds",
            "Time from the request's arrival to the first body byte from the engine (TTFT when streaming)",
            ["backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "warmroute_request_duration_seconds",
            "Whole proxied request, stream included",
            ["backend"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.degraded = Gauge(
            "warmroute_shared_state_degraded", "1 while the shared state store is unreachable", registry=r
        )
        r.register(_BackendCollector(backends))
        self._decision_children = {reason: self.decisions.labels(reason.value) for reason in Reason}
        # Label children are cached: these run on every request.
        self._attempt_children: dict[tuple[str, AttemptOutcome], Any] = {}
        self._request_children: dict[tuple[str, RequestOutcome], Any] = {}
        self._timings: dict[str, tuple[Any, Any]] = {}

    def decision(self, reason: Reason) -> None:
        self._decision_children[reason].inc()

    def attempt(self, backend: str, outcome: AttemptOutcome) -> None:
        key = (backend, outcome)
        child = self._attempt_children.get(key)
        if child is None:
            child = self._attempt_children[key] = self.attempts.labels(backend, outcome.value)
        child.inc()

    def request(
        self, backend: str, outcome: RequestOutcome, duration_s: float, first_byte_s: float | None
    ) -> None:
        """One client request is over (``backend`` empty when none was chosen)."""
        key = (backend, outcome)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(backend, outcome.value)
        child.inc()
        if not backend:
            return
        timing = self._timings.get(backend)
        if timing is None:
            timing = self._timings[backend] = (self.duration.labels(backend), self.ttfb.labels(backend))
        timing[0].observe(duration_s)
        if first_byte_s is not None:
            timing[1].observe(first_byte_s)


class _BackendCollector(Collector):
    """Reads live backend state at scrape time instead of mirroring it into gauges on every change."""

    def __init__(self, backends: Registry) -> None:
        self.backends = backends

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "warmroute_backend_in_flight", "Requests in flight per backend (this process)", labels=["backend"]
        )
        state = GaugeMetricFamily(
            "warmroute_backend_state", "1 for the backend's current state", labels=["backend", "state"]
        )
        for b in self.backends.backends.values():
            in_flight.add_metric([b.id], b.in_flight)
            for s in BackendState:
                state.add_metric([b.id, s.value], 1.0 if b.state is s else 0.0)
        yield in_flight
        yield state
