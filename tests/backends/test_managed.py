"""backends.managed: the one writer with real processes, a real canary, real timers (short ones)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from simprocs import SIM_START_TIMEOUT_S, sim_argv

from backends.breaker import BreakerPolicy, CircuitBreaker
from backends.canary import CanaryResult
from backends.events import Command, Operator, ProbeFailed, ProbeOk
from backends.lifecycle import Lifecycle, LifecyclePolicy
from backends.managed import BackendController, policy_for
from config.settings import (
    BackendConfig,
    BreakerConfig,
    CanaryConfig,
    HealthConfig,
    ManagedConfig,
    RestartConfig,
    Settings,
)
from routing.types import BackendState
from tools import procs

from upstreams import PROBE_TIMEOUT_S

pytestmark = pytest.mark.anyio
S = BackendState
WITHIN_S = SIM_START_TIMEOUT_S


class Watcher:
    """Records each state the controller reports; ``until`` waits (with a deadline) for a predicate."""

    def __init__(self) -> None:
        self.states: list[tuple[BackendState, float]] = []
        self.changed = asyncio.Event()

    def __call__(self, lc: Lifecycle) -> None:
        self.states.append((lc.state, time.monotonic()))
        self.changed.set()

    async def until(self, predicate: Callable[[], bool], within: float = WITHIN_S) -> None:
        async with asyncio.timeout(within):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


async def eventually(predicate: Callable[[], bool], within: float = 10.0) -> None:
    """For what no state change announces (a task's side effect): poll, with a deadline."""
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - nothing to wait on
            await asyncio.sleep(0.005)


async def probe_forever(ctl: BackendController, url: str, interval_s: float = 0.05) -> None:
    """What the health checker will do once wired: GET /health, send the outcome. A killed simulator refuses
    at once; a live one gets PROBE_TIMEOUT_S (1 s is within reach of a loaded machine)."""
    async with httpx.AsyncClient(timeout=PROBE_TIMEOUT_S) as client:
        while True:
            try:
                ok = (await client.get(url + "/health")).status_code == 200
            except httpx.HTTPError as exc:
                ctl.send(ProbeFailed(type(exc).__name__))
            else:
                ctl.send(ProbeOk() if ok else ProbeFailed("HTTP status"))
            await asyncio.sleep(interval_s)


@contextlib.asynccontextmanager
async def controlled(
    managed: dict[str, Any], port: int | None = None, **settings: Any
) -> AsyncIterator[tuple[BackendController, Watcher]]:
    port = port or procs.free_port()
    url = f"http://{procs.LOCALHOST}:{port}"
    backend = BackendConfig(id="eng", url=url, models=("sim-model",), managed=ManagedConfig(**managed))
    watcher = Watcher()
    async with httpx.AsyncClient() as client:
        ctl = BackendController.from_settings(backend, Settings(**settings), client, on_change=watcher)
        ctl.start()
        prober = asyncio.create_task(probe_forever(ctl, url))
        try:
            yield ctl, watcher
        finally:
            prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await prober
            await ctl.aclose()


FAST = {"grace_s": 0.0, "backoff_initial_s": 0.01, "backoff_max_s": 0.02, "window_s": 60}


async def test_a_sigkilled_simulator_is_restarted_after_the_grace_period_and_its_exit_shows() -> None:
    port = procs.free_port()
    managed = {"command": sim_argv(port), "restart": {**FAST, "grace_s": 0.3, "max_restarts": 3}}
    async with controlled(managed, port, health={"fail_threshold": 1}) as (ctl, watcher):
        await watcher.until(lambda: ctl.lifecycle.state is S.READY)
        first_pid = ctl.status()["managed"]["pid"]
        assert ctl.status()["canary"]["passed"] is True
        os.kill(first_pid, signal.SIGKILL)
        await watcher.until(lambda: ctl.lifecycle.state is S.DOWN)
        await watcher.until(lambda: ctl.lifecycle.state is S.READY)  # restarted, probed, canaried

        status = ctl.status()
        managed_status = status["managed"]
        (exit_,) = managed_status["exits"]
        assert (exit_["cause"], exit_["signal"], exit_["code"], exit_["requested"]) == (
            "was killed by signal 9 (SIGKILL)",
            9,
            None,
            False,
        )
        assert (managed_status["restarts_in_window"], managed_status["gave_up"]) == (1, False)
        assert managed_status["pid"] not in (None, first_pid) and managed_status["running"] is True
        down_at = next(t for s, t in watcher.states if s is S.DOWN)
        restarted_at = next(t for s, t in watcher.states if s is S.STARTING and t > down_at)
        assert restarted_at - down_at >= 0.3  # the grace period
        sequence = [s for s, _ in watcher.states]
        assert sequence == [S.CANARY, S.READY, S.DOWN, S.STARTING, S.CANARY, S.READY]
        assert (status["state"], status["routable"]) == ("ready", True)


async def test_a_start_command_that_always_fails_is_capped_with_its_last_lines() -> None:
    managed = {"command": "echo boom; exit 3", "restart": {**FAST, "max_restarts": 2}}
    async with controlled(managed) as (ctl, watcher):
        await watcher.until(lambda: ctl.lifecycle.gave_up, within=10)
        status = ctl.status()
        assert status["state"] == "down"
        assert (
            status["reason"]
            == "gave up after 2 restarts in 60 s: engine process exited with code 3; last output: boom"
        )
        assert [(e["code"], e["lines"]) for e in status["managed"]["exits"]] == [(3, ["boom"])] * 3
        assert (status["managed"]["restarts_in_window"], status["managed"]["gave_up"]) == (2, True)
        # No silent loop: nothing starts again (ten times the backoff, gated on the supervisor's own record).
        exits = len(ctl.exits)
        with pytest.raises(TimeoutError):
            await watcher.until(lambda: len(ctl.exits) > exits, within=0.2)
        assert ctl.supervisor is not None and not ctl.supervisor.running


async def test_a_start_command_that_does_not_exist_gives_up_at_once() -> None:
    async with controlled({"command": ["/nonexistent/vllm", "serve"], "restart": FAST}) as (ctl, watcher):
        await watcher.until(lambda: ctl.lifecycle.gave_up, within=10)
        status = ctl.status()
        assert status["reason"] == (
            "cannot start the engine process: could not be started: "
            "[Errno 2] No such file or directory: '/nonexistent/vllm'"
        )
        assert (len(status["managed"]["exits"]), status["managed"]["restarts_in_window"]) == (1, 0)


async def test_an_engine_that_never_becomes_healthy_is_restarted_then_given_up_and_stopped() -> None:
    managed = {"command": ["sleep", "300"], "start_timeout_s": 0.3, "restart": {**FAST, "max_restarts": 1}}
    async with controlled(managed) as (ctl, watcher):
        await watcher.until(lambda: ctl.lifecycle.gave_up, within=10)
        assert (
            ctl.lifecycle.reason == "gave up after 1 restarts in 60 s: not healthy within 0.3 s of starting"
        )
        await eventually(lambda: len(ctl.exits) == 2, within=10)
        assert ctl.supervisor is not None and not ctl.supervisor.running
        assert [e.requested for e in ctl.exits] == [True, True]  # both stopped by us: restart, give-up


# -- unmanaged, with a stand-in canary -------------------------------------------------------------------


def unmanaged(canary: Callable[[], Any], **kw: Any) -> tuple[BackendController, Watcher]:
    watcher = Watcher()
    policy = LifecyclePolicy(fail_threshold=2, canary_retry_s=30.0)
    return BackendController("b", policy, canary, on_change=watcher, **kw), watcher


async def test_a_failed_canary_keeps_it_down_and_status_says_which_check_answered_what() -> None:
    result = CanaryResult(
        False, "math", "17 x 23 = 392", "check 'math' answered '17 x 23 = 392', expected '391'"
    )

    async def canary() -> CanaryResult:
        return result

    ctl, watcher = unmanaged(canary)
    ctl.start()
    ctl.send(ProbeOk())
    await watcher.until(lambda: ctl.lifecycle.state is S.DOWN)
    status = ctl.status()
    assert status["reason"] == "canary failed: check 'math' answered '17 x 23 = 392', expected '391'"
    assert (status["canary"]["check_name"], status["canary"]["answered_text"]) == ("math", "17 x 23 = 392")
    assert status["managed"] is None and status["routable"] is False
    ctl.send(ProbeOk())  # within the retry hold: no new canary
    assert ctl.lifecycle.state is S.DOWN
    await ctl.aclose()


async def test_a_hanging_canary_blocks_nothing_and_an_outage_overtakes_it() -> None:
    released = asyncio.Event()

    async def canary() -> CanaryResult:
        await released.wait()
        return CanaryResult(True, "consistency", "x", "all 1 checks passed")

    ctl, _ = unmanaged(canary)
    ctl.send(ProbeOk())
    assert ctl.lifecycle.state is S.CANARY
    ctl.send(ProbeFailed("refused"))
    ctl.send(ProbeFailed("refused"))
    assert ctl.lifecycle.state is S.DOWN
    released.set()  # the old run's pass arrives late: it must not admit
    await eventually(lambda: ctl.last_canary is not None)
    assert ctl.lifecycle.state is S.DOWN
    await ctl.aclose()


async def test_a_canary_runner_that_raises_fails_the_canary() -> None:
    async def canary() -> CanaryResult:
        raise RuntimeError("bug")

    ctl, watcher = unmanaged(canary)
    ctl.send(ProbeOk())
    await watcher.until(lambda: ctl.lifecycle.state is S.DOWN)
    assert ctl.lifecycle.reason == "canary failed: the canary raised RuntimeError: bug"
    await ctl.aclose()


async def test_the_breaker_opens_on_failures_half_opens_on_time_and_closes_on_success() -> None:
    async def canary() -> CanaryResult:
        return CanaryResult(True, None, None, "no canary checks configured")

    ctl, watcher = unmanaged(canary, breaker=CircuitBreaker(BreakerPolicy(2, open_s=0.05, open_max_s=1)))
    ctl.send(ProbeOk())
    await watcher.until(lambda: ctl.lifecycle.state is S.READY)
    ctl.record_request(False)
    assert ctl.lifecycle.routable is True
    ctl.record_request(False)
    assert (ctl.status()["circuit"], ctl.lifecycle.routable, ctl.admit_request()) == ("open", False, False)
    assert ctl.lifecycle.state is S.READY  # a flag, not an outage
    await watcher.until(lambda: ctl.lifecycle.routable, within=5)  # the timer: half-open
    assert ctl.status()["circuit"] == "half_open"
    assert [ctl.admit_request(), ctl.admit_request()] == [True, False]  # one trial
    ctl.record_request(True)
    assert (ctl.status()["circuit"], ctl.admit_request(), ctl.admit_request()) == ("closed", True, True)
    await ctl.aclose()


async def test_every_open_period_ends_even_when_the_loop_timer_fires_before_the_clock_says_so() -> None:
    # Defect: the open period's timer fired a few microseconds early by the breaker's clock, the check read
    # OPEN and was never armed again: the circuit stayed open for good. Here the controller's clock runs at
    # 90 % of the loop's rate, so every timer it arms fires early by its clock: each of the 50 periods must
    # still half-open.
    periods = 50
    loop = asyncio.get_running_loop()
    start = loop.time()

    def lagging() -> float:
        return start + (loop.time() - start) * 0.9

    async def canary() -> CanaryResult:
        return CanaryResult(True, None, None, "no canary checks configured")

    breaker = CircuitBreaker(BreakerPolicy(1, open_s=0.005, open_max_s=0.005))
    ctl, watcher = unmanaged(canary, breaker=breaker, clock=lagging)
    ctl.send(ProbeOk())
    await watcher.until(lambda: ctl.lifecycle.state is S.READY)
    seen = []
    for _ in range(periods):
        assert ctl.admit_request() is True  # closed at first, then each period's one trial
        ctl.record_request(False)  # the trial fails: open again
        assert (ctl.status()["circuit"], ctl.lifecycle.routable) == ("open", False)
        await watcher.until(lambda: ctl.lifecycle.routable, within=5)
        seen.append((ctl.status()["circuit"], breaker.state(lagging()).value))  # both agree: a trial may go
    assert seen == [("half_open", "half_open")] * periods
    await ctl.aclose()


async def test_operator_reset_closes_an_open_circuit_and_the_backend_is_routable_again() -> None:
    async def canary() -> CanaryResult:
        return CanaryResult(True, None, None, "no canary checks configured")

    breaker = CircuitBreaker(BreakerPolicy(1, open_s=600, open_max_s=600))
    ctl, watcher = unmanaged(canary, breaker=breaker)
    ctl.send(ProbeOk())
    await watcher.until(lambda: ctl.lifecycle.state is S.READY)
    ctl.record_request(False)
    assert (ctl.status()["circuit"], ctl.lifecycle.routable, ctl.admit_request()) == ("open", False, False)
    ctl.send(Operator(Command.RESET))
    assert (ctl.status()["circuit"], ctl.lifecycle.routable) == ("closed", True)
    assert (breaker.retry_at(), breaker.consecutive_failures) == (None, 0)
    assert [ctl.admit_request(), ctl.admit_request()] == [True, True]  # closed: no single-trial limit
    assert ctl.lifecycle.state is S.READY
    await ctl.aclose()


async def test_operator_commands_and_events_sent_from_on_change_are_applied_in_order() -> None:
    async def canary() -> CanaryResult:
        return CanaryResult(True, None, None, "ok")

    seen: list[BackendState] = []
    watcher = Watcher()

    def on_change(lc: Lifecycle) -> None:
        seen.append(lc.state)
        watcher(lc)
        if lc.state is S.READY:
            ctl.send(Operator(Command.CORDON))  # re-entrant: queued, applied after this one

    ctl = BackendController("b", LifecyclePolicy(), canary, on_change=on_change)
    ctl.send(Operator(Command.DRAIN))
    ctl.send(ProbeOk())
    ctl.send(Operator(Command.UNDRAIN))
    await watcher.until(lambda: ctl.lifecycle.state is not S.CANARY, within=5)
    assert seen == [S.CANARY, S.READY, S.CORDONED]
    await ctl.aclose()


def test_policy_for_reads_health_canary_and_managed_sections() -> None:
    managed = ManagedConfig(command="x", start_timeout_s=5, restart=RestartConfig(grace_s=2, max_restarts=7))
    cfg = BackendConfig(id="a", url="http://a", models=("m",), managed=managed)
    policy = policy_for(cfg, HealthConfig(fail_threshold=4), CanaryConfig(retry_s=9))
    assert policy == LifecyclePolicy(
        managed=True,
        fail_threshold=4,
        start_timeout_s=5,
        grace_s=2,
        max_restarts=7,
        canary_retry_s=9,
    )
    plain = policy_for(BackendConfig(id="b", url="http://b", models=("m",)), HealthConfig(), CanaryConfig())
    assert plain == LifecyclePolicy(managed=False, fail_threshold=2, canary_retry_s=60)


async def test_from_settings_uses_the_backends_canary() -> None:
    cfg = BackendConfig(id="a", url="http://a", models=("m",), canary=CanaryConfig(enabled=False))
    async with httpx.AsyncClient() as client:
        watcher = Watcher()
        ctl = BackendController.from_settings(cfg, Settings(), client, on_change=watcher)
        ctl.send(ProbeOk())
        await watcher.until(lambda: ctl.lifecycle.state is not S.CANARY, within=5)
        assert ctl.lifecycle.state is S.READY
        assert ctl.status()["canary"]["reason"] == "no canary checks configured"
        await ctl.aclose()


@pytest.mark.parametrize(
    ("section", "fields", "message"),
    [
        (ManagedConfig, {"command": ""}, "must be a non-empty string"),
        (ManagedConfig, {"command": []}, "must be a non-empty string"),
        (ManagedConfig, {"command": ["vllm", ""]}, "must be a non-empty string"),
        (ManagedConfig, {"command": "x", "stop_command": " "}, "must be a non-empty string"),
        (
            ManagedConfig,
            {"command": "docker start e", "detached": True},
            "detached engines need a stop_command",
        ),
        (RestartConfig, {"backoff_initial_s": 5, "backoff_max_s": 1}, "backoff_initial_s must not exceed"),
        (BreakerConfig, {"open_s": 5, "open_max_s": 1}, "open_s must not exceed open_max_s"),
        (CanaryConfig, {"needle_tokens": [10]}, "needle_tokens must each be >= 64"),
    ],
)
def test_bad_lifecycle_settings_are_rejected(
    section: type[Any], fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        section(**fields)


def test_settings_carry_the_new_sections_with_their_defaults() -> None:
    settings = Settings(
        backends=[{"id": "a", "url": "http://a", "models": ["m"], "managed": {"command": ["vllm", "serve"]}}]
    )
    (backend,) = settings.backends
    assert backend.managed == ManagedConfig(command=("vllm", "serve"))
    assert (backend.canary, settings.canary, settings.breaker) == (None, CanaryConfig(), BreakerConfig())
    assert backend.managed.restart == RestartConfig(
        grace_s=10, backoff_initial_s=1, backoff_max_s=60, max_restarts=5, window_s=600
    )
