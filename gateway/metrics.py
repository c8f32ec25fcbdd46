"""All Prometheus collectors, in one place, on a per-app registry (several apps can share a process).

Label values come only from enums and configuration (backend ids, model names, canary check names, reasons),
never from client input: a request for an unknown model is refused before routing, so ``model`` is always a
configured name (or empty for a body without one). No family here is built with a creation time, so no
``_created`` series are exported; the one plain prometheus_client metric is a gauge (gauges have none).
Importing this module changes nothing: collectors exist only on the registries ``Metrics`` creates.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, TypeVar

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from backends.events import (
    Action,
    CanaryFailed,
    CanaryPassed,
    Event,
    GiveUp,
    Operator,
    ProbeFailed,
    ProcessExited,
    RestartProcess,
    TimerFired,
    TimerKind,
)
from backends.kv_events import KvEventType
from backends.lifecycle import Lifecycle
from backends.registry import Registry
from gateway.observe import Observation
from gateway.outcomes import AttemptOutcome, RequestOutcome
from routing.kvindex import KvIndex
from routing.types import BackendState, Reason

if TYPE_CHECKING:
    from backends.managed import BackendController

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_BUCKET_LABELS = tuple(repr(float(bound)) for bound in _LATENCY_BUCKETS)  # "1.0", as Prometheus writes them
#: Restarts and canary failures kept for the status page.
RECENT_KEPT = 20
#: The ``check`` label of a canary that passed (all its checks did).
CANARY_ALL = "all"

_K = TypeVar("_K", bound=tuple[str, ...])
_V = TypeVar("_V")
_Families = Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]


class RestartCause(StrEnum):
    """Why a managed engine was restarted: the event that took it down. Values are metric labels."""

    EXITED = "exited"  # the process exited, was killed or could not be started
    START_TIMEOUT = "start_timeout"  # not healthy within start_timeout_s
    UNHEALTHY = "unhealthy"  # health probes failed (or real traffic could not connect)
    CANARY_FAILED = "canary_failed"
    OPERATOR = "operator"  # the reset command
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class LifecycleNote:
    """A restart or a failed canary, for the status page (``detail``: engine text; escape it to show it)."""

    at: float  # wall clock
    backend: str
    kind: str  # "restart" or "canary_failed"
    label: str  # the restart cause or the failed check
    detail: str


class Metrics:
    """Every collector of the gateway. The per-request series are tallied in plain dicts and read at scrape
    time: prometheus_client's own children take a lock and run two checks per ``inc``, seven times a request,
    which measured ~6 % of the hot path's CPU. ``Metrics`` is also the proxy's ``Observer`` (tokens, TTFT,
    requests by model and reason) and the controllers' transition hook (canaries, restarts)."""

    def __init__(self, backends: Registry) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.tally = _Tally()
        r.register(self.tally)
        self.degraded = Gauge(
            "warmroute_shared_state_degraded", "1 while the shared state store is unreachable", registry=r
        )
        self.fleet = _FleetTally()
        r.register(self.fleet)
        self.backends = _BackendCollector(backends)
        r.register(self.backends)
        self.clients = ClientRequests()
        r.register(self.clients)
        self.admission: AdmissionMetrics | None = None  # admission's, when it is enabled (``admitting``)
        self.kv: KvEventsMetrics | None = None  # engines' KV cache events, when any backend has them
        self.quota: QuotaMetrics | None = None  # quotas', when a key has one (``quotas``)

    def kv_events(self, index: KvIndex) -> KvEventsMetrics:
        """The KV cache events' collectors (backends/kv_events.py, gateway/learning.py), registered once."""
        if self.kv is None:
            self.kv = KvEventsMetrics(self.registry, index)
        return self.kv

    def quotas(self) -> QuotaMetrics:
        """The quota collectors (gateway/quotas.py), registered here once."""
        if self.quota is None:
            self.quota = QuotaMetrics(self.registry)
        return self.quota

    def admitting(self, classes: Sequence[str]) -> AdmissionMetrics:
        """Admission's collectors (gateway/admission.py), registered here once; the status page reads them."""
        if self.admission is None:
            self.admission = AdmissionMetrics(self.registry, classes)
        return self.admission

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

    def observe(self, obs: Observation) -> None:
        """The proxy's observer: a request that reached a backend is over (``gateway.observe``)."""
        tally = self.tally
        model = obs.model or ""
        key = (model, obs.backend, obs.reason, obs.outcome)
        tally.routed[key] = tally.routed.get(key, 0) + 1
        pair = (model, obs.backend)
        if obs.streamed and obs.first_byte_s is not None:
            ttft = tally.ttft.get(pair)
            if ttft is None:
                ttft = tally.ttft[pair] = _Histogram()
            ttft.observe(obs.first_byte_s)
        usage = obs.usage
        if usage is not None:
            tokens = tally.tokens.get(pair)
            if tokens is None:
                tokens = tally.tokens[pair] = [0, 0, 0, 0]
            tokens[0] += usage.prompt_tokens
            tokens[1] += usage.completion_tokens
            if usage.cached_tokens is not None:
                tokens[2] += usage.cached_tokens
                tokens[3] += usage.prompt_tokens  # the prompts whose cached share is known

    def transition(
        self, controller: BackendController, event: Event, before: Lifecycle, actions: Sequence[Action]
    ) -> None:
        """``BackendController.on_transition``: canary results, restarts and give-ups."""
        self.fleet.transition(controller, event, before, actions)

    def forget_backend(self, backend: str) -> None:
        """A backend was removed at runtime: drop its series (they would otherwise be exported forever)."""
        t = self.tally
        _drop(t.attempts, 0, backend)
        _drop(t.requests, 0, backend)
        _drop(t.finish_reasons, 0, backend)
        _drop(t.guard_trips, 0, backend)
        t.timings.pop(backend, None)
        _drop(t.routed, 1, backend)
        _drop(t.ttft, 1, backend)
        _drop(t.tokens, 1, backend)
        self.fleet.forget(backend)

    def session_keyed(self, source: str, subagent: bool) -> None:
        """A conversation keyed by ``source`` (a session source's configured spelling, or "head")."""
        key = (source, "subagent" if subagent else "session")
        counts = self.tally.session_keys
        counts[key] = counts.get(key, 0) + 1

    def volatile_normalised(self, where: str) -> None:
        """A request whose volatile system text was left out: of its ``key``, or of what was ``forward``ed."""
        self.tally.volatile[where] = self.tally.volatile.get(where, 0) + 1

    def budget_attempt(self, enforced: str) -> None:
        """An attempt carrying a thinking budget: ``native``, ``gateway`` or ``off`` (thinking turned off)."""
        self.tally.budgets[enforced] = self.tally.budgets.get(enforced, 0) + 1

    def thinking_ignored(self, shape: str, header: str) -> None:
        """A request of ``shape`` (which takes no budget) whose budget or effort ``header`` was ignored."""
        key = (shape, header)
        self.tally.ignored[key] = self.tally.ignored.get(key, 0) + 1

    def thinking(self, *, truncated: bool, reasoning_tokens: int) -> None:
        """A gateway-enforced request is over (only that path reads the reasoning it relays)."""
        self.tally.truncations += truncated
        self.tally.reasoning_tokens += reasoning_tokens

    def affinity_hit_rate(self) -> float | None:
        """Affinity hits among the decisions made for conversations (None before the first one)."""
        d = self.tally.decisions
        hits = d[Reason.AFFINITY_HIT]
        total = hits + sum(d[r] for r in _AFFINITY_MISSES)
        return hits / total if total else None


