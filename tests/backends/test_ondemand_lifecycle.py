"""The lifecycle's on-demand transitions (``Wake``/``Sleep``, the *stopped* flag) as plain functions."""

from __future__ import annotations

from dataclasses import replace

from backends.breaker import CircuitState
from backends.events import (
    ArmTimer,
    Command,
    ConfigAdded,
    Log,
    Operator,
    ProbeFailed,
    ProbeOk,
    ProcessExited,
    ResetBreaker,
    Sleep,
    StartProcess,
    StopProcess,
    TimerFired,
    TimerKind,
    Wake,
)
from backends.lifecycle import Lifecycle, LifecyclePolicy, transition
from routing.types import BackendState

S = BackendState
OD = LifecyclePolicy(managed=True, on_demand=True, start_timeout_s=60.0, grace_s=10.0)


def stopped() -> Lifecycle:
    lc, actions = transition(Lifecycle(), ConfigAdded(), 0.0, OD)
    assert actions == [Log(20, "starting -> down: stopped (on demand): starts on a request")]  # INFO
    return lc


def test_an_on_demand_engine_begins_stopped_and_is_not_started() -> None:
    lc = stopped()
    assert (lc.state, lc.stopped, lc.routable, lc.started_at) == (S.DOWN, True, False, None)


def test_wake_starts_it_with_a_start_timeout_and_a_closed_circuit() -> None:
    lc = replace(stopped(), circuit=CircuitState.OPEN, gave_up=True, restarts=(1.0, 2.0))
    lc, actions = transition(lc, Wake(), 5.0, OD)
    assert (lc.state, lc.stopped, lc.gave_up, lc.restarts, lc.circuit) == (
        S.STARTING,
        False,
        False,
        (),
        CircuitState.CLOSED,
    )
    assert lc.reason == "starting the engine process (on demand)" and lc.started_at == 5.0
    assert actions[1:] == [
        ResetBreaker(),
        StartProcess(),
        ArmTimer(TimerKind.START_TIMEOUT, 60.0, lc.timer_seq),
    ]


def test_wake_on_a_running_or_unmanaged_engine_changes_nothing() -> None:
    running = transition(stopped(), Wake(), 1.0, OD)[0]
    assert transition(running, Wake(), 2.0, OD) == (running, [])
    unmanaged = LifecyclePolicy()
    assert transition(Lifecycle(), Wake(), 1.0, unmanaged) == (Lifecycle(), [])


def test_sleep_stops_it_on_purpose_and_makes_pending_timers_stale() -> None:
    lc = transition(stopped(), Wake(), 1.0, OD)[0]
    armed = lc.timer_seq
    lc, actions = transition(lc, Sleep("idle for 30 s"), 2.0, OD)
    assert (lc.state, lc.stopped, lc.reason) == (S.DOWN, True, "idle for 30 s")
    assert actions[-1] == StopProcess()
    assert transition(lc, TimerFired(TimerKind.START_TIMEOUT, armed), 70.0, OD) == (lc, [])
    assert transition(lc, Sleep("again"), 3.0, OD) == (lc, [])


def test_while_stopped_probes_exits_and_reset_change_nothing() -> None:
    lc = stopped()
    for event in (
        ProbeOk(),
        ProbeFailed("connection refused"),
        ProcessExited("exited with code 1", code=1),
        Operator(Command.RESET),
    ):
        assert transition(lc, event, 1.0, OD) == (lc, []), event


def test_a_failed_start_of_a_woken_engine_is_an_outage_like_any_other() -> None:
    lc = transition(stopped(), Wake(), 1.0, OD)[0]
    lc, _ = transition(lc, ProcessExited("exited with code 3", code=3, lines=("boom",)), 2.0, OD)
    assert lc.state is S.DOWN and not lc.stopped
    assert lc.reason == "engine process exited with code 3; last output: boom"
