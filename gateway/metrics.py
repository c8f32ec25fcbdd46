"""All Prometheus collectors, in one place, on a per-app registry (several apps can share a process).

Label values come only from enums and configuration (backend ids, reasons), never from client input.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from backends.registry import Registry
from gateway.outcomes import AttemptOutcome, RequestOutcome
from routing.types import BackendState, Reason

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_BUCKET_LABELS = tuple(repr(float(bound)) for bound in _LATENCY_BUCKETS)  # "1.0", as Prometheus writes them


class Metrics:
    """Every collector of the gateway. The per-request series are tallied in plain dicts and read at scrape
    time: prometheus_client's own children take a lock and run two checks per ``inc``, seven times a request,
    which measured ~6 % of the hot path's CPU."""

    def __init__(self, backends: Registry) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.tally = _Tally()
        r.register(self.tally)
        self.degraded = Gauge(
            "warmroute_shared_state_degraded", "1 while the shared state store is unreachable", registry=r
        )
        r.register(_BackendCollector(backends))

    def decision(self, reason: Reason) -> None:
        self.tally.decisions[reason] += 1

    def attempt(self, backend: str, outcome: AttemptOutcome) -> None:
        attempts = self.tally.attempts
        key = (backend, outcome)
        attempts[key] = attempts.get(key, 0) + 1

    def finished(self, backend: str, reasons: list[str]) -> None:
        """``finish_reason`` values of one response (bounded: ``gateway.guard.FINISH_REASONS`` or other)."""
        counts = self.tally.finish_reasons
        for reason in reasons:
            key = (backend, reason)
            counts[key] = counts.get(key, 0) + 1

    def guard_tripped(self, backend: str, action: str) -> None:
        trips = self.tally.guard_trips
        key = (backend, action)
        trips[key] = trips.get(key, 0) + 1

    def request(
        self, backend: str, outcome: RequestOutcome, duration_s: float, first_byte_s: float | None
    ) -> None:
        """One client request is over (``backend`` empty when none was chosen)."""
        tally = self.tally
        key = (backend, outcome)
        tally.requests[key] = tally.requests.get(key, 0) + 1
        if not backend:
            return
        timing = tally.timings.get(backend)
        if timing is None:
            timing = tally.timings[backend] = (_Histogram(), _Histogram())
        timing[0].observe(duration_s)
        if first_byte_s is not None:
            timing[1].observe(first_byte_s)

    def budget_attempt(self, enforced: str) -> None:
        """An attempt carrying a thinking budget: ``native``, ``gateway`` or ``off`` (thinking turned off)."""
        self.tally.budgets[enforced] = self.tally.budgets.get(enforced, 0) + 1

    def thinking(self, *, truncated: bool, reasoning_tokens: int) -> None:
        """A gateway-enforced request is over (only that path reads the reasoning it relays)."""
        self.tally.truncations += truncated
        self.tally.reasoning_tokens += reasoning_tokens