#: Decisions for a conversation that did not land on its pin (for the hit rate).
_AFFINITY_MISSES = (
    Reason.NEW_LEAST_LOADED,
    Reason.NEW_CHEAPEST,
    Reason.MOVE_CHEAPER,
    Reason.SPILL_OVERLOAD,
    Reason.REPIN_UNHEALTHY,
    Reason.REPIN_REMOVED,
)


def _drop(table: dict[_K, _V], position: int, backend: str) -> None:
    """Delete the entries whose key holds ``backend`` at ``position``."""
    for key in [k for k in table if k[position] == backend]:
        del table[key]


class _Histogram:
    __slots__ = ("bounds", "buckets", "count", "labels", "sum")

    def __init__(
        self, bounds: tuple[float, ...] = _LATENCY_BUCKETS, labels: tuple[str, ...] = _BUCKET_LABELS
    ) -> None:
        self.bounds, self.labels = bounds, labels  # upper bounds, and each as Prometheus writes it
        self.buckets = [0] * len(bounds)  # non-cumulative; +Inf is ``count``
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.buckets):
            self.buckets[i] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for label, n in zip(self.labels, self.buckets, strict=True):
            running += n
            out.append((label, float(running)))
        out.append(("+Inf", float(self.count)))
        return out


def _counter(name: str, doc: str, labels: Sequence[str], table: Mapping[_K, int]) -> _Families:
    family = CounterMetricFamily(name, doc, labels=list(labels))
    for key, n in list(table.items()):
        family.add_metric(list(key), n)
    yield family


