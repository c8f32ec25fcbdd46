"""backends.lifecycle: every transition, table-driven, and the ones that must never happen. No sockets."""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace
from typing import Any

import pytest

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
    StartProcess,
    StopProcess,
    TimerFired,
    TimerKind,
)
from backends.lifecycle import Lifecycle, LifecyclePolicy, transition
from routing.types import BackendState

S = BackendState
NOW = 100.0
U = LifecyclePolicy(managed=False, fail_threshold=2, canary_retry_s=30.0)
M = LifecyclePolicy(
    managed=True,
    fail_threshold=2,
    start_timeout_s=60.0,
    grace_s=10.0,
    backoff_initial_s=1.0,
    backoff_max_s=8.0,
    max_restarts=3,
    window_s=100.0,
    canary_retry_s=30.0,
)
DETACHED = replace(M, detached=True)
START_TO, RESTART = TimerKind.START_TIMEOUT, TimerKind.RESTART
ADMITTED = frozenset({S.READY, S.DRAINING, S.CORDONED})


def at(state: BackendState, **fields: Any) -> Lifecycle:
    fields.setdefault("canary_seq", 1)
    fields.setdefault("timer_seq", 1)
    return Lifecycle(state=state, reason="before", **fields)


def step(
    lc: Lifecycle, event: Event, policy: LifecyclePolicy = U, now: float = NOW
) -> tuple[Lifecycle, list[Action]]:
    """The transition, with the Log actions left out (tested on their own)."""
    new, actions = transition(lc, event, now, policy)
    return new, [a for a in actions if not isinstance(a, Log)]


