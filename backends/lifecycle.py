"""A backend's lifecycle as one pure function: ``transition(lc, event, now, policy) -> (lc, actions)``.

No I/O, no clock, no asyncio (h11-style): probes, canaries, the circuit breaker, the process supervisor and
operator commands only *send* events; one writer (``backends.managed``) applies them and executes the
actions. Time is ``now`` (monotonic seconds); delays are ``ArmTimer`` actions whose ``TimerFired`` comes back
as an event, stale when its ``seq`` is no longer the current one, so no timer ever needs cancelling.

States: STARTING -> CANARY -> READY <-> DRAINING / CORDONED; any of those -> DOWN -> CANARY again.
Decisions written down here (the tests hold every one):

- Only a passed canary admits. It runs on the first healthy probe after STARTING or DOWN, results carry
  the ``seq`` of their run, and a result for an older run (or outside CANARY) changes nothing.
- Operator intent is two flags, ``drained`` and ``cordoned``, kept across outages: an admitted backend is
  DRAINING if drained, else CORDONED if cordoned, else READY. Probes never change an admitted state; a
  failing engine goes DOWN even when drained or cordoned (it is dead, and its pins must move) and comes back
  in its operator state after its canary.
- A failed canary keeps the backend DOWN; the canary is tried again on the first healthy probe at least
  ``canary_retry_s`` later. It does not restart a managed engine (it is up, only wrong); probes that then
  fail ``fail_threshold`` times make it an outage like any other.
- The circuit breaker is a flag, not a state: an open circuit makes a READY backend unroutable
  (``routable``) without pretending the engine is down; half-open lets the breaker's single trial through.
  A passed canary closes it (``ResetBreaker``): the canary was a better trial than one request.
- Operator RESET also closes the circuit and clears the breaker (``ResetBreaker``), in any admitted or DOWN
  state: an operator who checked the engine need not wait out an open period.
- Managed engines: an outage (exit, ``fail_threshold`` failed probes, no healthy probe within
  ``start_timeout_s``) restarts after ``grace_s`` from its start, and after a backoff doubling from
  ``backoff_initial_s`` for each restart already made in the last ``window_s``. With ``max_restarts``
  made in the window it gives up: DOWN, "gave up after N restarts in W s: <cause>", until an operator RESET.
  A process that cannot be spawned at all gives up at once (a restart would fail the same way).
  A managed engine still STARTING ignores failed probes (it is loading): only its start timeout ends that.
- Exits the gateway asked for (stop, restart) are no outage. A ``detached`` engine's command returning 0
  is none either (``docker start`` returns once the container runs).
- On-demand engines (``policy.on_demand``) begin *stopped* (DOWN, ``stopped``): not started at CONFIG_ADDED.
  ``Wake`` starts a stopped one (STARTING, a fresh start timeout, restart history forgotten); ``Sleep`` stops
  one on purpose (DOWN, ``stopped``, the stop action, pending timers stale). While stopped, probes, exits and
  operator RESET change nothing: only ``Wake`` brings it back (``backends.ondemand`` decides when).
- After CONFIG_REMOVED nothing but process exits is looked at; an unmanaged backend ignores process events
  and timers (it has neither).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from backends.breaker import CircuitState
from backends.events import (
    Action,
    ArmTimer,
    CanaryFailed,
    CanaryPassed,
    CircuitChanged,
    Command,
    ConfigAdded,
    ConfigRemoved,
    Event,
    GiveUp,
    Log,
    Operator,
    ProbeFailed,
    ProbeOk,
    ProcessExited,
    ProcessStarted,
    ResetBreaker,
    RestartProcess,
    RunCanary,
    Sleep,
    StartProcess,
    StopProcess,
    TimerFired,
    TimerKind,
    Wake,
)
from routing.types import BackendState

S = BackendState
# For ``routable`` (per request): on Python 3.11 every ``BackendState.X`` / ``CircuitState.X`` is a class
# attribute load through ``EnumType.__getattr__``'s slow hook (~0.25 us each).
_READY, _OPEN = S.READY, CircuitState.OPEN
_ADMITTED = frozenset({S.READY, S.DRAINING, S.CORDONED})
_TAIL_LINES = 3
_TAIL_CHARS = 400


# -- values -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LifecyclePolicy:
    """Per-backend rules (``backends.managed.policy_for`` builds one from the settings)."""

    managed: bool = False
    on_demand: bool = False  # begins stopped; started and stopped by ``Wake``/``Sleep``
    detached: bool = False
    fail_threshold: int = 2
    start_timeout_s: float = 600.0
    grace_s: float = 10.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    max_restarts: int = 5
    window_s: float = 600.0
    canary_retry_s: float = 60.0

    def backoff(self, recent_restarts: int) -> float:
        """Extra wait before a restart when ``recent_restarts`` were made in the window already."""
        if recent_restarts == 0:
            return 0.0
        return float(min(self.backoff_initial_s * 2 ** (recent_restarts - 1), self.backoff_max_s))


@dataclass(frozen=True, slots=True)
class Lifecycle:
    state: BackendState = S.STARTING
    reason: str = "waiting for the first health probe"
    drained: bool = False
    cordoned: bool = False
    circuit: CircuitState = CircuitState.CLOSED
    probe_failures: int = 0  # consecutive
    down_since: float | None = None  # start of the current outage
    started_at: float | None = None  # last (re)start of a managed process
    restarts: tuple[float, ...] = ()  # when restarts were made (those in the window)
    gave_up: bool = False
    removed: bool = False
    canary_seq: int = 0
    canary_retry_at: float | None = None  # after a failed canary: no new one before this
    timer_seq: int = 0
    stopped: bool = False  # an on-demand engine stopped on purpose (DOWN, and no outage)

    @property
    def routable(self) -> bool:
        """Takes new work: READY with a circuit that is not open."""
        return self.state is _READY and self.circuit is not _OPEN and not self.removed

    def restarts_in_window(self, now: float, window_s: float) -> int:
        return len(_recent(self.restarts, now, window_s))


Result = tuple[Lifecycle, list[Action]]


def transition(lc: Lifecycle, event: Event, now: float, policy: LifecyclePolicy) -> Result:
    """The next lifecycle value and what to do about it. Never raises on any (state, event) pair."""
    if lc.removed and not isinstance(event, ProcessExited):
        return lc, []
    new, actions = _HANDLERS[type(event)](lc, event, now, policy)
    if (new.state, new.reason) != (lc.state, lc.reason) and not any(isinstance(a, GiveUp) for a in actions):
        level = logging.WARNING if new.state is S.DOWN and not new.stopped else logging.INFO
        actions.insert(0, Log(level, f"{lc.state} -> {new.state}: {new.reason}"))
    return new, actions


# -- handlers: (lc, event, now, policy) -> (lc, actions) -------------------------------------------------


def _config_added(lc: Lifecycle, ev: ConfigAdded, now: float, p: LifecyclePolicy) -> Result:
    if not p.managed or lc.state is not S.STARTING or lc.started_at is not None:
        return lc, []
    if p.on_demand:
        return replace(lc, state=S.DOWN, reason="stopped (on demand): starts on a request", stopped=True), []
    seq = lc.timer_seq + 1
    lc = replace(lc, reason="starting the engine process", started_at=now, timer_seq=seq)
    return lc, [StartProcess(), ArmTimer(TimerKind.START_TIMEOUT, p.start_timeout_s, seq)]


def _config_removed(lc: Lifecycle, ev: ConfigRemoved, now: float, p: LifecyclePolicy) -> Result:
    lc = replace(lc, state=S.DOWN, reason="removed from the configuration", removed=True)
    return lc, [StopProcess()] if p.managed else []


def _probe_ok(lc: Lifecycle, ev: ProbeOk, now: float, p: LifecyclePolicy) -> Result:
    lc = replace(lc, probe_failures=0)
    if lc.state not in (S.STARTING, S.DOWN) or lc.gave_up or lc.stopped:
        return lc, []
    if lc.canary_retry_at is not None and now < lc.canary_retry_at:
        return lc, []
    seq, reason = lc.canary_seq + 1, "health probe ok; running the canary"
    # A new timer seq too: a restart or start timeout armed before this recovery is stale from now on.
    timer_seq = lc.timer_seq + 1
    lc = replace(lc, state=S.CANARY, reason=reason, canary_seq=seq, canary_retry_at=None, timer_seq=timer_seq)
    return lc, [RunCanary(seq)]


def _probe_failed(lc: Lifecycle, ev: ProbeFailed, now: float, p: LifecyclePolicy) -> Result:
    if lc.stopped:
        return lc, []
    lc = replace(lc, probe_failures=lc.probe_failures + 1)
    # DOWN after a failed canary is no outage yet; failing probes make it one (once: _outage clears it).
    if lc.probe_failures < p.fail_threshold or (lc.state is S.DOWN and lc.canary_retry_at is None):
        return lc, []
    if lc.state is S.STARTING and p.managed:
        return lc, []
    return _outage(lc, f"health probe failed: {ev.error}", now, p)


def _canary_passed(lc: Lifecycle, ev: CanaryPassed, now: float, p: LifecyclePolicy) -> Result:
    if lc.state is not S.CANARY or ev.seq != lc.canary_seq:
        return lc, []
    state = _admitted_state(lc.drained, lc.cordoned)
    lc = replace(lc, state=state, reason="canary passed", down_since=None, circuit=CircuitState.CLOSED)
    return lc, [ResetBreaker()]


def _canary_failed(lc: Lifecycle, ev: CanaryFailed, now: float, p: LifecyclePolicy) -> Result:
    if lc.state is not S.CANARY or ev.seq != lc.canary_seq:
        return lc, []
    retry_at = now + p.canary_retry_s
    lc = replace(
        lc, state=S.DOWN, reason=f"canary failed: {ev.reason}", down_since=now, canary_retry_at=retry_at
    )
    return lc, []


def _circuit_changed(lc: Lifecycle, ev: CircuitChanged, now: float, p: LifecyclePolicy) -> Result:
    if ev.state is lc.circuit:
        return lc, []
    level = logging.WARNING if ev.state is CircuitState.OPEN else logging.INFO
    detail = f": {ev.reason}" if ev.reason else ""
    return replace(lc, circuit=ev.state), [Log(level, f"circuit {ev.state}{detail}")]


def _process_started(lc: Lifecycle, ev: ProcessStarted, now: float, p: LifecyclePolicy) -> Result:
    if lc.state is not S.STARTING or not p.managed:
        return lc, []
    return replace(lc, reason=f"engine process {ev.pid} started; waiting for a healthy probe"), []


def _process_exited(lc: Lifecycle, ev: ProcessExited, now: float, p: LifecyclePolicy) -> Result:
    if ev.requested or lc.removed or lc.gave_up or lc.stopped or not p.managed:
        return lc, []
    if p.detached and ev.code == 0 and not ev.spawn_failed:
        return lc, [Log(logging.INFO, "start command returned 0; the engine runs detached")]
    cause = f"engine process {ev.cause}{_tail(ev.lines)}"
    if ev.spawn_failed:
        reason = f"cannot start the engine process: {ev.cause}"
        since = lc.down_since if lc.down_since is not None else now
        lc = replace(lc, state=S.DOWN, reason=reason, gave_up=True, down_since=since)
        return lc, [GiveUp(reason)]
    return _outage(lc, cause, now, p)


def _operator(lc: Lifecycle, ev: Operator, now: float, p: LifecyclePolicy) -> Result:
    if ev.command is Command.RESET:
        if lc.stopped:
            return lc, []
        lc, actions = _reset_circuit(lc)
        lc, more = _reset(lc, now, p)
        return lc, actions + more
    drained = {Command.DRAIN: True, Command.UNDRAIN: False}.get(ev.command, lc.drained)
    cordoned = {Command.CORDON: True, Command.UNCORDON: False}.get(ev.command, lc.cordoned)
    lc = replace(lc, drained=drained, cordoned=cordoned)
    if lc.state not in _ADMITTED:
        return lc, [Log(logging.INFO, f"operator {ev.command}: applies once the canary passes")]
    state = _admitted_state(drained, cordoned)
    return replace(lc, state=state, reason=f"operator {ev.command}"), []


def _timer_fired(lc: Lifecycle, ev: TimerFired, now: float, p: LifecyclePolicy) -> Result:
    if ev.seq != lc.timer_seq or not p.managed:
        return lc, []
    if ev.kind is TimerKind.START_TIMEOUT and lc.state is S.STARTING:
        cause = f"not healthy within {p.start_timeout_s:g} s of starting{_tail(ev.lines)}"
        return _outage(replace(lc, down_since=lc.started_at), cause, now, p)
    if ev.kind is TimerKind.RESTART and lc.state is S.DOWN and not lc.gave_up:
        restarts = (*_recent(lc.restarts, now, p.window_s), now)
        reason = (
            f"restarting the engine process ({len(restarts)} of at most {p.max_restarts} in {p.window_s:g} s)"
        )
        return _restart(replace(lc, restarts=restarts), now, p, reason)
    return lc, []


def _wake(lc: Lifecycle, ev: Wake, now: float, p: LifecyclePolicy) -> Result:
    if not p.managed or not lc.stopped:
        return lc, []
    seq = lc.timer_seq + 1
    lc = replace(
        lc,
        state=S.STARTING,
        reason="starting the engine process (on demand)",
        stopped=False,
        gave_up=False,
        restarts=(),
        started_at=now,
        down_since=None,
        probe_failures=0,
        canary_retry_at=None,
        circuit=CircuitState.CLOSED,
        timer_seq=seq,
    )
    return lc, [ResetBreaker(), StartProcess(), ArmTimer(TimerKind.START_TIMEOUT, p.start_timeout_s, seq)]


def _sleep(lc: Lifecycle, ev: Sleep, now: float, p: LifecyclePolicy) -> Result:
    if not p.managed or lc.stopped:
        return lc, []
    # A new timer seq: a pending restart or start timeout must not bring a stopped engine back.
    lc = replace(
        lc, state=S.DOWN, reason=ev.reason, stopped=True, down_since=None, timer_seq=lc.timer_seq + 1
    )
    return lc, [StopProcess()]


_HANDLERS: dict[type[Any], Callable[[Lifecycle, Any, float, LifecyclePolicy], Result]] = {
    ConfigAdded: _config_added,
    ConfigRemoved: _config_removed,
    ProbeOk: _probe_ok,
    ProbeFailed: _probe_failed,
    CanaryPassed: _canary_passed,
    CanaryFailed: _canary_failed,
    CircuitChanged: _circuit_changed,
    ProcessStarted: _process_started,
    ProcessExited: _process_exited,
    Operator: _operator,
    TimerFired: _timer_fired,
    Wake: _wake,
    Sleep: _sleep,
}


# -- shared steps ---------------------------------------------------------------------------------------


def _outage(lc: Lifecycle, cause: str, now: float, p: LifecyclePolicy) -> Result:
    """The engine is not serving: DOWN, and for a managed engine a restart planned (or a give-up)."""
    since = lc.down_since if lc.down_since is not None else now
    lc = replace(lc, state=S.DOWN, reason=cause, down_since=since, canary_retry_at=None)
    if not p.managed:
        return lc, []
    recent = _recent(lc.restarts, now, p.window_s)
    if len(recent) >= p.max_restarts:
        reason = f"gave up after {len(recent)} restarts in {p.window_s:g} s: {cause}"
        return replace(lc, reason=reason, gave_up=True, restarts=recent), [GiveUp(reason), StopProcess()]
    delay = max(0.0, since + p.grace_s - now, p.backoff(len(recent)))
    seq = lc.timer_seq + 1
    return replace(lc, restarts=recent, timer_seq=seq), [ArmTimer(TimerKind.RESTART, delay, seq)]


def _restart(lc: Lifecycle, now: float, p: LifecyclePolicy, reason: str) -> Result:
    """(Re)start the process: STARTING again, with a fresh start timeout and a fresh canary."""
    seq = lc.timer_seq + 1
    lc = replace(
        lc,
        state=S.STARTING,
        reason=reason,
        started_at=now,
        down_since=None,
        probe_failures=0,
        canary_retry_at=None,
        timer_seq=seq,
    )
    return lc, [RestartProcess(), ArmTimer(TimerKind.START_TIMEOUT, p.start_timeout_s, seq)]


def _reset_circuit(lc: Lifecycle) -> Result:
    """RESET forgets the breaker too: its failures, its open period, an open or half-open circuit."""
    if lc.circuit is CircuitState.CLOSED:
        return lc, [ResetBreaker()]
    message = f"circuit {CircuitState.CLOSED}: reset by the operator (it was {lc.circuit})"
    # The reason said why the circuit opened; it must not outlive the circuit (DOWN gets its own below).
    # (The changed reason is logged by ``transition``, as every change of reason is.)
    return replace(lc, circuit=CircuitState.CLOSED, reason=message), [ResetBreaker()]


def _reset(lc: Lifecycle, now: float, p: LifecyclePolicy) -> Result:
    if lc.state is not S.DOWN:
        return lc, []
    cleared = replace(lc, gave_up=False, restarts=(), canary_retry_at=None, probe_failures=0)
    if p.managed:
        return _restart(cleared, now, p, "starting the engine process (reset by the operator)")
    return replace(cleared, state=S.STARTING, reason="reset by the operator; waiting for a health probe"), []


def _admitted_state(drained: bool, cordoned: bool) -> BackendState:
    if drained:
        return S.DRAINING
    return S.CORDONED if cordoned else S.READY


def _recent(times: tuple[float, ...], now: float, window_s: float) -> tuple[float, ...]:
    return tuple(t for t in times if now - t < window_s)


def _tail(lines: tuple[str, ...]) -> str:
    """The last few non-empty output lines, for a reason line."""
    kept = [line.strip() for line in lines if line.strip()][-_TAIL_LINES:]
    if not kept:
        return ""
    text = " | ".join(kept)
    if len(text) > _TAIL_CHARS:
        text = "…" + text[-_TAIL_CHARS:]
    return f"; last output: {text}"
