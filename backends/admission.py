"""Admission per backend as one pure scheduler: which waiting request a backend takes next.

No I/O, no clock, no asyncio (like ``backends.ondemand``): the gateway's edge (gateway/admission.py) says a
request arrived for a backend, left the queue, or finished, at a time it passes in; every call answers who is
admitted and who is refused now (an ``Outcome``). Rules (the tests hold each one):

- Capacity: a backend runs at most ``capacity`` admitted requests (its own ``capacities`` entry, else the
  default); the rest wait here, not in the engine's first-come-first-served queue.
- When a backend has room, the next request is taken from the highest class (lowest ``rank``) that has a
  waiter for that backend: strict priority (a batch class runs on what interactive work leaves).
- Headroom: a class with ``headroom`` h is admitted only while its backend runs fewer than capacity - h, so
  the last h slots stay free for higher classes (an interactive turn then starts at once instead of after
  one slot turnover; the price is h slots idle while only that class has work).
- Fair share within a class, by virtual time over tokens: each client has a usage (tokens charged); the
  waiting client with the least usage goes first, oldest request first within a client. A request is charged
  its estimate when admitted and corrected to its actual usage when it finishes. A client that becomes active
  (nothing waiting or running in that class) starts at the class's clock, the usage of the last admitted
  request's client at admission, so time spent idle banks no credit and past heavy use is not held against it.
- Pausing (a class with ``preemptible``): a waiter that finds its backend full while that backend runs a
  resumable ticket of a preemptible lower class is seated at once on that ticket's slot, and the ticket is
  asked to pause (``Outcome.pause``): of the lowest class, the newest admitted (the least to re-read). Until
  it has, the backend runs one more than its capacity; the engine's own queue holds the waiter for the
  moment it takes to stop (an engine never frees a running request's slot for a waiting one, so without
  this the waiter waits a slot turnover). The edge stops that stream at the engine and says so
  (``paused``): the ticket waits again, first among its client's, to be resumed; its usage is charged once
  over both parts. One that finishes before it pauses simply finishes; one the edge cannot pause after all
  (``keep``) is never asked again, and the next victim is asked for the slot instead.
- Bounds: at most ``max_queued`` waiters per class, over all backends (beyond: refused at once); a waiter is
  refused once it has waited its class's ``timeout_s`` (``expire``).
- Unknown tickets change nothing; nothing here raises on a client's behaviour.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum


class Why(StrEnum):
    """Why a request was refused: a metric label and the error's code suffix."""

    QUEUE_FULL = "queue_full"
    TIMEOUT = "timeout"


@dataclass(frozen=True, slots=True)
class ClassSpec:
    """One priority class: ``rank`` 0 goes first."""

    name: str
    rank: int
    max_queued: int
    timeout_s: float
    retry_after_s: float
    headroom: int = 0
    preemptible: bool = False  # its running requests may be paused for a waiting request of a higher class


@dataclass(frozen=True, slots=True)
class Ticket:
    """One request asking a backend for a slot; ``cost`` is its estimated tokens."""

    id: int
    backend: str
    client: str
    klass: str
    cost: int
    arrived: float
    resumable: bool = False  # the edge can pause and resume it (a stream it can continue)


@dataclass(frozen=True, slots=True)
class Refusal:
    ticket: Ticket
    why: Why
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class Outcome:
    admitted: tuple[Ticket, ...] = ()
    refused: tuple[Refusal, ...] = ()
    pause: tuple[Ticket, ...] = ()  # running tickets the edge should pause now (``paused`` once they are)


NOTHING = Outcome()


@dataclass(slots=True)
class _Class:
    spec: ClassSpec
    clock: float = 0.0
    usage: dict[str, float] = field(default_factory=dict)
    active: dict[str, int] = field(default_factory=dict)  # client -> its waiters + running requests
    waiting: dict[str, list[Ticket]] = field(default_factory=dict)  # client -> its waiters, oldest first
    depth: int = 0