class _Tally(Collector):
    """The hot path's counters and histograms, as plain numbers; families are built at scrape time."""

    def __init__(self) -> None:
        self.decisions: dict[Reason, int] = dict.fromkeys(Reason, 0)  # every reason shows, zero or not
        self.attempts: dict[tuple[str, AttemptOutcome], int] = {}
        self.requests: dict[tuple[str, RequestOutcome], int] = {}
        self.timings: dict[str, tuple[_Histogram, _Histogram]] = {}  # backend -> (duration, first byte)
        self.budgets: dict[str, int] = {}  # thinking budgets by enforcement (gateway/budgets.py)
        self.ignored: dict[tuple[str, str], int] = {}  # (shape, header): budget headers a shape ignored
        self.session_keys: dict[tuple[str, str], int] = {}  # (source label, session|subagent)
        self.volatile: dict[str, int] = {}  # "key" / "forward" -> requests normalised there
        self.truncations = 0  # gateway-enforced budgets that cut the reasoning and continued
        self.reasoning_tokens = 0  # reasoning tokens of gateway-enforced requests
        self.finish_reasons: dict[tuple[str, str], int] = {}
        self.guard_trips: dict[tuple[str, str], int] = {}
        # From the observer: (model, backend, reason, outcome) and (model, backend) keys.
        self.routed: dict[tuple[str, str, Reason, RequestOutcome], int] = {}
        self.ttft: dict[tuple[str, str], _Histogram] = {}
        self.tokens: dict[tuple[str, str], list[int]] = {}  # prompt, completion, cached, cache-known prompt

    def collect(self) -> _Families:
        decisions = CounterMetricFamily(
            "warmroute_routing_decisions",
            "Routing decisions by reason; the affinity events: affinity_hit (hit), new_least_loaded (new), "
            "spill_overload (spill), repin_unhealthy / repin_removed (re-pin), retry_next (retry)",
            labels=["reason"],
        )
        for reason, n in self.decisions.items():
            decisions.add_metric([reason.value], n)
        yield decisions
        yield from _counter(
            "warmroute_upstream_attempts",
            "Upstream attempts by backend and outcome (a retried request makes two)",
            ("backend", "outcome"),
            self.attempts,
        )
        yield from _counter(
            "warmroute_requests",
            "Client requests by the backend that answered (empty: none) and outcome",
            ("backend", "outcome"),
            self.requests,
        )
        yield from _counter(
            "warmroute_routed_requests",
            "Requests that reached a backend, by model, backend, route reason (the last attempt's), outcome",
            ("model", "backend", "reason", "outcome"),
            self.routed,
        )
        yield from self._timings()
        yield from self._tokens()
        yield from self._output()
        yield from self._thinking()
        yield from self._keying()

    def _timings(self) -> _Families:
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
        ttft = HistogramMetricFamily(
            "warmroute_time_to_first_token_seconds",
            "Streamed answers: the request's arrival to the engine's first SSE chunk",
            labels=["model", "backend"],
        )
        for (model, backend), h in list(self.ttft.items()):
            ttft.add_metric([model, backend], h.cumulative(), h.sum)
        yield from (duration, first_byte, ttft)

    def _tokens(self) -> _Families:
        names = (
            ("warmroute_prompt_tokens", "Prompt tokens the engines reported in usage"),
            ("warmroute_completion_tokens", "Completion tokens the engines reported in usage"),
            (
                "warmroute_cached_prompt_tokens",
                "Prompt tokens read from the engine's prefix cache (reported)",
            ),
            (
                "warmroute_cache_reported_prompt_tokens",
                "Prompt tokens of answers that reported cached_tokens (the denominator of the cache share)",
            ),
        )
        families = [CounterMetricFamily(n, doc, labels=["model", "backend"]) for n, doc in names]
        for (model, backend), counts in list(self.tokens.items()):
            for family, n in zip(families, counts, strict=True):
                family.add_metric([model, backend], n)
        yield from families

    def _output(self) -> _Families:
        yield from _counter(
            "warmroute_finish_reasons",
            "finish_reason of proxied answers (a rising length share: an engine looping to its limit)",
            ("backend", "reason"),
            self.finish_reasons,
        )
        yield from _counter(
            "warmroute_output_guard_trips",
            "Streams the output guard found degenerate (one unit repeated), by the action taken",
            ("backend", "action"),
            self.guard_trips,
        )

    def _keying(self) -> _Families:
        yield from _counter(
            "warmroute_session_keyed_requests",
            "Requests with a conversation by what keyed it: the session source (as configured in "
            "routing.session_sources) or head; scope subagent when a subagent id split it from its session",
            ("source", "scope"),
            self.session_keys,
        )
        volatile = CounterMetricFamily(
            "warmroute_volatile_normalised_requests",
            "Requests with volatile system text (routing.volatile_prefixes) left out: of the conversation "
            "key (key), or of the body an engine was sent (forward)",
            labels=["where"],
        )
        for where in ("key", "forward"):
            volatile.add_metric([where], self.volatile.get(where, 0))
        yield volatile

    def _thinking(self) -> _Families:
        budgets = CounterMetricFamily(
            "warmroute_thinking_budget_attempts", "Attempts carrying a thinking budget", labels=["enforced"]
        )
        for enforced in ("native", "gateway", "off"):
            budgets.add_metric([enforced], self.budgets.get(enforced, 0))
        yield budgets
        yield from _counter(
            "warmroute_thinking_ignored_requests",
            "Requests of a route that takes no thinking budget (completions) whose budget or effort header "
            "was ignored, by route shape and header (as configured in thinking)",
            ("shape", "header"),
            self.ignored,
        )
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


