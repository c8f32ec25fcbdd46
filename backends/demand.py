"""``Demand``: the async edge of ``backends.ondemand`` — tickets for waiting requests, a timer, and the
actions (start/stop an engine, admit/reject a waiter) executed on the backends' controllers.

One writer again: every event goes through ``_send``, which applies ``ondemand.decide`` and executes what
comes out; events sent meanwhile (a lifecycle change caused by an action) are queued and applied in order.
Engines are woken and put to sleep through their ``BackendController`` (lifecycle ``Wake``/``Sleep``), so
the state the admin API shows stays the lifecycle's; a stop is reported back (``Stopped``) once the
supervisor's stop (stop command, SIGTERM, SIGKILL after ``stop_timeout_s``) has finished.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from backends import ondemand as od
from backends.events import Sleep, Wake
from backends.lifecycle import Lifecycle
from backends.managed import BackendController
from config.settings import BackendConfig, Settings
from routing.types import BackendState

log = logging.getLogger("warmroute.ondemand")


class EngineUnavailable(Exception):
    """A waiting request answered without an engine: why (a metric label), what to tell the client."""

    def __init__(self, why: od.RejectWhy, message: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.why = why
        self.message = message
        self.retry_after_s = retry_after_s


class DemandMetrics(Protocol):
    """What the gateway counts (``gateway.metrics.OnDemandMetrics``). No I/O."""

    def started(self, engine: str) -> None: ...

    def ready(self, engine: str, starting_s: float) -> None: ...

    def stopped(self, engine: str, why: str, group: str | None) -> None: ...

    def eviction_refused(self, engine: str) -> None: ...

    def waited(self, model: str, seconds: float, outcome: str) -> None: ...

    def depth(self, model: str, waiting: int) -> None: ...


class _NoMetrics:
    def started(self, engine: str) -> None:
        return None

    def ready(self, engine: str, starting_s: float) -> None:
        return None

    def stopped(self, engine: str, why: str, group: str | None) -> None:
        return None

    def eviction_refused(self, engine: str) -> None:
        return None

    def waited(self, model: str, seconds: float, outcome: str) -> None:
        return None

    def depth(self, model: str, waiting: int) -> None:
        return None


@dataclass(slots=True)
class Claim:
    """An admitted request's hold on its engine: the engine is not stopped until every claim is released.
    ``release`` is idempotent; ``waited_s`` is how long the request waited (0 when its engine was ready)."""

    engine: str
    waited_s: float
    _release: Callable[[str], None]
    released: bool = field(default=False)

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._release(self.engine)


@dataclass(slots=True)
class Pending:
    """One queued request. ``claim()`` waits for its admission; ``abandon()`` (its client left) takes it out
    of the queue or gives an admission back. Cancelling ``claim()`` abandons it."""

    demand: Demand
    ticket: int
    model: str
    arrived: float
    future: asyncio.Future[str]
    abandoned: bool = False

    def done(self) -> bool:
        return self.future.done()

    async def claim(self) -> Claim:
        try:
            engine = await asyncio.shield(self.future)
        except asyncio.CancelledError:
            self.abandon()
            raise
        d = self.demand
        return Claim(engine, d._clock() - self.arrived, d._release)

    def abandon(self) -> None:
        if not self.abandoned:
            self.abandoned = True
            self.demand._abandon(self)


def scheduler_policy(settings: Settings) -> od.SchedulerPolicy:
    specs = tuple(
        od.EngineSpec(b.id, b.models, b.managed.group, b.managed.idle_ttl_s)
        for b in settings.backends
        if b.managed is not None and b.managed.on_demand
    )
    groups = {name: od.GroupSpec(g.max_running, g.min_residency_s) for name, g in settings.groups.items()}
    o = settings.on_demand
    return od.SchedulerPolicy(specs, groups, o.max_waiting, o.wait_timeout_s, o.retry_after_s)


def on_demand(cfg: BackendConfig) -> bool:
    return cfg.managed is not None and cfg.managed.on_demand


class Demand:
    def __init__(
        self,
        policy: od.SchedulerPolicy,
        controllers: Mapping[str, BackendController],
        busy: Callable[[Iterable[str]], Mapping[str, int]],
        *,
        metrics: DemandMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.metrics: DemandMetrics = metrics or _NoMetrics()
        self._controllers = controllers
        self._busy = busy
        self._clock = clock
        self._s = od.Schedule.initial(policy)
        self._models = frozenset(m for e in policy.engines for m in e.models)
        self._tickets = itertools.count(1)
        self._waiting: dict[int, tuple[asyncio.Future[str], str, float]] = {}
        self._queue: deque[od.Event] = deque()
        self._sending = self._closed = False
        self._timer: asyncio.TimerHandle | None = None
        self._starting_since: dict[str, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def schedule(self) -> od.Schedule:
        return self._s

    def serves(self, model: str | None) -> bool:
        """Is ``model`` served by an on-demand engine (so its requests go through ``ready_for``)?"""
        return model in self._models

    def request(self, model: str) -> Pending:
        """Queue a request for ``model`` now (it may be admitted or refused at once: ``Pending.done``)."""
        ticket = next(self._tickets)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        pending = Pending(self, ticket, model, self._clock(), future)
        self._waiting[ticket] = (future, model, pending.arrived)
        self._send(od.Arrive(ticket, model))
        return pending

    async def ready_for(self, model: str) -> Claim:
        """Wait until an engine for ``model`` is READY (starting one if needed); raise ``EngineUnavailable``
        when the scheduler refuses (queue full, held group, failed start, wait timeout)."""
        return await self.request(model).claim()

    def hold(self, engine: str, duration_s: float, reason: str) -> dict[str, Any]:
        """Keep ``engine`` loaded (starting it if stopped) and its group refusing swaps for ``duration_s``.
        Raises ``KeyError`` for an engine that is not on demand. Returns the engine's on-demand status."""
        if engine not in self._s.engines:
            raise KeyError(engine)
        if not duration_s > 0:
            raise ValueError(f"a hold lasts more than 0 s, not {duration_s!r}")
        self._send(od.Hold(engine, self._clock() + duration_s, reason))
        log.info("backend %s: held for %g s (%s)", engine, duration_s, reason or "no reason given")
        return self.status(engine)

    def release_hold(self, engine: str) -> dict[str, Any]:
        if engine not in self._s.engines:
            raise KeyError(engine)
        self._send(od.Unhold(engine))
        log.info("backend %s: hold released", engine)
        return self.status(engine)

    def lifecycle_changed(self, engine: str, lc: Lifecycle) -> None:
        """From the fleet's mirror: READY is ``Ready``; a DOWN nobody asked for is ``Failed`` (its reason)."""
        if engine not in self._s.engines:
            return
        if lc.state is BackendState.READY:
            if engine in self._starting_since:
                self.metrics.ready(engine, self._clock() - self._starting_since.pop(engine))
            self._send(od.Ready(engine))
        elif lc.state is BackendState.DOWN and not lc.stopped:
            self._send(od.Failed(engine, lc.reason))

    def status(self, engine: str) -> dict[str, Any]:
        """For the admin API: phase, hold, idle time, claims, waiters for its models, last failure."""
        e, now = self._s.engines[engine], self._clock()
        spec = self.policy.spec(engine)
        hold = None
        if e.held(now):
            assert e.hold_until is not None
            hold = {
                "reason": e.hold_reason,
                "remaining_s": round(e.hold_until - now, 3),
                "until": _wall(e.hold_until, now),
            }
        return {
            "phase": e.phase.value,
            "phase_for_s": None if e.since == 0.0 else round(now - e.since, 3),  # 0.0: never started
            "group": spec.group,
            "idle_ttl_s": spec.idle_ttl_s,
            "idle_for_s": round(now - e.last_used, 3) if e.phase is od.Phase.READY else None,
            "claims": e.claims,
            "waiting": sum(self._s.waiting(m) for m in spec.models),
            "hold": hold,
            "last_error": e.last_error,
        }

    async def aclose(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        for future, _, _ in self._waiting.values():
            if not future.done():
                future.set_exception(
                    EngineUnavailable(od.RejectWhy.TIMEOUT, "the gateway is shutting down", None)
                )
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- the writer -------------------------------------------------------------------------------------

    def _send(self, event: od.Event) -> None:
        if self._closed:
            return
        self._queue.append(event)
        if self._sending:
            return
        self._sending = True
        try:
            while self._queue:
                now = self._clock()
                busy = self._busy(self._s.engines)
                self._s, actions = od.decide(self._s, self._queue.popleft(), now, self.policy, busy)
                for action in actions:
                    self._execute(action, now)
            self._arm()
            for model in self._models:
                self.metrics.depth(model, self._s.waiting(model))
        finally:
            self._sending = False

    def _execute(self, action: od.Action, now: float) -> None:
        match action:
            case od.Start(engine):
                log.info("backend %s: starting on demand", engine)
                self._starting_since[engine] = now
                self.metrics.started(engine)
                self._controllers[engine].send(Wake())
            case od.Stop(engine, why, detail):
                self._stop(engine, why, detail)
            case od.Admit(ticket, engine):
                self._resolve(ticket, engine, None, now)
            case od.Reject(ticket, why, message, retry_after_s):
                if why is od.RejectWhy.HELD and retry_after_s is not None:
                    message = f"{message} (until {_wall(now + retry_after_s, now)})"
                self._resolve(ticket, None, EngineUnavailable(why, message, retry_after_s), now)
            case od.EvictionRefused(engine):
                log.info("backend %s: not swapped out: requests in flight", engine)
                self.metrics.eviction_refused(engine)

    def _resolve(self, ticket: int, engine: str | None, error: EngineUnavailable | None, now: float) -> None:
        entry = self._waiting.pop(ticket, None)
        if entry is None:
            return
        future, model, arrived = entry
        self.metrics.waited(model, now - arrived, "admitted" if error is None else error.why.value)
        if future.done():  # cancelled meanwhile: give an admission straight back
            if engine is not None:
                self._queue.append(od.Release(engine))
            return
        if error is not None:
            future.set_exception(error)
        else:
            assert engine is not None
            future.set_result(engine)

    def _stop(self, engine: str, why: od.StopWhy, detail: str) -> None:
        level = logging.WARNING if why is od.StopWhy.FAILED else logging.INFO
        log.log(level, "backend %s: stopping (%s): %s", engine, why.value, detail)
        self._starting_since.pop(engine, None)
        self.metrics.stopped(engine, why.value, self.policy.spec(engine).group)
        prefix = {
            od.StopWhy.IDLE: "stopped: ",
            od.StopWhy.SWAP: "stopped: ",
            od.StopWhy.FAILED: "stopped after a failure: ",
        }
        controller = self._controllers[engine]
        controller.send(Sleep(f"{prefix[why]}{detail} (starts again on a request)"))
        task = asyncio.get_running_loop().create_task(
            self._stopped(engine, controller), name=f"warmroute-{engine}-sleep"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _stopped(self, engine: str, controller: BackendController) -> None:
        await controller.stopping()
        log.info("backend %s: stopped", engine)
        self._send(od.Stopped(engine))

    def _release(self, engine: str) -> None:
        self._send(od.Release(engine))

    def _abandon(self, pending: Pending) -> None:
        future = pending.future
        if future.done() and not future.cancelled() and future.exception() is None:
            self._send(od.Release(future.result()))  # admitted, but its client left before using it
        elif self._waiting.pop(pending.ticket, None) is not None:
            future.cancel()
            self._send(od.Leave(pending.ticket))

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        now = self._clock()
        due = od.next_deadline(self._s, now, self.policy)
        if due is not None:
            self._timer = asyncio.get_running_loop().call_later(max(0.0, due - now) + 0.001, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._send(od.Tick())


def _wall(deadline: float, now: float) -> str:
    """A monotonic deadline as a UTC wall-clock time (for people)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + deadline - now))