class _Histogram:
    __slots__ = ("buckets", "count", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * len(_LATENCY_BUCKETS)  # non-cumulative; +Inf is ``count``
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(_LATENCY_BUCKETS, value)
        if i < len(self.buckets):
            self.buckets[i] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for label, n in zip(_BUCKET_LABELS, self.buckets, strict=True):
            running += n
            out.append((label, float(running)))
        out.append(("+Inf", float(self.count)))
        return out


class _Tally(Collector):
    """The hot path's counters and histograms, as plain numbers; families are built at scrape time."""

    def __init__(self) -> None:
        self.decisions: dict[Reason, int] = dict.fromkeys(Reason, 0)  # every reason shows, zero or not
        self.attempts: dict[tuple[str, AttemptOutcome], int] = {}
        self.requests: dict[tuple[str, RequestOutcome], int] = {}
        self.timings: dict[str, tuple[_Histogram, _Histogram]] = {}  # backend -> (duration, first byte)
        self.budgets: dict[str, int] = {}  # thinking budgets by enforcement (gateway/budgets.py)
        self.truncations = 0  # gateway-enforced budgets that cut the reasoning and continued
        self.reasoning_tokens = 0  # reasoning tokens of gateway-enforced requests
        self.finish_reasons: dict[tuple[str, str], int] = {}
        self.guard_trips: dict[tuple[str, str], int] = {}

    def collect(self) -> Iterator[CounterMetricFamily | HistogramMetricFamily]:
        decisions = CounterMetricFamily(
            "warmroute_routing_decisions", "Routing decisions by reason", labels=["reason"]
        )
        for reason, n in self.decisions.items():
            decisions.add_metric([reason.value], n)
        attempts = CounterMetricFamily(
            "warmroute_upstream_attempts",
            "Upstream attempts by backend and outcome (a retried request makes two)",
            labels=["backend", "outcome"],
        )
        for (backend, outcome), n in list(self.attempts.items()):
            attempts.add_metric([backend, outcome.value], n)
        requests = CounterMetricFamily(
            "warmroute_requests",
            "Client requests by the backend that answered (empty: none) and outcome",
            labels=["backend", "outcome"],
        )
        for (backend, req_outcome), n in list(self.requests.items()):
            requests.add_metric([backend, req_outcome.value], n)
        duration = HistogramMetricFamily(
            "warmroute_request_duration_seconds", "Whole proxied request, stream included", labels=["backend"]
        )
        first_byte = HistogramMetricFamily(
            "warmroute_upstream_first_byte_seconds",
            "Time from the request's arrival to the first body byte from the engine (TTFT when streaming)",
            labels=["backend"],
        )
        for backend, (whole, first) in list(self.timings.items()):
            duration.add_metric([backend], whole.cumulative(), whole.sum)
            first_byte.add_metric([backend], first.cumulative(), first.sum)
        yield from (decisions, attempts, requests, duration, first_byte)
        yield from self._output()
        yield from self._thinking()

    def _output(self) -> Iterator[CounterMetricFamily]:
        finish = CounterMetricFamily(
            "warmroute_finish_reasons",
            "finish_reason of proxied answers (a rising length share: an engine looping to its limit)",
            labels=["backend", "reason"],
        )
        for (backend, finish_reason), n in list(self.finish_reasons.items()):
            finish.add_metric([backend, finish_reason], n)
        trips = CounterMetricFamily(
            "warmroute_output_guard_trips",
            "Streams the output guard found degenerate (one unit repeated), by the action taken",
            labels=["backend", "action"],
        )
        for (backend, action), n in list(self.guard_trips.items()):
            trips.add_metric([backend, action], n)
        yield from (finish, trips)

    def _thinking(self) -> Iterator[CounterMetricFamily]:
        budgets = CounterMetricFamily(
            "warmroute_thinking_budget_attempts", "Attempts carrying a thinking budget", labels=["enforced"]
        )
        for enforced in ("native", "gateway", "off"):
            budgets.add_metric([enforced], self.budgets.get(enforced, 0))
        yield budgets
        yield CounterMetricFamily(
            "warmroute_thinking_truncations",
            "Reasoning cut at the budget by the gateway",
            value=self.truncations,
        )
        yield CounterMetricFamily(
            "warmroute_reasoning_tokens",
            "Reasoning tokens of gateway-enforced requests",
            value=self.reasoning_tokens,
        )


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
        yield from _routing_signals(self.backends)


def _routing_signals(registry: Registry) -> Iterator[GaugeMetricFamily]:
    """Routing v2's view of each backend: learned prefill rate, queued prefill, the engine's last signals."""
    tps = GaugeMetricFamily(
        "warmroute_backend_prefill_tokens_per_second",
        "Learned prefill rate (ttft policy)",
        labels=["backend"],
    )
    queued = GaugeMetricFamily(
        "warmroute_backend_prefill_queued_tokens",
        "Estimated uncached prompt tokens of requests awaiting their first byte (ttft policy)",
        labels=["backend"],
    )
    engine = GaugeMetricFamily(
        "warmroute_engine_signal",
        "The engine's own /metrics at the last scrape (ttft policy); counters keep their _total name",
        labels=["backend", "signal"],
    )
    for b in registry.backends.values():
        tps.add_metric([b.id], b.prefill_tps)
        queued.add_metric([b.id], b.prefilling)
        if b.signals is not None:
            for name, value in b.signals.readings():
                engine.add_metric([b.id, name], value)
    yield from (tps, queued, engine)