class _FleetTally(Collector):
    """Canary results, restarts and give-ups, counted from the lifecycle controllers' transitions."""

    def __init__(self) -> None:
        self.canaries: dict[tuple[str, str, str], int] = {}  # (backend, check, "pass"/"fail")
        self.restarts: dict[tuple[str, RestartCause], int] = {}
        self.give_ups: dict[tuple[str], int] = {}
        self.recent: deque[LifecycleNote] = deque(maxlen=RECENT_KEPT)
        self._down_cause: dict[str, RestartCause] = {}  # what took each backend down last

    def transition(
        self, controller: BackendController, event: Event, before: Lifecycle, actions: Sequence[Action]
    ) -> None:
        backend, after = controller.id, controller.lifecycle
        if isinstance(event, CanaryPassed | CanaryFailed):
            self._canary(controller, isinstance(event, CanaryPassed))
        if after.state is BackendState.DOWN and before.state is not BackendState.DOWN:
            self._down_cause[backend] = _cause_of(event)
        for action in actions:
            if isinstance(action, RestartProcess):
                cause = RestartCause.OPERATOR if isinstance(event, Operator) else None
                cause = cause or self._down_cause.get(backend, RestartCause.OTHER)
                self.restarts[backend, cause] = self.restarts.get((backend, cause), 0) + 1
                self.recent.append(LifecycleNote(time.time(), backend, "restart", cause.value, after.reason))
            elif isinstance(action, GiveUp):
                self.give_ups[backend,] = self.give_ups.get((backend,), 0) + 1

    def _canary(self, controller: BackendController, passed: bool) -> None:
        result = controller.last_canary
        check = CANARY_ALL if passed or result is None else result.check_name or "none"
        key = (controller.id, check, "pass" if passed else "fail")
        self.canaries[key] = self.canaries.get(key, 0) + 1
        if not passed:
            reason = "" if result is None else result.reason
            self.recent.append(LifecycleNote(time.time(), controller.id, "canary_failed", check, reason))

    def forget(self, backend: str) -> None:
        _drop(self.canaries, 0, backend)
        _drop(self.restarts, 0, backend)
        _drop(self.give_ups, 0, backend)
        self._down_cause.pop(backend, None)

    def collect(self) -> _Families:
        yield from _counter(
            "warmroute_canary_runs",
            f"Canary runs by backend, result and check (the failed one; {CANARY_ALL!r} when all passed)",
            ("backend", "check", "result"),
            self.canaries,
        )
        yield from _counter(
            "warmroute_backend_restarts",
            "Managed engine restarts by backend and the cause of the outage",
            ("backend", "cause"),
            self.restarts,
        )
        yield from _counter(
            "warmroute_backend_give_ups",
            "Managed engines given up on (too many restarts in the window)",
            ("backend",),
            self.give_ups,
        )


