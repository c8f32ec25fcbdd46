"""On-demand engines as one pure scheduler: ``decide(schedule, event, now, policy, busy)``.

No I/O, no clock, no asyncio (like ``backends.lifecycle``): the fleet sends events (a request arrived, an
engine became ready, failed or stopped, a claim ended, a hold, a tick) and executes the actions (start or stop
an engine, admit or reject a waiting request). ``busy`` is each engine's requests in flight as the registry's
leases count them; ``claims`` are the admitted requests this scheduler knows of (from admission until the
request is finished), so nothing is lost between admission and the lease. Rules (the tests hold each one):

- An on-demand engine is STOPPED until a request for one of its models arrives; then STARTING (the lifecycle's
  starting -> canary), READY, and STOPPING while its stop command / SIGTERM / SIGKILL runs.
- Exclusive groups: at most ``max_running`` members of a group are STARTING, READY or STOPPING at once (a
  stopping engine still holds its GPU). To start a member of a full group, one READY member is evicted, and
  only one that is idle (no request in flight, none admitted: **never evict an engine with requests in
  flight**), not held, and resident for ``min_residency_s``; the least recently used such member goes.
- Arrival order: waiters are served oldest first. A request for a READY engine is admitted at once, unless
  an older request waits for another member of that engine's group and the engine is past its minimum
  residency: then it queues behind, so the engine drains and the swap happens. During its residency an
  engine keeps serving its own models and the swap waits (that is what stops two alternating models from
  thrashing). Groups do not wait on each other; an ungrouped engine starts whenever it is wanted.
- A request that needs a member of a group whose running members are all held is rejected at once, naming
  the hold and when it ends. A held engine is never stopped (neither idle nor for a swap); holding a stopped
  engine starts it.
- Idle TTL: a READY engine with nothing in flight and no request for ``idle_ttl_s`` is stopped.
- A start that fails (the lifecycle went DOWN before READY: exit, start timeout, failed canary) stops the
  engine (no restart loop behind the waiters' backs) and rejects every request waiting for it with the
  cause; the next request starts it again. A READY engine that fails (crash, failed probes) is an outage
  for its lifecycle, which restarts it after its grace period: STARTING again here, nothing stopped (a
  probe that fails once under load must not kill the requests in flight); if that comes back DOWN as
  well, it is a failed start.
- Bounds: at most ``max_waiting`` waiters per model (beyond: rejected at once, with a retry-after); a waiter
  is rejected after ``wait_timeout_s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from enum import StrEnum

from backends.ondemand_values import (
    HOLDING,
    Action,
    Admit,
    Arrive,
    Engine,
    EngineSpec,
    Event,
    EvictionRefused,
    Failed,
    GroupSpec,
    Hold,
    Leave,
    Phase,
    Ready,
    Reject,
    RejectWhy,
    Release,
    Result,
    Schedule,
    SchedulerPolicy,
    Start,
    Stop,
    Stopped,
    StopWhy,
    Tick,
    Unhold,
    Waiter,
)

__all__ = [
    "Action",
    "Admit",
    "Arrive",
    "Engine",
    "EngineSpec",
    "Event",
    "EvictionRefused",
    "Failed",
    "GroupSpec",
    "Hold",
    "Leave",
    "Phase",
    "Ready",
    "Reject",
    "RejectWhy",
    "Release",
    "Result",
    "Schedule",
    "SchedulerPolicy",
    "Start",
    "Stop",
    "StopWhy",
    "Stopped",
    "Tick",
    "Unhold",
    "Waiter",
    "decide",
    "next_deadline",
]


# -- the function ---------------------------------------------------------------------------------------


def decide(s: Schedule, event: Event, now: float, p: SchedulerPolicy, busy: Mapping[str, int]) -> Result:
    """The next schedule and what to do. Unknown engines and tickets change nothing; never raises."""
    actions: list[Action] = []
    match event:
        case Arrive(ticket, model):
            if s.waiting(model) >= p.max_waiting:
                message = f"{s.waiting(model)} requests for model {model!r} are waiting already"
                return s, [Reject(ticket, RejectWhy.QUEUE_FULL, message, p.retry_after_s)]
            s = replace(s, queue=(*s.queue, Waiter(ticket, model, now)))
        case Leave(ticket):
            s = replace(s, queue=tuple(w for w in s.queue if w.ticket != ticket))
        case Release(engine) if engine in s.engines:
            e = s.engines[engine]
            s = _put(s, engine, replace(e, claims=max(0, e.claims - 1), last_used=now))
        case Ready(engine) if engine in s.engines and s.engines[engine].phase is Phase.STARTING:
            e = s.engines[engine]
            s = _put(s, engine, replace(e, phase=Phase.READY, since=now, ready_at=now, last_used=now))
        case Failed(engine, cause) if engine in s.engines:
            s, actions = _failed(s, engine, cause, now, p)
        case Stopped(engine) if engine in s.engines and s.engines[engine].phase is not Phase.STOPPED:
            e = s.engines[engine]
            s = _put(s, engine, replace(e, phase=Phase.STOPPED, since=now, ready_at=None))
        case Hold(engine, until, reason) if engine in s.engines:
            s = _put(s, engine, replace(s.engines[engine], hold_until=until, hold_reason=reason))
        case Unhold(engine) if engine in s.engines:
            e = s.engines[engine]
            s = _put(s, engine, replace(e, hold_until=None, hold_reason="", last_used=max(e.last_used, now)))
    s, planned = _plan(s, now, p, busy)
    return s, actions + planned


def next_deadline(s: Schedule, now: float, p: SchedulerPolicy) -> float | None:
    """The earliest time after ``now`` at which a ``Tick`` may change something (None: none is due)."""
    times: list[float] = [w.arrived + p.wait_timeout_s for w in s.queue]
    for spec in p.engines:
        e = s.engines[spec.id]
        if e.hold_until is not None:
            times.append(e.hold_until)
        if e.phase is Phase.READY and spec.idle_ttl_s is not None:
            times.append(e.last_used + spec.idle_ttl_s)
        if e.phase is Phase.READY and e.ready_at is not None:
            times.append(e.ready_at + p.group(spec.group).min_residency_s)
    later = [t for t in times if t > now]
    return min(later) if later else None


# -- steps ------------------------------------------------------------------------------------------------


def _put(s: Schedule, engine: str, e: Engine) -> Schedule:
    return replace(s, engines={**s.engines, engine: e})


def _idle(s: Schedule, engine: str, busy: Mapping[str, int]) -> bool:
    return s.engines[engine].claims == 0 and busy.get(engine, 0) == 0


def _failed(s: Schedule, engine: str, cause: str, now: float, p: SchedulerPolicy) -> Result:
    """A READY engine that fails is left to its lifecycle (an outage: restarted like any managed engine;
    its requests in flight keep their claims): STARTING again. A start that fails is stopped, and whoever
    waited for it alone is answered with the cause."""
    e = s.engines[engine]
    if e.phase is Phase.READY:
        return _put(
            s, engine, replace(e, phase=Phase.STARTING, since=now, ready_at=None, last_error=cause)
        ), []
    if e.phase is not Phase.STARTING:
        return s, []
    s = _put(s, engine, replace(e, phase=Phase.STOPPING, since=now, ready_at=None, last_error=cause))
    actions: list[Action] = [Stop(engine, StopWhy.FAILED, cause)]
    kept: list[Waiter] = []
    for w in s.queue:
        alive = [x for x in p.serving(w.model) if s.engines[x.id].phase in (Phase.STARTING, Phase.READY)]
        if w.model in p.spec(engine).models and not alive:
            message = f"backend {engine} failed to start: {cause}"
            actions.append(Reject(w.ticket, RejectWhy.START_FAILED, message))
        else:
            kept.append(w)
    return replace(s, queue=tuple(kept)), actions


def _plan(s: Schedule, now: float, p: SchedulerPolicy, busy: Mapping[str, int]) -> Result:
    """After every event: expire holds and waiters, start held engines, serve the queue, stop idle engines."""
    s = _expire_holds(s, now)
    s = _touch_busy(s, now, busy)
    s, actions = _expire_waiters(s, now, p)
    for spec in p.engines:
        e = s.engines[spec.id]
        if e.held(now) and e.phase is Phase.STOPPED:
            s, more, _, _ = _make_room(s, spec, now, p, busy)
            actions += [a for a in more if not isinstance(a, EvictionRefused)]
    s, served = _serve(s, now, p, busy)
    s, idle = _stop_idle(s, now, p, busy)
    return s, actions + served + idle


def _expire_holds(s: Schedule, now: float) -> Schedule:
    """An ended hold counts as use: the idle TTL runs from its end, not from the last request."""
    for engine, e in s.engines.items():
        if e.hold_until is not None and now >= e.hold_until:
            used = max(e.last_used, e.hold_until)
            s = _put(s, engine, replace(e, hold_until=None, hold_reason="", last_used=used))
    return s


def _touch_busy(s: Schedule, now: float, busy: Mapping[str, int]) -> Schedule:
    """Requests in flight that came without a claim still count as use (for the idle TTL)."""
    for engine, e in s.engines.items():
        if busy.get(engine, 0) > 0 and e.phase is Phase.READY:
            s = _put(s, engine, replace(e, last_used=now))
    return s


def _expire_waiters(s: Schedule, now: float, p: SchedulerPolicy) -> Result:
    actions: list[Action] = []
    kept: list[Waiter] = []
    for w in s.queue:
        if now - w.arrived >= p.wait_timeout_s:
            message = f"waited {p.wait_timeout_s:g} s for an engine for model {w.model!r} to start"
            actions.append(Reject(w.ticket, RejectWhy.TIMEOUT, message, p.retry_after_s))
        else:
            kept.append(w)
    return replace(s, queue=tuple(kept)), actions


def _serve(s: Schedule, now: float, p: SchedulerPolicy, busy: Mapping[str, int]) -> Result:
    """Oldest waiter first: admit, or make room (start / evict), or keep waiting, or reject (held)."""
    actions: list[Action] = []
    kept: list[Waiter] = []
    contested: set[str] = set()  # groups in which an older waiter needs a slot that is not free
    for w in s.queue:
        specs = p.serving(w.model)
        ready = [
            x for x in specs if s.engines[x.id].phase is Phase.READY and not _behind(s, x, contested, now, p)
        ]
        if ready:
            chosen = min(ready, key=lambda x: s.engines[x.id].claims + busy.get(x.id, 0))
            e = s.engines[chosen.id]
            s = _put(s, chosen.id, replace(e, claims=e.claims + 1, last_used=now))
            actions.append(Admit(w.ticket, chosen.id))
            continue
        if not any(s.engines[x.id].phase in (Phase.STARTING, Phase.READY) for x in specs):
            s, more, kept_w, full = _want(s, w, specs, now, p, busy)
            actions += more
            contested |= full
            if kept_w is None:
                continue  # rejected
            w = kept_w
        kept.append(w)
    return replace(s, queue=tuple(kept)), actions


def _behind(s: Schedule, spec: EngineSpec, contested: set[str], now: float, p: SchedulerPolicy) -> bool:
    """Must a new request for this READY engine queue behind an older waiter of its group?"""
    if spec.group is None or spec.group not in contested:
        return False
    e = s.engines[spec.id]
    resident = e.ready_at is not None and now - e.ready_at >= p.group(spec.group).min_residency_s
    return resident and not e.held(now)


class Room(StrEnum):
    """What ``_make_room`` managed for an engine."""

    STARTED = "started"  # it is STARTING now (or was not STOPPED)
    EVICTING = "evicting"  # a member of its group is being stopped for it
    STOPPING = "stopping"  # it is stopping itself: once STOPPED it can start again
    FULL = "full"  # its group is full and nothing can be evicted yet
    HELD = "held"  # its group is full of held engines


def _want(
    s: Schedule,
    w: Waiter,
    specs: tuple[EngineSpec, ...],
    now: float,
    p: SchedulerPolicy,
    busy: Mapping[str, int],
) -> tuple[Schedule, list[Action], Waiter | None, set[str]]:
    """Nothing serves ``w`` or starts for it: try its engines (config order) for room. Returns the waiter
    (None: rejected) and the groups it found full."""
    actions: list[Action] = []
    full: set[str] = set()
    if any(s.engines[x.id].phase is Phase.STOPPING for x in specs):
        return s, actions, w, full
    holds: list[str] = []
    for spec in specs:
        s, more, room, message = _make_room(s, spec, now, p, busy)
        if more and isinstance(more[0], EvictionRefused):
            more = [] if w.refused else more
            w = replace(w, refused=True)
        actions += more
        if room in (Room.STARTED, Room.EVICTING):
            return s, actions, w, full
        if room is Room.HELD:
            holds.append(message)
        elif spec.group is not None:
            full.add(spec.group)
    if holds and len(holds) == len(specs):
        return (
            s,
            [*actions, Reject(w.ticket, RejectWhy.HELD, holds[0], _hold_left(s, specs, now, p))],
            None,
            full,
        )
    return s, actions, w, full


def _make_room(
    s: Schedule, spec: EngineSpec, now: float, p: SchedulerPolicy, busy: Mapping[str, int]
) -> tuple[Schedule, list[Action], Room, str]:
    """Start ``spec`` if its group has room, else evict the least recently used evictable member."""
    e = s.engines[spec.id]
    if e.phase is not Phase.STOPPED:
        return s, [], Room.STOPPING if e.phase is Phase.STOPPING else Room.STARTED, ""
    group = p.group(spec.group)
    others = [] if spec.group is None else [m for m in p.members(spec.group) if m.id != spec.id]
    running = [m for m in others if s.engines[m.id].phase in HOLDING]
    if len(running) < group.max_running:
        return (
            _put(s, spec.id, replace(e, phase=Phase.STARTING, since=now)),
            [Start(spec.id)],
            Room.STARTED,
            "",
        )
    ready = [m for m in running if s.engines[m.id].phase is Phase.READY]
    victims = [m for m in ready if _evictable(s, m, now, group, busy)]
    if victims:
        victim = min(victims, key=lambda m: s.engines[m.id].last_used)
        ve = s.engines[victim.id]
        s = _put(s, victim.id, replace(ve, phase=Phase.STOPPING, since=now, ready_at=None))
        return s, [Stop(victim.id, StopWhy.SWAP, f"swapped out for {spec.id}")], Room.EVICTING, ""
    if all(s.engines[m.id].held(now) for m in running):
        holder = min(running, key=lambda m: s.engines[m.id].hold_until or 0.0)
        return s, [], Room.HELD, _hold_message(spec, holder, s.engines[holder.id], now)
    # Counted as refused: members that only their requests in flight protect (not a hold, not residency).
    refused = [
        m for m in ready if _evictable(s, m, now, group, {}, ignore_claims=True) and not _idle(s, m.id, busy)
    ]
    return s, [EvictionRefused(m.id) for m in refused], Room.FULL, ""


def _evictable(
    s: Schedule,
    m: EngineSpec,
    now: float,
    group: GroupSpec,
    busy: Mapping[str, int],
    ignore_claims: bool = False,
) -> bool:
    e = s.engines[m.id]
    resident = e.ready_at is not None and now - e.ready_at >= group.min_residency_s
    return resident and (ignore_claims or _idle(s, m.id, busy)) and not e.held(now)


def _hold_message(spec: EngineSpec, holder: EngineSpec, e: Engine, now: float) -> str:
    left = (e.hold_until or now) - now
    why = f" ({e.hold_reason})" if e.hold_reason else ""
    return (
        f"backend {spec.id} cannot start: group {spec.group!r} is held by backend {holder.id}{why} "
        f"for another {_seconds(left)} s"
    )


def _hold_left(s: Schedule, specs: tuple[EngineSpec, ...], now: float, p: SchedulerPolicy) -> float:
    ends = [
        s.engines[m.id].hold_until or now
        for spec in specs
        if spec.group is not None
        for m in p.members(spec.group)
        if s.engines[m.id].held(now)
    ]
    return max(0.0, min(ends) - now) if ends else p.retry_after_s


def _stop_idle(s: Schedule, now: float, p: SchedulerPolicy, busy: Mapping[str, int]) -> Result:
    actions: list[Action] = []
    for spec in p.engines:
        e = s.engines[spec.id]
        if (
            spec.idle_ttl_s is None
            or e.phase is not Phase.READY
            or e.held(now)
            or not _idle(s, spec.id, busy)
        ):
            continue
        if now - e.last_used >= spec.idle_ttl_s:
            s = _put(s, spec.id, replace(e, phase=Phase.STOPPING, since=now, ready_at=None))
            detail = f"idle for {_seconds(now - e.last_used)} s (idle_ttl_s {spec.idle_ttl_s:g})"
            actions.append(Stop(spec.id, StopWhy.IDLE, detail))
    return s, actions


def _seconds(x: float) -> str:
    """0.5 -> "0.5", 30.0 -> "30": one decimal at most."""
    return f"{x:.1f}".rstrip("0").rstrip(".")