# (id, policy, before, event, state after, actions after without Log)
TABLE: list[tuple[str, LifecyclePolicy, Lifecycle, Event, BackendState, list[Action]]] = [
    # -- probe ok: only STARTING and DOWN start a canary --------------------------------------------
    ("ok/starting->canary", U, at(S.STARTING), ProbeOk(), S.CANARY, [RunCanary(2)]),
    ("ok/down->canary", U, at(S.DOWN), ProbeOk(), S.CANARY, [RunCanary(2)]),
    ("ok/managed-starting->canary", M, at(S.STARTING), ProbeOk(), S.CANARY, [RunCanary(2)]),
    ("ok/canary-stays", U, at(S.CANARY), ProbeOk(), S.CANARY, []),
    ("ok/ready-stays", U, at(S.READY), ProbeOk(), S.READY, []),
    ("ok/draining-stays", U, at(S.DRAINING, drained=True), ProbeOk(), S.DRAINING, []),
    ("ok/cordoned-stays", U, at(S.CORDONED, cordoned=True), ProbeOk(), S.CORDONED, []),
    ("ok/gave-up-stays-down", M, at(S.DOWN, gave_up=True), ProbeOk(), S.DOWN, []),
    ("ok/canary-hold-stays-down", U, at(S.DOWN, canary_retry_at=NOW + 1), ProbeOk(), S.DOWN, []),
    ("ok/canary-hold-over", U, at(S.DOWN, canary_retry_at=NOW), ProbeOk(), S.CANARY, [RunCanary(2)]),
    # -- probe failed: threshold 2, so probe_failures=1 before means this one crosses it ---------------
    ("fail/below-threshold", U, at(S.READY), ProbeFailed("x"), S.READY, []),
    ("fail/ready->down", U, at(S.READY, probe_failures=1), ProbeFailed("x"), S.DOWN, []),
    ("fail/draining->down", U, at(S.DRAINING, drained=True, probe_failures=1), ProbeFailed("x"), S.DOWN, []),
    ("fail/cordoned->down", U, at(S.CORDONED, cordoned=True, probe_failures=1), ProbeFailed("x"), S.DOWN, []),
    ("fail/canary->down", U, at(S.CANARY, probe_failures=1), ProbeFailed("x"), S.DOWN, []),
    ("fail/starting->down", U, at(S.STARTING, probe_failures=1), ProbeFailed("x"), S.DOWN, []),
    ("fail/managed-starting-stays", M, at(S.STARTING, probe_failures=5), ProbeFailed("x"), S.STARTING, []),
    ("fail/down-stays", M, at(S.DOWN, probe_failures=1, down_since=90.0), ProbeFailed("x"), S.DOWN, []),
    (
        "fail/managed-ready->down+restart-after-grace",
        M,
        at(S.READY, probe_failures=1),
        ProbeFailed("x"),
        S.DOWN,
        [ArmTimer(RESTART, 10.0, 2)],
    ),
    (
        "fail/managed-canary-failed-becomes-outage",
        M,
        at(S.DOWN, probe_failures=1, down_since=NOW, canary_retry_at=NOW + 30),
        ProbeFailed("x"),
        S.DOWN,
        [ArmTimer(RESTART, 10.0, 2)],
    ),
    # -- canary results: only the current run, only in CANARY -------------------------------------
    ("pass/canary->ready", U, at(S.CANARY), CanaryPassed(1), S.READY, [ResetBreaker()]),
    ("pass/drained->draining", U, at(S.CANARY, drained=True), CanaryPassed(1), S.DRAINING, [ResetBreaker()]),
    (
        "pass/cordoned->cordoned",
        U,
        at(S.CANARY, cordoned=True),
        CanaryPassed(1),
        S.CORDONED,
        [ResetBreaker()],
    ),
    (
        "pass/both->draining",
        U,
        at(S.CANARY, drained=True, cordoned=True),
        CanaryPassed(1),
        S.DRAINING,
        [ResetBreaker()],
    ),
    ("pass/stale-seq", U, at(S.CANARY, canary_seq=2), CanaryPassed(1), S.CANARY, []),
    ("pass/in-down", U, at(S.DOWN), CanaryPassed(1), S.DOWN, []),
    ("pass/in-starting", U, at(S.STARTING), CanaryPassed(1), S.STARTING, []),
    ("pass/in-draining", U, at(S.DRAINING, drained=True), CanaryPassed(1), S.DRAINING, []),
    ("failc/canary->down", U, at(S.CANARY), CanaryFailed(1, "wrong"), S.DOWN, []),
    ("failc/managed-no-restart", M, at(S.CANARY), CanaryFailed(1, "wrong"), S.DOWN, []),
    ("failc/stale-seq", U, at(S.CANARY, canary_seq=2), CanaryFailed(1, "wrong"), S.CANARY, []),
    ("failc/in-ready", U, at(S.READY), CanaryFailed(1, "wrong"), S.READY, []),
    # -- circuit: a flag, never a state change ----------------------------------------------------
    ("circuit/open-ready-stays", U, at(S.READY), CircuitChanged(CircuitState.OPEN), S.READY, []),
    ("circuit/open-down-stays", U, at(S.DOWN), CircuitChanged(CircuitState.OPEN), S.DOWN, []),
    (
        "circuit/closed",
        U,
        at(S.READY, circuit=CircuitState.OPEN),
        CircuitChanged(CircuitState.CLOSED),
        S.READY,
        [],
    ),
    # -- process events (managed) -----------------------------------------------------------------
    ("started/starting", M, at(S.STARTING), ProcessStarted(42), S.STARTING, []),
    ("started/ready-ignored", M, at(S.READY), ProcessStarted(42), S.READY, []),
    (
        "exit/ready->down",
        M,
        at(S.READY),
        ProcessExited("exited with code 3", 3),
        S.DOWN,
        [ArmTimer(RESTART, 10.0, 2)],
    ),
    (
        "exit/starting->down",
        M,
        at(S.STARTING),
        ProcessExited("exited with code 3", 3),
        S.DOWN,
        [ArmTimer(RESTART, 10.0, 2)],
    ),
    (
        "exit/draining->down",
        M,
        at(S.DRAINING, drained=True),
        ProcessExited("x", 1),
        S.DOWN,
        [ArmTimer(RESTART, 10.0, 2)],
    ),
    (
        "exit/cordoned->down",
        M,
        at(S.CORDONED, cordoned=True),
        ProcessExited("x", 1),
        S.DOWN,
        [ArmTimer(RESTART, 10.0, 2)],
    ),
    ("exit/canary->down", M, at(S.CANARY), ProcessExited("x", 1), S.DOWN, [ArmTimer(RESTART, 10.0, 2)]),
    ("exit/requested-is-no-outage", M, at(S.READY), ProcessExited("x", 0, requested=True), S.READY, []),
    ("exit/after-give-up", M, at(S.DOWN, gave_up=True), ProcessExited("x", 1), S.DOWN, []),
    (
        "exit/down-rearms-from-outage-start",
        M,
        at(S.DOWN, down_since=95.0),
        ProcessExited("x", 1),
        S.DOWN,
        [ArmTimer(RESTART, 5.0, 2)],
    ),
    (
        "exit/spawn-failure-gives-up-at-once",
        M,
        at(S.STARTING),
        ProcessExited("could not be started: [Errno 2] No such file", spawn_failed=True),
        S.DOWN,
        [GiveUp("cannot start the engine process: could not be started: [Errno 2] No such file")],
    ),
    (
        "exit/detached-0-is-no-outage",
        DETACHED,
        at(S.STARTING),
        ProcessExited("exited with code 0", 0),
        S.STARTING,
        [],
    ),
    (
        "exit/detached-1-is-an-outage",
        DETACHED,
        at(S.READY),
        ProcessExited("x", 1),
        S.DOWN,
        [ArmTimer(RESTART, 10.0, 2)],
    ),
    (
        "exit/undetached-0-is-an-outage",
        M,
        at(S.READY),
        ProcessExited("x", 0),
        S.DOWN,
        [ArmTimer(RESTART, 10.0, 2)],
    ),
    (
        "exit/cap-reached-gives-up",
        M,
        at(S.READY, restarts=(10.0, 50.0, 99.0)),
        ProcessExited("exited with code 1", 1),
        S.DOWN,
        [GiveUp("gave up after 3 restarts in 100 s: engine process exited with code 1"), StopProcess()],
    ),
    (
        "exit/old-restarts-leave-the-window",
        M,
        at(S.READY, restarts=(0.0, 0.5, 99.0)),
        ProcessExited("x", 1),
        S.DOWN,
        [ArmTimer(RESTART, 10.0, 2)],
    ),
    (
        "exit/backoff-beyond-grace",
        replace(M, grace_s=0.0),
        at(S.READY, restarts=(98.0, 99.0)),
        ProcessExited("x", 1),
        S.DOWN,
        [ArmTimer(RESTART, 2.0, 2)],
    ),
    # -- timers -----------------------------------------------------------------------------------
    (
        "timer/start-timeout->down+restart",
        M,
        at(S.STARTING, started_at=NOW - 60),
        TimerFired(START_TO, 1),
        S.DOWN,
        [ArmTimer(RESTART, 0.0, 2)],
    ),
    (
        "timer/start-timeout-stale",
        M,
        at(S.STARTING, started_at=40.0),
        TimerFired(START_TO, 0),
        S.STARTING,
        [],
    ),
    ("timer/start-timeout-in-canary", M, at(S.CANARY), TimerFired(START_TO, 1), S.CANARY, []),
    (
        "timer/restart-due",
        M,
        at(S.DOWN, down_since=90.0),
        TimerFired(RESTART, 1),
        S.STARTING,
        [RestartProcess(), ArmTimer(START_TO, 60.0, 2)],
    ),
    ("timer/restart-stale", M, at(S.DOWN, down_since=90.0), TimerFired(RESTART, 0), S.DOWN, []),
    ("timer/restart-in-ready", M, at(S.READY), TimerFired(RESTART, 1), S.READY, []),
    ("timer/restart-after-give-up", M, at(S.DOWN, gave_up=True), TimerFired(RESTART, 1), S.DOWN, []),
    # -- operator ---------------------------------------------------------------------------------
    ("op/drain", U, at(S.READY), Operator(Command.DRAIN), S.DRAINING, []),
    ("op/undrain", U, at(S.DRAINING, drained=True), Operator(Command.UNDRAIN), S.READY, []),
    ("op/cordon", U, at(S.READY), Operator(Command.CORDON), S.CORDONED, []),
    ("op/uncordon", U, at(S.CORDONED, cordoned=True), Operator(Command.UNCORDON), S.READY, []),
    (
        "op/undrain-still-cordoned",
        U,
        at(S.DRAINING, drained=True, cordoned=True),
        Operator(Command.UNDRAIN),
        S.CORDONED,
        [],
    ),
    ("op/drain-wins-over-cordon", U, at(S.CORDONED, cordoned=True), Operator(Command.DRAIN), S.DRAINING, []),
    (
        "op/uncordon-still-drained",
        U,
        at(S.DRAINING, drained=True, cordoned=True),
        Operator(Command.UNCORDON),
        S.DRAINING,
        [],
    ),
    ("op/cordon-while-down", U, at(S.DOWN), Operator(Command.CORDON), S.DOWN, []),
    ("op/drain-while-canary", U, at(S.CANARY), Operator(Command.DRAIN), S.CANARY, []),
    ("op/drain-while-starting", M, at(S.STARTING), Operator(Command.DRAIN), S.STARTING, []),
    (
        "op/reset-managed-gave-up",
        M,
        at(S.DOWN, gave_up=True, restarts=(99.0,)),
        Operator(Command.RESET),
        S.STARTING,
        [ResetBreaker(), RestartProcess(), ArmTimer(START_TO, 60.0, 2)],
    ),
    (
        "op/reset-unmanaged-down",
        U,
        at(S.DOWN, canary_retry_at=NOW + 30),
        Operator(Command.RESET),
        S.STARTING,
        [ResetBreaker()],
    ),
    ("op/reset-ready-clears-the-breaker", M, at(S.READY), Operator(Command.RESET), S.READY, [ResetBreaker()]),
    (
        "op/reset-ready-closes-an-open-circuit",
        U,
        at(S.READY, circuit=CircuitState.OPEN),
        Operator(Command.RESET),
        S.READY,
        [ResetBreaker()],
    ),
    # -- configuration ------------------------------------------------------------------------------
    (
        "config/added-managed-starts",
        M,
        Lifecycle(),
        ConfigAdded(),
        S.STARTING,
        [StartProcess(), ArmTimer(START_TO, 60.0, 1)],
    ),
    ("config/added-unmanaged", U, Lifecycle(), ConfigAdded(), S.STARTING, []),
    ("config/added-twice", M, at(S.STARTING, started_at=50.0), ConfigAdded(), S.STARTING, []),
    ("config/added-when-ready", M, at(S.READY), ConfigAdded(), S.READY, []),
    ("config/removed-managed", M, at(S.READY), ConfigRemoved(), S.DOWN, [StopProcess()]),
    ("config/removed-unmanaged", U, at(S.READY), ConfigRemoved(), S.DOWN, []),
    ("removed/probe-ok-ignored", U, at(S.DOWN, removed=True), ProbeOk(), S.DOWN, []),
    ("removed/exit-ignored", M, at(S.DOWN, removed=True), ProcessExited("x", 1), S.DOWN, []),
    ("removed/reset-ignored", M, at(S.DOWN, removed=True), Operator(Command.RESET), S.DOWN, []),
]