def _cause_of(event: Event) -> RestartCause:
    if isinstance(event, ProcessExited):
        return RestartCause.EXITED
    if isinstance(event, TimerFired) and event.kind is TimerKind.START_TIMEOUT:
        return RestartCause.START_TIMEOUT
    if isinstance(event, ProbeFailed):
        return RestartCause.UNHEALTHY
    if isinstance(event, CanaryFailed):
        return RestartCause.CANARY_FAILED
    return RestartCause.OTHER


class _BackendCollector(Collector):
    """Reads live backend state at scrape time instead of mirroring it into gauges on every change.

    ``conversations`` (pinned conversations per backend) is set by whoever scrapes, just before: reading it
    may take a round trip to the shared store, and a collector cannot await."""

    def __init__(self, backends: Registry) -> None:
        self.backends = backends
        self.conversations: Mapping[str, int] = {}

    def collect(self) -> Iterator[GaugeMetricFamily]:
        in_flight = GaugeMetricFamily(
            "warmroute_backend_in_flight", "Requests in flight per backend (this process)", labels=["backend"]
        )
        pinned = GaugeMetricFamily(
            "warmroute_backend_conversations",
            "Conversations pinned to each backend (all replicas when the state is shared)",
            labels=["backend"],
        )
        state = GaugeMetricFamily(
            "warmroute_backend_state", "1 for the backend's current state", labels=["backend", "state"]
        )
        circuit = GaugeMetricFamily(
            "warmroute_backend_circuit_open",
            "1 while the backend's circuit breaker is open",
            labels=["backend"],
        )
        for b in list(self.backends.backends.values()):
            in_flight.add_metric([b.id], b.in_flight)
            pinned.add_metric([b.id], self.conversations.get(b.id, 0))
            circuit.add_metric([b.id], 1.0 if b.circuit_open else 0.0)
            for s in BackendState:
                state.add_metric([b.id, s.value], 1.0 if b.state is s else 0.0)
        yield from (in_flight, pinned, state, circuit)
        yield from _routing_signals(self.backends)


_STARTING_BUCKETS = (0.5, 1, 2.5, 5, 10, 20, 30, 60, 90, 120, 180, 300, 600)
_STARTING_LABELS = tuple(repr(float(bound)) for bound in _STARTING_BUCKETS)


