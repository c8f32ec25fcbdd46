"""Admission per backend: the request path's edge of ``backends.admission``'s scheduler.

A request is routed first, so conversation affinity holds: the proxy then counts it on the chosen backend (its
lease) and ``seat``\\s it there (gateway/phases.py ``BackendAdmission``), which returns at once while the
backend runs fewer than its ``max_in_flight`` admitted requests, else waits here until the scheduler picks it
(priority class, then fair share of tokens within the class). A request that waits never moves to another
backend: the routing policy decided where it goes (a pinned conversation waits for its warm engine; a new one
was routed by load, and the load a policy sees counts the requests waiting here, as it counts those waiting
in an engine's own queue when admission is off).

- Its class: the client key's (``admission.clients``), or ``x-warmroute-class`` from keys trusted with it,
  else ``default_class``. Its estimated tokens: prompt bytes / 4 plus ``max_tokens`` (or the default); the
  actual usage is charged when it finishes.
- A full class queue or a wait past the class's ``timeout_s``: ``AdmissionRefused`` (503, Retry-After).
- A stream that has waited ``keepalive_s`` is answered its ``200 text/event-stream`` head and sent an SSE
  comment every ``keepalive_s`` (through the waiting room's ``EarlyHeadSend``; a refusal after that is an
  SSE ``error`` event).
- Backends in ``engine_priority`` (vLLM under ``--scheduling-policy priority``) are sent the class's rank as
  the request's ``priority`` (0 first, as vLLM orders it), unless the client set one; others get nothing new.
- Classes with ``preemptible`` (batch): a stream of theirs that can be continued (gateway/pausing.py) may be
  paused for a waiting request of a higher class on its full backend: its engine request is aborted, the
  waiter takes the slot, and the stream waits for a seat again and goes on as a continuation of the same
  turn; its client sees one stream (and, while it waits, the same keep-alive comments as a waiting one).
- The client leaving (the proxy's task cancelled) leaves the queue at once; a seat already granted is given
  back. The ``Seat`` is released in the proxy's finish, whatever happened; releasing admits the next waiter.

Cost per request when on and nothing waits: a ticket, one future, two dict updates (no await suspends).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from starlette.types import Send

from backends.admission import AdmissionScheduler, ClassSpec, Outcome, Refusal, Ticket, Why
from backends.registry import Backend
from config.settings import AdmissionConfig
from gateway.context import Attempt, Draft, RequestContext
from gateway.errors import ServerBusy, UpstreamError
from gateway.metrics import AdmissionMetrics
from gateway.pausing import Pausable, resumable_attempt, resumable_body
from gateway.phases import BodyFilter
from gateway.waiting import EarlyHeadSend

log = logging.getLogger("warmroute.admission")

CLASS_HEADER = b"x-warmroute-class"
ADMITTED = "admitted"
LEFT = "left"
TIMEOUT_PAUSED = "timeout_paused"


class AdmissionRefused(ServerBusy):
    """503: the backend's queue for this class is full, or the request waited its class's timeout."""

    def __init__(self, message: str, why: Why, retry_after_s: float) -> None:
        super().__init__(message)
        self.code = f"admission_{why.value}"
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", str(max(1, math.ceil(self.retry_after_s))).encode())]


class Seat:
    """One admitted request's slot on its backend; ``release`` (once, idempotent) charges its usage.

    A resumable one may be ``asked`` to pause; ``pause`` gives the slot back and waits for it again."""

    __slots__ = ("_ctx", "_owner", "_send", "_ticket", "asked", "heard", "seated")

    def __init__(
        self, owner: AdmissionControl, ticket: Ticket, ctx: RequestContext | None, send: Send | None = None
    ) -> None:
        self._owner: AdmissionControl | None = owner
        self._ticket, self._ctx = ticket, ctx
        self._send = send  # the client's: a paused stream's keep-alive comments go there
        self.asked = False
        self.seated = True  # False while paused, waiting for its seat again
        self.heard = 0.0  # loop time of its engine's latest read (0: none yet)

    @property
    def ticket(self) -> Ticket:
        return self._ticket

    async def pause(self) -> None:
        """The stream stopped at its engine: the slot goes to the waiter; back once seated again (a wait past
        the class's timeout is an ``UpstreamError``: the stream is already under way). Meanwhile its client
        is sent an SSE comment every ``keepalive_s``, as a stream waiting for its first seat is."""
        if self._owner is None:
            return
        self.asked = self.seated = False
        self.heard = 0.0
        self._ticket = await self._owner.paused(self._ticket, self._send)
        self.seated = True

    def keep(self) -> None:
        """This stream cannot be paused (now or later): admission asks another."""
        self.asked = False
        if self._owner is not None:
            self._owner.keep(self._ticket)

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is None:
            return
        owner.unseat(self._ticket)
        if not self.seated:
            return  # left while paused: ``paused`` took it out of the queue
        try:
            used = _used(self._ctx)
        except Exception:  # a defect reading the usage must not keep the slot: the estimate stands
            log.exception("admission: reading a finished request's usage failed")
            used = None
        owner.finished(self._ticket, used)


class AdmissionControl:
    def __init__(self, cfg: AdmissionConfig, metrics: AdmissionMetrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.specs = {
            name: ClassSpec(name, rank, c.max_queued, c.timeout_s, c.retry_after_s, c.headroom, c.preemptible)
            for rank, (name, c) in enumerate(cfg.classes.items())
        }
        self.scheduler = AdmissionScheduler(tuple(self.specs.values()), cfg.max_in_flight, cfg.backends)
        self._waiters: dict[int, asyncio.Future[Refusal | None]] = {}
        self._ids = itertools.count(1)
        self._trusted = frozenset(cfg.class_header_clients)
        self._by_priority = frozenset(cfg.engine_priority)
        self._changed = asyncio.Event()  # set, and replaced, whenever a request queued, left or was decided
        self._watchers = 0  # ``until`` callers: the fast path announces only when someone listens
        self._pausable: dict[int, Seat] = {}  # seated resumable tickets: who is told to pause

    async def until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, checked whenever admission's state changes (tests, status)."""
        self._watchers += 1
        try:
            while not predicate():
                await self._changed.wait()
        finally:
            self._watchers -= 1

    # -- the Admission phase: only the stream's send, so that a long wait can answer its head early --

    def wrap(self, ctx: RequestContext, send: Send) -> Send:
        if ctx.body is None or ctx.body.get("stream") is not True or isinstance(send, EarlyHeadSend):
            return send
        return EarlyHeadSend(send, ctx.shape.errors)

    async def enter(self, ctx: RequestContext, send: Send) -> None:
        return None

    # -- BackendAdmission ---------------------------------------------------------------------------

    async def seat(self, ctx: RequestContext, backend: str, send: Send) -> Seat:
        klass = self.class_of(ctx)
        now = time.monotonic()
        resumable = self.specs[klass].preemptible and resumable_body(ctx.body)
        client = ctx.client or ""
        ticket = Ticket(next(self._ids), backend, client, klass, self.estimate(ctx), now, resumable)
        outcome = self.scheduler.arrive(ticket, now)
        if ticket in outcome.admitted:  # room, nobody waiting for it: no future
            self._record(ticket, ADMITTED)
            if self._watchers or outcome.pause:
                self._apply(outcome)
            return self._seated(ticket, ctx, send)
        waiter: asyncio.Future[Refusal | None] = asyncio.get_running_loop().create_future()
        self._waiters[ticket.id] = waiter
        self._apply(outcome)
        try:
            if not waiter.done():
                await self._wait(ticket, waiter, send)
        except BaseException:  # cancelled (the client left), or its keep-alive could not be sent
            self._gone(ticket, waiter)
            raise
        refusal = waiter.result()
        if refusal is not None:
            self._record(ticket, refusal.why.value)
            what = "is full" if refusal.why is Why.QUEUE_FULL else "took too long"
            raise AdmissionRefused(
                f"backend {backend} is saturated and its {klass} queue {what}",
                refusal.why,
                refusal.retry_after_s,
            )
        self._record(ticket, ADMITTED)
        return self._seated(ticket, ctx, send)

    def _seated(self, ticket: Ticket, ctx: RequestContext, send: Send) -> Seat:
        seat = Seat(self, ticket, ctx, send if ticket.resumable else None)
        if ticket.resumable:
            self._pausable[ticket.id] = seat
        return seat

    async def paused(self, ticket: Ticket, send: Send | None = None) -> Ticket:
        """``ticket``'s stream stopped at its engine: wait for its seat again (``Seat.pause``), keeping its
        client's stream alive (``send``: its head went out already)."""
        waiter: asyncio.Future[Refusal | None] = asyncio.get_running_loop().create_future()
        self._waiters[ticket.id] = waiter
        self.metrics.paused(ticket.klass)
        self._apply(self.scheduler.paused(ticket, time.monotonic()))
        again = self.scheduler.waiting_ticket(ticket.id) or ticket
        try:
            if not waiter.done():
                await self._wait(again, waiter, send, "paused, waiting for")
        except BaseException:  # the client left while its stream was paused
            self._gone(again, waiter)
            raise
        if waiter.result() is not None:
            self._record(again, TIMEOUT_PAUSED)
            raise UpstreamError(f"a paused stream waited too long for backend {ticket.backend}")
        self.metrics.running[ticket.backend] = self.scheduler.running(ticket.backend)
        return again

    def keep(self, ticket: Ticket) -> None:
        self._apply(self.scheduler.keep(ticket))

    def unseat(self, ticket: Ticket) -> None:
        self._pausable.pop(ticket.id, None)

    def finished(self, ticket: Ticket, used: int | None) -> None:
        self._apply(self.scheduler.finish(ticket, used))
        self.metrics.running[ticket.backend] = self.scheduler.running(ticket.backend)

    # -- PrepareStep: the class, told to engines that schedule by priority ----------------------------

    async def prepare(self, ctx: RequestContext, backend: Backend, draft: Draft) -> None:
        if backend.id in self._by_priority and "priority" not in (draft.read() or {}):
            draft.edit()["priority"] = self.specs[self.class_of(ctx)].rank

    # -- BodyFilters: a resumable stream's pausing ----------------------------------------------------------

    def body_filter(self, ctx: RequestContext, attempt: Attempt, status: int, sse: bool) -> BodyFilter | None:
        seat = next((s for s in ctx.seats if isinstance(s, Seat) and s.ticket.resumable), None)
        if seat is None:
            return None
        if status != 200 or not sse or not resumable_attempt(attempt):
            seat.keep()
            return None
        return Pausable(attempt, seat, seat.pause, seat.keep)

    def status(self) -> dict[str, Any]:
        """What the admin API shows: each class's queue, each backend's admitted requests, per-key counts."""
        classes = {
            name: {
                "rank": spec.rank,
                "waiting": self.scheduler.depth(name),
                "max_queued": spec.max_queued,
                "timeout_s": spec.timeout_s,
                "headroom": spec.headroom,
            }
            for name, spec in self.specs.items()
        }
        backends = {
            backend: {"running": running, "capacity": self.scheduler.capacity(backend)}
            for backend, running in sorted(self.metrics.running.items())
        }
        clients: dict[str, dict[str, int]] = {}
        for (client, outcome), n in sorted(self.metrics.clients.items()):
            clients.setdefault(client, {})[outcome] = n
        return {"classes": classes, "backends": backends, "clients": clients}

    def class_of(self, ctx: RequestContext) -> str:
        if ctx.client is not None and ctx.client in self._trusted:
            asked = ctx.first.get(CLASS_HEADER)
            if asked is not None and asked.decode(errors="replace") in self.specs:
                return asked.decode()
        if ctx.client is None:
            return self.cfg.default_class
        return self.cfg.clients.get(ctx.client, self.cfg.default_class)

    def estimate(self, ctx: RequestContext) -> int:
        body: dict[str, Any] = ctx.body or {}
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        completion = limit if isinstance(limit, int) and limit > 0 else self.cfg.default_max_tokens
        return len(ctx.raw) // 4 + completion

    # -- inside -------------------------------------------------------------------------------------

    async def _wait(
        self,
        ticket: Ticket,
        waiter: asyncio.Future[Refusal | None],
        send: Send | None,
        what: str = "waiting for",
    ) -> None:
        """Until ``waiter`` is decided or the class's timeout; a stream is sent ``: <what> <backend> (N s)``
        every ``keepalive_s`` (its head first, unless it went out already)."""
        deadline = ticket.arrived + self.specs[ticket.klass].timeout_s
        stream = send if isinstance(send, EarlyHeadSend) else None
        while not waiter.done():
            left = deadline - time.monotonic()
            if left <= 0:
                self._apply(self.scheduler.expire(max(time.monotonic(), deadline)))
                break
            await asyncio.wait({waiter}, timeout=min(left, self.cfg.keepalive_s))
            if stream is not None and not waiter.done() and deadline > time.monotonic():
                await stream.head()
                waited = time.monotonic() - ticket.arrived
                await stream.comment(f"{what} {ticket.backend} ({waited:.0f} s)")

    def _gone(self, ticket: Ticket, waiter: asyncio.Future[Refusal | None]) -> None:
        """The client left while waiting: out of the queue, or the seat just granted given back."""
        self._waiters.pop(ticket.id, None)
        if waiter.done() and waiter.result() is None:
            self._apply(self.scheduler.finish(ticket, 0))
        else:
            self._apply(self.scheduler.leave(ticket.id))
        self._record(ticket, LEFT)

    def _apply(self, outcome: Outcome) -> None:
        for ticket in outcome.pause:
            seat = self._sooner(self._pausable.get(ticket.id), ticket)
            if seat is None:  # not relayed yet, or already ending: let the scheduler ask another
                self._apply(self.scheduler.keep(ticket))
            else:
                seat.asked = True
        for ticket in outcome.admitted:
            waiter = self._waiters.pop(ticket.id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        for refusal in outcome.refused:
            waiter = self._waiters.pop(refusal.ticket.id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(refusal)
        for name in self.specs:
            self.metrics.depth(name, self.scheduler.depth(name))
        self._announce()

    def _sooner(self, seat: Seat | None, ticket: Ticket) -> Seat | None:
        """The seat to pause for ``ticket``'s: of its class and backend, the one whose engine was heard from
        longest ago (its next read, where a pause takes effect, comes first; engines that decode in lockstep
        tie, and the scheduler's choice stands)."""
        best = seat
        for other in self._pausable.values():
            t = other.ticket
            if other.asked or not other.heard or (t.backend, t.klass) != (ticket.backend, ticket.klass):
                continue
            if best is None or not best.heard or other.heard < best.heard:
                best = other
        if best is not seat and best is not None and not self.scheduler.swap(ticket, best.ticket):
            return seat
        return best

    def _announce(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _record(self, ticket: Ticket, outcome: str) -> None:
        self.metrics.waited(ticket.klass, ticket.client, time.monotonic() - ticket.arrived, outcome)
        self.metrics.running[ticket.backend] = self.scheduler.running(ticket.backend)


def _used(ctx: RequestContext | None) -> int | None:
    """The request's actual tokens, when its answer said (None: the estimate stands)."""
    if ctx is None:
        return None
    usage = None if ctx.attempt is None else ctx.attempt.usage
    if usage is None and ctx.tap is not None:
        usage = ctx.tap.usage()
    return None if usage is None else usage.prompt_tokens + usage.completion_tokens