@pytest.mark.parametrize(
    ("policy", "before", "event", "state", "actions"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_transition_table(
    policy: LifecyclePolicy, before: Lifecycle, event: Event, state: BackendState, actions: list[Action]
) -> None:
    after, done = step(before, event, policy)
    assert (after.state, done) == (state, actions)


def test_the_table_covers_every_state_and_every_event_type() -> None:
    assert {row[2].state for row in TABLE} == set(BackendState)
    assert {type(row[3]) for row in TABLE} == {
        ConfigAdded, ConfigRemoved, ProbeOk, ProbeFailed, CanaryPassed, CanaryFailed, CircuitChanged,
        ProcessStarted, ProcessExited, Operator, TimerFired,
    }  # fmt: skip
    assert {row[3].command for row in TABLE if isinstance(row[3], Operator)} == set(Command)


# -- what the state carries besides its name ----------------------------------------------------------


def test_canary_failure_keeps_it_down_with_the_check_and_its_answer_and_holds_the_retry() -> None:
    after, _ = step(at(S.CANARY), CanaryFailed(1, "check 'math' answered '392': expected '391'"))
    assert after.reason == "canary failed: check 'math' answered '392': expected '391'"
    assert (after.canary_retry_at, after.down_since) == (NOW + 30, NOW)


def test_open_circuit_makes_ready_unroutable_and_half_open_lets_the_trial_through() -> None:
    ready = at(S.READY)
    opened, actions = transition(ready, CircuitChanged(CircuitState.OPEN, "5 consecutive failures"), NOW, U)
    assert (opened.routable, opened.circuit) == (False, CircuitState.OPEN)
    assert actions == [Log(logging.WARNING, "circuit open: 5 consecutive failures")]
    half, _ = step(opened, CircuitChanged(CircuitState.HALF_OPEN))
    assert half.routable is True
    assert step(at(S.DRAINING), CircuitChanged(CircuitState.CLOSED))[0].routable is False


def test_a_passed_canary_closes_the_circuit() -> None:
    after, actions = step(at(S.CANARY, circuit=CircuitState.OPEN), CanaryPassed(1))
    assert (after.circuit, after.routable, actions) == (CircuitState.CLOSED, True, [ResetBreaker()])


def test_probe_failure_reason_and_counter() -> None:
    after, _ = step(at(S.READY, probe_failures=1), ProbeFailed("ConnectError: refused"))
    assert (after.reason, after.probe_failures, after.down_since) == (
        "health probe failed: ConnectError: refused",
        2,
        NOW,
    )
    assert step(after, ProbeOk())[0].probe_failures == 0


def test_exit_reason_names_code_and_last_output_lines() -> None:
    lines = ("loading", "", "CUDA out of memory", "Traceback: boom")
    after, _ = step(at(S.READY), ProcessExited("exited with code 1", 1, lines=lines), M)
    assert (
        after.reason
        == "engine process exited with code 1; last output: loading | CUDA out of memory | Traceback: boom"
    )


def test_start_timeout_reason_and_the_outage_counts_from_the_start() -> None:
    after, actions = step(
        at(S.STARTING, started_at=40.0), TimerFired(START_TO, 1, ("Loading weights 40%",)), M
    )
    assert after.reason == "not healthy within 60 s of starting; last output: Loading weights 40%"
    assert after.down_since == 40.0  # so the grace period is long over: restart at once
    assert actions == [ArmTimer(RESTART, 0.0, 2)]


def test_restart_counts_itself_and_clears_the_outage() -> None:
    before = at(S.DOWN, down_since=90.0, restarts=(0.0, 95.0), canary_retry_at=NOW + 5)  # 0.0: out
    after, _ = step(before, TimerFired(RESTART, 1), M)
    assert (after.restarts, after.started_at, after.down_since, after.canary_retry_at) == (
        (95.0, NOW),
        NOW,
        None,
        None,
    )
    assert after.reason == "restarting the engine process (2 of at most 3 in 100 s)"
    assert after.restarts_in_window(NOW, M.window_s) == 2


def test_reset_forgets_the_give_up_and_the_restart_history() -> None:
    after, _ = step(at(S.DOWN, gave_up=True, restarts=(99.0,)), Operator(Command.RESET), M)
    assert (after.gave_up, after.restarts, after.reason) == (
        False,
        (),
        "starting the engine process (reset by the operator)",
    )


@pytest.mark.parametrize("circuit", [CircuitState.OPEN, CircuitState.HALF_OPEN])
@pytest.mark.parametrize("state", [S.READY, S.CORDONED, S.DOWN])
def test_reset_closes_the_circuit_so_a_ready_backend_is_routable_again(
    circuit: CircuitState, state: BackendState
) -> None:
    before = at(state, circuit=circuit, cordoned=state is S.CORDONED)
    after, actions = step(before, Operator(Command.RESET), U)
    assert after.circuit is CircuitState.CLOSED
    assert ResetBreaker() in actions
    assert after.routable is (state is S.READY)
    assert after.state is (S.STARTING if state is S.DOWN else state)  # DOWN: re-probed as before


def test_a_reset_that_closes_the_circuit_says_so() -> None:
    before = replace(at(S.READY, circuit=CircuitState.OPEN), reason="5 consecutive requests failed")
    after, actions = transition(before, Operator(Command.RESET), NOW, U)
    said = "circuit closed: reset by the operator (it was open)"
    assert actions == [Log(logging.INFO, f"ready -> ready: {said}"), ResetBreaker()]
    assert after.reason == said  # the reason the circuit opened does not outlive it


def test_operator_flags_are_kept_while_down() -> None:
    after, actions = transition(at(S.DOWN), Operator(Command.CORDON), NOW, U)
    assert (after.cordoned, after.state) == (True, S.DOWN)
    assert actions == [Log(logging.INFO, "operator cordon: applies once the canary passes")]


def test_state_changes_are_logged_once_with_level() -> None:
    _, actions = transition(at(S.READY, probe_failures=1), ProbeFailed("boom"), NOW, U)
    assert actions == [Log(logging.WARNING, "ready -> down: health probe failed: boom")]
    _, actions = transition(at(S.CANARY), CanaryPassed(1), NOW, U)
    assert actions == [Log(logging.INFO, "canary -> ready: canary passed"), ResetBreaker()]
    _, actions = transition(at(S.READY), ProbeOk(), NOW, U)
    assert actions == []
    _, actions = transition(at(S.READY, restarts=(98.0, 99.0, 99.5)), ProcessExited("x", 1), NOW, M)
    assert [type(a) for a in actions] == [GiveUp, StopProcess]  # the give-up is its own (error) line


def test_backoff_doubles_up_to_the_cap() -> None:
    assert [M.backoff(n) for n in range(6)] == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0]


# -- stories: several events in a row ------------------------------------------------------------------


def run(
    lc: Lifecycle, policy: LifecyclePolicy, *events: tuple[float, Event]
) -> tuple[Lifecycle, list[Action]]:
    actions: list[Action] = []
    for now, event in events:
        lc, done = step(lc, event, policy, now)
        actions += done
    return lc, actions


def test_a_cordoned_backend_that_goes_down_comes_back_cordoned_after_its_canary() -> None:
    lc, _ = run(at(S.CORDONED, cordoned=True), U, (1, ProbeFailed("x")), (2, ProbeFailed("x")))
    assert lc.state is S.DOWN
    lc, actions = run(lc, U, (3, ProbeOk()))
    assert (lc.state, actions) == (S.CANARY, [RunCanary(2)])
    lc, _ = run(lc, U, (4, CanaryPassed(2)))
    assert lc.state is S.CORDONED


def test_a_result_of_an_earlier_canary_run_never_admits() -> None:
    lc, _ = run(at(S.CANARY), U, (1, ProbeFailed("x")), (2, ProbeFailed("x")), (3, ProbeOk()))
    assert (lc.state, lc.canary_seq) == (S.CANARY, 2)
    lc, _ = run(lc, U, (4, CanaryPassed(1)))
    assert lc.state is S.CANARY
    lc, _ = run(lc, U, (5, CanaryPassed(2)))
    assert lc.state is S.READY


def test_a_failed_canary_is_retried_on_a_probe_after_the_hold() -> None:
    lc, _ = run(at(S.CANARY), U, (100, CanaryFailed(1, "wrong")), (129.9, ProbeOk()))
    assert lc.state is S.DOWN
    lc, actions = run(lc, U, (130, ProbeOk()))
    assert (lc.state, actions) == (S.CANARY, [RunCanary(2)])


def test_a_restart_timer_from_an_earlier_outage_is_stale_after_a_recovery() -> None:
    lc, actions = run(at(S.READY), M, (100, ProcessExited("x", 1)))
    assert actions == [ArmTimer(RESTART, 10.0, 2)]
    # It came back by itself (someone restarted it), then failed its canary: the old timer must not fire.
    lc, _ = run(lc, M, (101, ProbeOk()), (102, CanaryFailed(lc.canary_seq + 1, "wrong")))
    lc, actions = run(lc, M, (110, TimerFired(RESTART, 2)))
    assert (lc.state, actions) == (S.DOWN, [])


def test_managed_engine_that_keeps_crashing_is_restarted_with_backoff_then_given_up() -> None:
    policy = replace(M, grace_s=0.0)
    lc, actions = run(Lifecycle(), policy, (0, ConfigAdded()), (0.1, ProcessStarted(7)), (1, ProbeOk()))
    lc, _ = run(lc, policy, (1.5, CanaryPassed(lc.canary_seq)))
    assert lc.state is S.READY
    now, delays = 2.0, []
    boom = ProcessExited("exited with code 1", 1, lines=("boom",))
    for _ in range(3):
        lc, actions = run(lc, policy, (now, boom))
        (timer,) = actions
        assert isinstance(timer, ArmTimer) and timer.kind is RESTART
        delays.append(timer.after_s)
        now += timer.after_s
        lc, actions = run(lc, policy, (now, TimerFired(RESTART, timer.seq)), (now, ProcessStarted(8)))
        assert lc.state is S.STARTING and isinstance(actions[0], RestartProcess)
    assert delays == [0.0, 1.0, 2.0]
    lc, actions = run(lc, policy, (now, boom))
    reason = "gave up after 3 restarts in 100 s: engine process exited with code 1; last output: boom"
    assert (lc.state, lc.gave_up, lc.reason, actions) == (
        S.DOWN,
        True,
        reason,
        [GiveUp(reason), StopProcess()],
    )
    assert (
        run(lc, policy, (now + 50, ProbeOk()), (now + 60, TimerFired(RESTART, lc.timer_seq)))[0].state
        is S.DOWN
    )


def test_a_managed_engine_that_never_becomes_healthy_is_restarted_then_given_up() -> None:
    policy = replace(M, max_restarts=1)
    lc, actions = run(
        Lifecycle(), policy, (0, ConfigAdded()), (1, ProbeFailed("refused")), (2, ProbeFailed("refused"))
    )
    assert lc.state is S.STARTING  # loading: failed probes do not end STARTING
    (_start, timeout) = actions
    assert isinstance(timeout, ArmTimer)
    lc, actions = run(lc, policy, (60, TimerFired(START_TO, timeout.seq)))
    (restart_timer,) = actions
    assert isinstance(restart_timer, ArmTimer)
    lc, actions = run(lc, policy, (60, TimerFired(RESTART, restart_timer.seq)))
    timeout2 = actions[1]
    assert isinstance(timeout2, ArmTimer)
    lc, actions = run(lc, policy, (120, TimerFired(START_TO, timeout2.seq, ("still loading",))))
    cause = "not healthy within 60 s of starting; last output: still loading"
    assert lc.reason == f"gave up after 1 restarts in 100 s: {cause}"
    assert actions == [GiveUp(lc.reason), StopProcess()]


def test_stop_and_restart_exits_never_count_as_outages() -> None:
    lc, _ = run(at(S.DOWN, down_since=0.0), M, (50, TimerFired(RESTART, 1)))
    lc, actions = run(
        lc, M, (50.1, ProcessExited("was killed by signal 15 (SIGTERM)", signal=15, requested=True))
    )
    assert (lc.state, actions) == (S.STARTING, [])


# -- what must never happen, over every (state, flags) x event ---------------------------------------------

SAMPLE_EVENTS: list[Event] = [
    ConfigAdded(), ConfigRemoved(), ProbeOk(), ProbeFailed("x"), CanaryPassed(1), CanaryPassed(2),
    CanaryFailed(1, "x"), CanaryFailed(2, "x"), *(CircuitChanged(s) for s in CircuitState), ProcessStarted(1),
    ProcessExited("x", 1), ProcessExited("x", 0), ProcessExited("x", requested=True),
    ProcessExited("x", spawn_failed=True), *(Operator(c) for c in Command),
    *(TimerFired(k, n) for k in TimerKind for n in (1, 2)),
]  # fmt: skip


def admitted_state(drained: bool, cordoned: bool) -> BackendState:
    return S.DRAINING if drained else S.CORDONED if cordoned else S.READY


def sample_lifecycles() -> list[Lifecycle]:
    """Every state with every mix of operator flags and probe failures that can occur: gave_up only when
    DOWN, an admitted state only with the flags that make it."""
    flags = list(itertools.product([False, True], repeat=4))  # drained, cordoned, gave_up, probe_failures=1
    return [
        at(
            state,
            drained=d,
            cordoned=c,
            gave_up=g,
            probe_failures=int(f),
            canary_seq=2,
            timer_seq=2,
            down_since=1.0,
        )
        for state in BackendState
        for d, c, g, f in flags
        if (state is S.DOWN or not g) and (state not in ADMITTED or state is admitted_state(d, c))
    ]


@pytest.mark.parametrize("policy", [U, M, DETACHED], ids=["unmanaged", "managed", "detached"])
def test_invariants_over_every_state_and_event(policy: LifecyclePolicy) -> None:
    admitted, checked = ADMITTED, 0
    for before, event in itertools.product(sample_lifecycles(), SAMPLE_EVENTS):
        after, actions = transition(before, event, NOW, policy)
        checked += 1
        if after.state in admitted and before.state not in admitted:  # only the current canary admits
            assert before.state is S.CANARY and event == CanaryPassed(before.canary_seq), (before, event)
        if after.state in admitted:  # and it admits into the operator's state
            assert after.state is admitted_state(after.drained, after.cordoned), (before, event)
        if before.state is S.DRAINING and isinstance(event, ProbeOk):
            assert after.state is S.DRAINING
        if isinstance(event, CanaryFailed):
            assert after.state not in admitted or after == before
        if before.gave_up and not (isinstance(event, Operator) and event.command is Command.RESET):
            assert after.state is not S.CANARY and not any(
                isinstance(a, RestartProcess | RunCanary) for a in actions
            )
        if not policy.managed:
            assert not any(
                isinstance(a, StartProcess | RestartProcess | StopProcess | ArmTimer) for a in actions
            )
        if any(isinstance(a, RestartProcess) for a in actions):
            assert isinstance(event, TimerFired | Operator), (before, event)
        if isinstance(event, ConfigRemoved) or before.removed:
            assert after.removed and after.state is S.DOWN and not after.routable
    assert checked == (16 + 2 * 8 + 2 + 4 + 2) * len(SAMPLE_EVENTS)  # DOWN; STARTING, CANARY; admitted


def test_removed_backends_ignore_everything() -> None:
    removed = at(S.DOWN, removed=True)
    for event in SAMPLE_EVENTS:
        assert transition(removed, event, NOW, M) == (removed, [])