class OnDemandMetrics(Collector):
    """On-demand engines (``backends.demand.DemandMetrics``), registered on ``r``: rare events, tallied like
    the rest. Labels: backend ids, groups and models from the configuration, enum values."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.starts: dict[tuple[str], int] = {}
        self.stops: dict[tuple[str, str], int] = {}  # (backend, why)
        self.swaps: dict[tuple[str], int] = {}
        self.refused: dict[tuple[str], int] = {}
        self.starting: dict[str, _Histogram] = {}
        self.depths: dict[str, int] = {}
        self.waits: dict[tuple[str, str], _Histogram] = {}  # (model, outcome)
        r.register(self)

    def started(self, engine: str) -> None:
        _bump(self.starts, (engine,))

    def ready(self, engine: str, starting_s: float) -> None:
        _histogram(self.starting, engine).observe(starting_s)

    def stopped(self, engine: str, why: str, group: str | None) -> None:
        _bump(self.stops, (engine, why))
        if why == "swap" and group is not None:
            _bump(self.swaps, (group,))

    def eviction_refused(self, engine: str) -> None:
        _bump(self.refused, (engine,))

    def waited(self, model: str, seconds: float, outcome: str) -> None:
        _histogram(self.waits, (model, outcome)).observe(seconds)

    def depth(self, model: str, waiting: int) -> None:
        self.depths[model] = waiting

    def collect(self) -> _Families:
        yield from _counter("warmroute_ondemand_starts", "On-demand engine starts", ("backend",), self.starts)
        yield from _counter(
            "warmroute_ondemand_stops",
            "On-demand engine stops by why (idle, swap, failed)",
            ("backend", "why"),
            self.stops,
        )
        yield from _counter(
            "warmroute_ondemand_swaps", "Engines swapped out for another member", ("group",), self.swaps
        )
        starting = HistogramMetricFamily(
            "warmroute_ondemand_starting_seconds",
            "From the start of an on-demand engine to READY (canary passed)",
            labels=["backend"],
        )
        for backend, h in list(self.starting.items()):
            starting.add_metric([backend], h.cumulative(), h.sum)
        yield starting
        yield from _counter(
            "warmroute_ondemand_evictions_refused",
            "Swaps held back because the running engine had requests in flight",
            ("backend",),
            self.refused,
        )
        depth = GaugeMetricFamily(
            "warmroute_ondemand_queue_depth", "Requests waiting for an engine", labels=["model"]
        )
        for model, n in list(self.depths.items()):
            depth.add_metric([model], n)
        yield depth
        wait = HistogramMetricFamily(
            "warmroute_ondemand_wait_seconds",
            "Time requests waited for an on-demand engine, by outcome (admitted or why refused)",
            labels=["model", "outcome"],
        )
        for (model, outcome), h in list(self.waits.items()):
            wait.add_metric([model, outcome], h.cumulative(), h.sum)
        yield wait


class KvEventsMetrics(Collector):
    """Engines' KV cache events (``backends.kv_events.KvEventMetrics``) and how well the index they build
    foretells what the engine reports, registered on ``r``. Labels: backend ids from the configuration and
    ``KvEventType`` values. The index size is read from the index at scrape time."""

    def __init__(self, r: CollectorRegistry, index: KvIndex) -> None:
        self.index = index
        self.events: dict[tuple[str, str], int] = {}  # (backend, type)
        self.gaps: dict[tuple[str, str], int] = {}  # (backend, "replayed" | "lost")
        self.estimated: dict[tuple[str], int] = {}
        self.reported: dict[tuple[str], int] = {}
        self.compared: dict[tuple[str], int] = {}
        r.register(self)

    def received(self, backend: str, kind: KvEventType, n: int) -> None:
        key = (backend, kind.value)
        self.events[key] = self.events.get(key, 0) + n

    def gap(self, backend: str, replayed: bool) -> None:
        _bump(self.gaps, (backend, "replayed" if replayed else "lost"))

    def cached(self, backend: str, estimated: int, reported: int) -> None:
        """One request the index had an answer for: its cached tokens as estimated, and as reported."""
        key = (backend,)
        self.estimated[key] = self.estimated.get(key, 0) + estimated
        self.reported[key] = self.reported.get(key, 0) + reported
        _bump(self.compared, key)

    def collect(self) -> _Families:
        yield from _counter(
            "warmroute_kv_events", "KV cache events received from engines, by type", ("backend", "type"),
            self.events,
        )  # fmt: skip
        yield from _counter(
            "warmroute_kv_event_gaps",
            "Sequence gaps in an engine's KV events: filled by its replay socket, or lost (index reset)",
            ("backend", "outcome"),
            self.gaps,
        )
        blocks = GaugeMetricFamily(
            "warmroute_kv_index_blocks", "Blocks the KV index holds for each engine", labels=["backend"]
        )
        for backend, engine in list(self.index.engines.items()):
            blocks.add_metric([backend], len(engine))
        yield blocks
        yield GaugeMetricFamily(
            "warmroute_kv_index_conversations", "Conversations with checkpoints in the KV index",
            value=len(self.index),
        )  # fmt: skip
        yield from _counter(
            "warmroute_kv_estimated_cached_tokens",
            "Cached prompt tokens the KV index estimated, over the requests it had an answer for",
            ("backend",),
            self.estimated,
        )
        yield from _counter(
            "warmroute_kv_reported_cached_tokens",
            "Cached prompt tokens the engine reported, over the same requests",
            ("backend",),
            self.reported,
        )
        yield from _counter(
            "warmroute_kv_compared_requests",
            "Requests whose estimated and reported cached tokens were compared",
            ("backend",),
            self.compared,
        )


def _bump(table: dict[_K, int], key: _K) -> None:
    table[key] = table.get(key, 0) + 1


def _histogram(table: dict[_V, _Histogram], key: _V) -> _Histogram:
    h = table.get(key)
    if h is None:
        h = table[key] = _Histogram(_STARTING_BUCKETS, _STARTING_LABELS)
    return h


class QuotaMetrics(Collector):
    """Quotas per client key (gateway/quotas.py), registered on ``r``. Label ``client``: key names from
    ``quotas.keys`` only; ``outcome``: ``admitted``, ``unchecked`` (shared state unreachable: fail open), or
    the limit that refused it (``requests``, ``tokens``, ``concurrent``)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.clients: dict[tuple[str, str], int] = {}  # (client, outcome)
        self.store_failures = 0
        r.register(self)

    def counted(self, client: str, outcome: str) -> None:
        _bump(self.clients, (client, outcome))

    def of(self, client: str) -> dict[str, int]:
        return {outcome: n for (c, outcome), n in sorted(self.clients.items()) if c == client}

    def collect(self) -> _Families:
        yield from _counter(
            "warmroute_quota_requests",
            "Requests of client keys with a quota, admitted or refused (by the limit reached)",
            ("client", "outcome"),
            self.clients,
        )
        failures = CounterMetricFamily(
            "warmroute_quota_store_failures",
            "Round trips to the shared quota state that failed (requests were admitted unchecked)",
        )
        failures.add_metric([], self.store_failures)
        yield failures


