"""The one writer of a backend's lifecycle: ``BackendController`` owns its ``Lifecycle`` value, feeds every
event through ``lifecycle.transition`` and executes the actions that come out.

Probes, the proxy (request outcomes for the circuit breaker), operators and the process supervisor only
call ``send`` (or ``record_request``); nothing else changes the lifecycle. ``send`` is synchronous and never
awaits: actions that take time (a canary run, starting or stopping the engine) run as tasks whose results
come back as events, and delays are ``loop.call_later`` timers whose firing is an event too. Events sent
while one is being applied (from ``on_change``, say) are queued and applied in order.

Works for unmanaged backends as well (no supervisor: no process actions come out of the lifecycle).
Must be used inside a running event loop; ``aclose`` stops the engine and every task and timer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any

import httpx

from backends.breaker import BreakerPolicy, CircuitBreaker, CircuitState
from backends.canary import Canary, CanaryResult
from backends.events import (
    Action,
    ArmTimer,
    CanaryFailed,
    CanaryPassed,
    CircuitChanged,
    ConfigAdded,
    Event,
    GiveUp,
    Log,
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
from backends.supervisor import ExitInfo, Supervisor
from config.settings import BackendConfig, BreakerConfig, CanaryConfig, HealthConfig, ManagedConfig, Settings

CanaryRunner = Callable[[], Awaitable[CanaryResult]]
#: Told of every applied event: the controller (its lifecycle already the new one), the event, the lifecycle
#: before it and the actions that came out. The gateway's metrics count canaries and restarts from it.
TransitionHook = Callable[["BackendController", Event, Lifecycle, Sequence[Action]], None]
EXITS_KEPT = 10
STATUS_LINES = 20
#: The shortest wait before looking at an open breaker again: a timer that fired early never spins the loop.
RECHECK_MIN_S = 0.001

log = logging.getLogger("warmroute.lifecycle")


def policy_for(cfg: BackendConfig, health: HealthConfig, canary_defaults: CanaryConfig) -> LifecyclePolicy:
    canary = cfg.canary or canary_defaults
    base = LifecyclePolicy(fail_threshold=health.fail_threshold, canary_retry_s=canary.retry_s)
    m = cfg.managed
    if m is None:
        return base
    r = m.restart
    return LifecyclePolicy(
        managed=True,
        on_demand=m.on_demand,
        detached=m.detached,
        fail_threshold=health.fail_threshold,
        start_timeout_s=m.start_timeout_s,
        grace_s=r.grace_s,
        backoff_initial_s=r.backoff_initial_s,
        backoff_max_s=r.backoff_max_s,
        max_restarts=r.max_restarts,
        window_s=r.window_s,
        canary_retry_s=canary.retry_s,
    )


def breaker_policy(cfg: BreakerConfig) -> BreakerPolicy:
    return BreakerPolicy(cfg.failure_threshold, cfg.open_s, cfg.open_max_s)


class BackendController:
    def __init__(
        self,
        backend_id: str,
        policy: LifecyclePolicy,
        canary: CanaryRunner,
        *,
        managed: ManagedConfig | None = None,
        breaker: CircuitBreaker | None = None,
        on_change: Callable[[Lifecycle], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
    ) -> None:
        self.id = backend_id
        self.policy = policy
        self.breaker = breaker or CircuitBreaker()
        self.on_change = on_change
        self.on_transition: TransitionHook | None = None
        self.log = logger or log
        self.exits: deque[ExitInfo] = deque(maxlen=EXITS_KEPT)
        self.last_canary: CanaryResult | None = None
        self.last_canary_at: float | None = None  # wall clock
        self.supervisor = None if managed is None else self._supervisor(managed)
        self._canary_runner = canary
        self._clock = clock
        self._lc = Lifecycle()
        self._queue: deque[Event] = deque()
        self._sending = self._closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._circuit_timer: asyncio.TimerHandle | None = None
        self._canary_task: asyncio.Task[None] | None = None
        self._stop_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    def from_settings(
        cls,
        cfg: BackendConfig,
        settings: Settings,
        client: httpx.AsyncClient,
        on_change: Callable[[Lifecycle], None] | None = None,
    ) -> BackendController:
        """Policy from ``health``/``canary``/``managed``, breaker from ``breaker``, canary over ``client``."""
        return cls(
            cfg.id,
            policy_for(cfg, settings.health, settings.canary),
            Canary.for_backend(client, cfg, settings.canary).run,
            managed=cfg.managed,
            breaker=CircuitBreaker(breaker_policy(settings.breaker)),
            on_change=on_change,
        )

    @property
    def lifecycle(self) -> Lifecycle:
        return self._lc

    def start(self) -> None:
        """Begin: a managed engine is started; any backend then waits for its first healthy probe."""
        self.send(ConfigAdded())

    def send(self, event: Event) -> None:
        """Apply ``event`` (and any sent meanwhile), execute the actions. Never awaits."""
        if self._closed:
            return
        self._queue.append(event)
        if self._sending:
            return
        self._sending = True
        try:
            while self._queue:
                self._apply(self._queue.popleft())
        finally:
            self._sending = False

    def record_request(self, success: bool, client: str | None = None) -> None:
        """A real request's outcome for the circuit breaker (connect error, 5xx, timeout: not success).
        ``client``: who sent it, for a 5xx answer the request's own input could explain too (see
        ``backends.breaker``); None for a failure only the engine explains."""
        now = self._clock()
        before = self.breaker.state(now)
        after = self.breaker.record(success, now, client)
        if after is before:
            return
        if after is CircuitState.OPEN:
            trial = "the trial request failed" if before is CircuitState.HALF_OPEN else None
            why = trial or f"{self.breaker.consecutive_failures} consecutive requests failed"
            self.send(CircuitChanged(after, f"{why}; open for {self.breaker.open_for_s:g} s"))
            self._arm_circuit_check(now)
        else:
            self.send(CircuitChanged(after, "a request succeeded"))

    def abstain_request(self) -> None:
        """A request whose failure was its own (another engine failed it too): no outcome for the breaker."""
        self.breaker.abstain(self._clock())

    def admit_request(self) -> bool:
        """May a new request go here now? Routable, and the breaker lets it (taking the half-open trial)."""
        return self._lc.routable and self.breaker.begin(self._clock())

    def status(self) -> dict[str, Any]:
        """For /readyz and the admin API."""
        lc, now = self._lc, self._clock()
        canary = None
        if self.last_canary is not None:
            canary = {**self.last_canary.as_dict(), "at": self.last_canary_at}
        return {
            "id": self.id,
            "state": lc.state.value,
            "reason": lc.reason,
            "routable": lc.routable,
            "drained": lc.drained,
            "cordoned": lc.cordoned,
            "circuit": lc.circuit.value,
            "probe_failures": lc.probe_failures,
            "canary": canary,
            "managed": None if self.supervisor is None else self._managed_status(lc, now, self.supervisor),
        }

    async def aclose(self) -> None:
        """Stop the engine (if managed), every task and timer; later events are ignored."""
        self._closed = True
        for handle in (self._timer, self._circuit_timer):
            if handle is not None:
                handle.cancel()
        tasks = list(self._tasks)
        for task in tasks:
            if task is self._canary_task:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.supervisor is not None:
            await self.supervisor.stop()

    # -- applying ----------------------------------------------------------------------------------------

    def _apply(self, event: Event) -> None:
        before = self._lc
        self._lc, actions = transition(before, event, self._clock(), self.policy)
        if self.on_transition is not None:
            try:
                self.on_transition(self, event, before, actions)
            except Exception:  # an observer's bug must not stop the writer
                self.log.exception("backend %s: on_transition failed", self.id)
        for action in actions:
            self._execute(action)
        if self.on_change is not None and (self._lc.state, self._lc.routable) != (
            before.state,
            before.routable,
        ):
            try:
                self.on_change(self._lc)
            except Exception:  # a listener's bug must not stop the writer
                self.log.exception("backend %s: on_change failed", self.id)

    def _execute(self, action: Action) -> None:
        match action:
            case Log(level, message):
                self.log.log(level, "backend %s: %s", self.id, message)
            case GiveUp(reason):
                self.log.error("backend %s: %s", self.id, reason)
            case RunCanary(seq):
                if self._canary_task is not None:
                    self._canary_task.cancel()
                self._canary_task = self._spawn(self._run_canary(seq), "canary")
            case ArmTimer(kind, after_s, seq):
                if self._timer is not None:
                    self._timer.cancel()  # only the newest timer can be current (see lifecycle)
                self._timer = asyncio.get_running_loop().call_later(after_s, self._fire, kind, seq)
            case ResetBreaker():
                self.breaker.reset()
            case StartProcess() | RestartProcess() | StopProcess():
                self._process(action)

    def _spawn(self, coro: Coroutine[Any, Any, None], what: str) -> asyncio.Task[None]:
        task = asyncio.get_running_loop().create_task(
            self._guarded(coro, what), name=f"warmroute-{self.id}-{what}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _guarded(self, coro: Coroutine[Any, Any, None], what: str) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except Exception:  # the supervisor and the canary report failures as events; this is a bug
            self.log.exception("backend %s: %s failed", self.id, what)

    async def _run_canary(self, seq: int) -> None:
        try:
            result = await self._canary_runner()
        except Exception as exc:  # a runner's bug fails the canary: it must not admit, nor hang CANARY
            result = CanaryResult(False, None, None, f"the canary raised {type(exc).__name__}: {exc}")
        self.last_canary, self.last_canary_at = result, time.time()
        self.send(CanaryPassed(seq) if result.passed else CanaryFailed(seq, result.reason))

    def _fire(self, kind: TimerKind, seq: int) -> None:
        lines = () if self.supervisor is None else self.supervisor.output()
        self.send(TimerFired(kind, seq, lines))

    def _arm_circuit_check(self, now: float) -> None:
        retry_at = self.breaker.retry_at()
        if retry_at is None:
            return
        if self._circuit_timer is not None:
            self._circuit_timer.cancel()
        loop = asyncio.get_running_loop()
        delay = max(RECHECK_MIN_S, retry_at - now)
        self._circuit_timer = loop.call_later(delay, self._circuit_check)

    def _circuit_check(self) -> None:
        """The open period's timer. The loop's timers may fire a little early by our clock (the loop counts
        a timer due within its clock resolution, and its clock need not be ours): while the breaker still
        reads OPEN, check again at ``retry_at``. So every open period ends, whatever the two clocks do."""
        self._circuit_timer = None
        now = self._clock()
        state = self.breaker.state(now)
        if state is CircuitState.OPEN:
            self._arm_circuit_check(now)
        elif state is not self._lc.circuit:
            self.send(CircuitChanged(state, "open period over: one trial request may go"))

    # -- the process ------------------------------------------------------------------------------------

    def _supervisor(self, m: ManagedConfig) -> Supervisor:
        return Supervisor(
            self.id,
            m.command,
            stop_command=m.stop_command,
            env=m.env,
            cwd=m.cwd,
            stop_timeout_s=m.stop_timeout_s,
            log_lines=m.log_lines,
            on_start=lambda pid: self.send(ProcessStarted(pid)),
            on_exit=self._on_exit,
            logger=logging.getLogger(f"warmroute.engine.{self.id}"),
        )

    def _process(self, action: StartProcess | RestartProcess | StopProcess) -> None:
        sup = self.supervisor
        if sup is None:
            return
        if isinstance(action, StartProcess):
            self._spawn(sup.start(), "start")
        elif isinstance(action, RestartProcess):
            self._spawn(sup.restart(), "restart")
        else:
            self._stop_task = self._spawn(sup.stop(), "stop")

    async def stopping(self) -> None:
        """Wait for the last stop the lifecycle asked for (stop command, SIGTERM, SIGKILL) to finish."""
        task = self._stop_task
        if task is not None:
            await asyncio.shield(task)

    def _on_exit(self, info: ExitInfo) -> None:
        self.exits.append(info)
        self.send(
            # An exit a stop found (the process had died by itself) is recorded as such, but is no outage:
            # the restart or stop under way already answers it.
            ProcessExited(
                info.cause,
                info.code,
                info.signal,
                info.lines,
                info.requested or info.stopping,
                info.spawn_failed,
            )
        )

    def _managed_status(self, lc: Lifecycle, now: float, sup: Supervisor) -> dict[str, Any]:
        return {
            "running": sup.running,
            "pid": sup.pid,
            "restarts_in_window": lc.restarts_in_window(now, self.policy.window_s),
            "max_restarts": self.policy.max_restarts,
            "window_s": self.policy.window_s,
            "gave_up": lc.gave_up,
            "exits": [e.as_dict() for e in self.exits],
            "last_lines": list(sup.lines()[-STATUS_LINES:]),
        }