class AdmissionScheduler:
    def __init__(
        self, classes: Sequence[ClassSpec], default_capacity: int, capacities: Mapping[str, int] | None = None
    ) -> None:
        if not classes:
            raise ValueError("admission needs at least one class")
        self._classes = {c.name: _Class(c) for c in sorted(classes, key=lambda c: c.rank)}
        self.default_capacity = default_capacity
        self.capacities: dict[str, int] = dict(capacities or {})
        self._running: dict[str, int] = {}  # backend -> admitted, not finished
        self._tickets: dict[int, Ticket] = {}  # waiting ones
        # Running tickets that may be paused, per backend, oldest admitted first; those asked to pause.
        self._pausable: dict[str, dict[int, Ticket]] = {}
        self._pausing: dict[int, Ticket] = {}
        self._borrowers: dict[int, int] = {}  # a ticket asked to pause -> the rank of the one on its slot

    # -- what the edge reads ------------------------------------------------------------------------

    def capacity(self, backend: str) -> int:
        return self.capacities.get(backend, self.default_capacity)

    def running(self, backend: str) -> int:
        return self._running.get(backend, 0)

    def depth(self, klass: str) -> int:
        return self._classes[klass].depth

    def usage(self, klass: str, client: str) -> float:
        return self._classes[klass].usage.get(client, 0.0)

    def classes(self) -> list[str]:
        return list(self._classes)

    def pausing(self, backend: str) -> int:
        return sum(1 for t in self._pausing.values() if t.backend == backend)

    def waiting_ticket(self, ticket_id: int) -> Ticket | None:
        return self._tickets.get(ticket_id)

    def next_deadline(self) -> float | None:
        times = [t.arrived + self._classes[t.klass].spec.timeout_s for t in self._tickets.values()]
        return min(times, default=None)

    # -- events -------------------------------------------------------------------------------------

    def arrive(self, ticket: Ticket, now: float) -> Outcome:
        """A request for ``ticket.backend``: admitted now, queued, or refused (its class is full)."""
        c = self._classes[ticket.klass]
        room = self.capacity(ticket.backend) - self.running(ticket.backend)
        if c.depth >= c.spec.max_queued and room <= c.spec.headroom:
            return Outcome(refused=(Refusal(ticket, Why.QUEUE_FULL, c.spec.retry_after_s),))
        if not c.active.get(ticket.client):
            c.usage[ticket.client] = max(c.usage.get(ticket.client, 0.0), c.clock)
        c.active[ticket.client] = c.active.get(ticket.client, 0) + 1
        c.waiting.setdefault(ticket.client, []).append(ticket)
        c.depth += 1
        self._tickets[ticket.id] = ticket
        return self._fill(ticket.backend)

    def leave(self, ticket_id: int) -> Outcome:
        """A waiter gone (its client left, or its own deadline passed)."""
        ticket = self._tickets.get(ticket_id)
        if ticket is not None:
            self._unqueue(ticket)
            self._inactive(self._classes[ticket.klass], ticket.client)
        return NOTHING

    def finish(self, ticket: Ticket, used: int | None) -> Outcome:
        """An admitted request finished (``used``: its actual tokens, None: unknown, the estimate stands)."""
        running = self._running.get(ticket.backend, 0)
        if running <= 0 or ticket.id in self._tickets:
            return NOTHING
        self._running[ticket.backend] = running - 1
        self._unpausable(ticket)
        c = self._classes[ticket.klass]
        if used is not None:
            c.usage[ticket.client] = c.usage.get(ticket.client, 0.0) + used - ticket.cost
        self._inactive(c, ticket.client)
        return self._fill(ticket.backend)

    def paused(self, ticket: Ticket, now: float) -> Outcome:
        """A ticket asked to pause stopped at its engine: its slot is free, it waits again (first among its
        client's, its class's timeout counted from ``now``), its estimate uncharged until it is resumed."""
        running = self._running.get(ticket.backend, 0)
        if ticket.id not in self._pausing or running <= 0:
            return NOTHING
        self._unpausable(ticket)
        self._running[ticket.backend] = running - 1
        c = self._classes[ticket.klass]
        c.usage[ticket.client] = c.usage.get(ticket.client, 0.0) - ticket.cost
        again = replace(ticket, arrived=now)
        c.waiting.setdefault(ticket.client, []).insert(0, again)
        c.depth += 1
        self._tickets[again.id] = again
        return self._fill(ticket.backend)

    def keep(self, ticket: Ticket) -> Outcome:
        """The edge cannot pause ``ticket`` after all: never ask it again; the slot it was asked for is asked
        of the next victim, if any (else the backend runs one over until a request finishes)."""
        if self._pausable.get(ticket.backend, {}).pop(ticket.id, None) is None:
            return NOTHING
        if self._pausing.pop(ticket.id, None) is None:
            return NOTHING
        rank = self._borrowers.pop(ticket.id)
        victim = self._victim(ticket.backend)
        if victim is None or self._classes[victim.klass].spec.rank <= rank:
            return NOTHING
        self._pausing[victim.id] = victim
        self._borrowers[victim.id] = rank
        return Outcome(pause=(victim,))

    def swap(self, asked: Ticket, other: Ticket) -> bool:
        """Ask ``other`` to pause instead of ``asked`` (the edge knows which stream stops soonest): both of
        one class on one backend, ``asked`` asked and ``other`` pausable, not asked; False (nothing changed)
        otherwise."""
        pausable = self._pausable.get(asked.backend, {})
        if (
            asked.id not in self._pausing
            or other.id not in pausable
            or other.id in self._pausing
            or (other.backend, other.klass) != (asked.backend, asked.klass)
        ):
            return False
        del self._pausing[asked.id]
        self._pausing[other.id] = other
        self._borrowers[other.id] = self._borrowers.pop(asked.id)
        return True

    def expire(self, now: float) -> Outcome:
        """Refuse every waiter that has waited its class's timeout."""
        refused = []
        for ticket in list(self._tickets.values()):
            spec = self._classes[ticket.klass].spec
            if now - ticket.arrived >= spec.timeout_s:
                self.leave(ticket.id)
                refused.append(Refusal(ticket, Why.TIMEOUT, spec.retry_after_s))
        return Outcome(refused=tuple(refused))

    def set_capacity(self, backend: str, capacity: int) -> Outcome:
        self.capacities[backend] = capacity
        return self._fill(backend)

    # -- inside -------------------------------------------------------------------------------------

    def _fill(self, backend: str) -> Outcome:
        admitted: list[Ticket] = []
        paused: list[Ticket] = []
        while True:
            ticket = self._next(backend) if self.running(backend) < self.capacity(backend) else None
            if ticket is None and self._pausable.get(backend):
                ticket = self._borrow(backend, paused)
            if ticket is None:
                break
            self._unqueue(ticket)
            c = self._classes[ticket.klass]
            c.clock = max(c.clock, c.usage.get(ticket.client, 0.0))
            c.usage[ticket.client] = c.usage.get(ticket.client, 0.0) + ticket.cost
            self._running[backend] = self.running(backend) + 1
            if ticket.resumable and c.spec.preemptible:
                self._pausable.setdefault(backend, {})[ticket.id] = ticket
            admitted.append(ticket)
        if not admitted:
            return NOTHING
        return Outcome(admitted=tuple(admitted), pause=tuple(paused))

    def _victim(self, backend: str) -> Ticket | None:
        """The pausable ticket to ask first: of the lowest class, the newest admitted (least to re-read)."""
        victim: Ticket | None = None
        for t in self._pausable.get(backend, {}).values():  # oldest admitted first
            if t.id not in self._pausing and (
                victim is None or self._classes[t.klass].spec.rank >= self._classes[victim.klass].spec.rank
            ):
                victim = t
        return victim

    def _borrow(self, backend: str, paused: list[Ticket]) -> Ticket | None:
        """On a full ``backend``: the best waiter of a class above the victim's, seated now on the victim's
        slot (the victim is asked to pause; until it has, the backend runs one more than its capacity)."""
        victim = self._victim(backend)
        if victim is None:
            return None
        rank = self._classes[victim.klass].spec.rank
        for c in self._classes.values():  # by rank
            if c.spec.rank >= rank:
                return None
            ticket = self._best(c, backend)
            if ticket is not None:
                self._pausing[victim.id] = victim
                self._borrowers[victim.id] = c.spec.rank
                paused.append(victim)
                return ticket
        return None

    def _next(self, backend: str) -> Ticket | None:
        room = self.capacity(backend) - self.running(backend)
        for c in self._classes.values():  # by rank
            if room <= c.spec.headroom:
                continue
            best = self._best(c, backend)
            if best is not None:
                return best
        return None

    def _best(self, c: _Class, backend: str) -> Ticket | None:
        """``c``'s waiter for ``backend`` that goes first: the least-used client's oldest."""
        best: Ticket | None = None
        best_usage = 0.0
        for client, queue in c.waiting.items():
            ticket = next((t for t in queue if t.backend == backend), None)
            if ticket is None:
                continue
            usage = c.usage.get(client, 0.0)
            if best is None or (usage, ticket.arrived, ticket.id) < (best_usage, best.arrived, best.id):
                best, best_usage = ticket, usage
        return best

    def _unqueue(self, ticket: Ticket) -> None:
        del self._tickets[ticket.id]
        c = self._classes[ticket.klass]
        queue = c.waiting[ticket.client]
        queue.remove(ticket)
        if not queue:
            del c.waiting[ticket.client]
        c.depth -= 1

    def _unpausable(self, ticket: Ticket) -> None:
        pausable = self._pausable.get(ticket.backend)
        if pausable is not None:
            pausable.pop(ticket.id, None)
        self._pausing.pop(ticket.id, None)
        self._borrowers.pop(ticket.id, None)

    def _inactive(self, c: _Class, client: str) -> None:
        n = c.active.get(client, 0) - 1
        if n > 0:
            c.active[client] = n
        else:
            c.active.pop(client, None)