class AdmissionMetrics(Collector):
    """Admission per backend (gateway/admission.py), registered on ``r``. Labels: class names and backend ids
    from the configuration, client key names from the configuration ("" for requests without a key), and
    the outcomes ``admitted``, ``queue_full``, ``timeout``, ``left`` (and ``timeout_paused``: a paused stream
    that waited its class's timeout to resume)."""

    def __init__(self, r: CollectorRegistry, classes: Sequence[str]) -> None:
        self.depths: dict[str, int] = dict.fromkeys(classes, 0)
        self.running: dict[str, int] = {}  # backend -> admitted, not finished
        self.waits: dict[tuple[str, str], _Histogram] = {}  # (class, outcome)
        self.clients: dict[tuple[str, str], int] = {}  # (client, outcome)
        self.pauses: dict[tuple[str], int] = dict.fromkeys(((c,) for c in classes), 0)
        r.register(self)

    def paused(self, klass: str) -> None:
        _bump(self.pauses, (klass,))

    def depth(self, klass: str, waiting: int) -> None:
        self.depths[klass] = waiting

    def waited(self, klass: str, client: str, seconds: float, outcome: str) -> None:
        h = self.waits.get((klass, outcome))
        if h is None:
            h = self.waits[(klass, outcome)] = _Histogram()
        h.observe(seconds)
        _bump(self.clients, (client, outcome))

    def collect(self) -> _Families:
        depth = GaugeMetricFamily(
            "warmroute_admission_queue_depth", "Requests waiting for a backend's room", labels=["class"]
        )
        for klass, n in list(self.depths.items()):
            depth.add_metric([klass], n)
        yield depth
        running = GaugeMetricFamily(
            "warmroute_admission_in_flight",
            "Requests admitted to a backend, not finished",
            labels=["backend"],
        )
        for backend, n in list(self.running.items()):
            running.add_metric([backend], n)
        yield running
        wait = HistogramMetricFamily(
            "warmroute_admission_wait_seconds",
            "Time requests waited for admission, by class and outcome (admitted or why refused)",
            labels=["class", "outcome"],
        )
        for (klass, outcome), h in list(self.waits.items()):
            wait.add_metric([klass, outcome], h.cumulative(), h.sum)
        yield wait
        yield from _counter(
            "warmroute_admission_requests",
            "Requests admitted or refused by admission, per client key name",
            ("client", "outcome"),
            self.clients,
        )
        yield from _counter(
            "warmroute_admission_paused",
            "Streams paused for a higher class's waiting request (resumed as a continuation), by class",
            ("class",),
            self.pauses,
        )


class ClientRequests(Collector):
    """``warmroute_client_requests_total{client}``: /v1 requests per client key (names from config only)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def declare(self, names: Iterator[str] | list[str]) -> None:
        for name in names:
            self.counts.setdefault(name, 0)

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "warmroute_client_requests", "Requests to /v1 by client key name", labels=["client"]
        )
        for name, n in list(self.counts.items()):
            family.add_metric([name], n)
        yield family


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
