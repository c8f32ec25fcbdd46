"""``Changes``: the one announcement of state changes — backend lifecycles, the fleet, affinity pins.

The writers call ``notify`` (synchronous, never awaits): a lifecycle controller through ``Fleet``, the
fleet when a backend is added or removed, the admin plane when it reconfigures one in place, an affinity
store when a commit changed a pin, the Redis store when it turns degraded or recovers. Readers either
wait for a state (``wait(predicate)``: the predicate reads the state itself and is re-checked after every
change) or follow the exact sequence of changes (``subscribe()``: an async iterator of ``Change``).

Invariants: ``version`` only grows, by one per ``notify``. No wake-up is lost: ``wait`` checks its
predicate before it parks and the loop runs nothing in between, and a subscription's queue exists from
``subscribe()`` on, before its first ``__anext__``. Cost with nobody listening: an increment and two
empty-collection checks; a ``Change`` is built only when a subscription is open.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from enum import StrEnum


class ChangeKind(StrEnum):
    STATE = "state"  # a backend's lifecycle state or routability changed
    ADDED = "added"  # a backend was registered
    REMOVED = "removed"  # a backend was unregistered
    RECONFIGURED = "reconfigured"  # a backend's config changed in place (its weight, at runtime)
    PIN = "pin"  # a conversation's pin was claimed or moved
    SHARED_STATE = "shared_state"  # the shared state store (Redis) turned degraded, or answers again


@dataclass(frozen=True, slots=True)
class Change:
    version: int
    kind: ChangeKind
    subject: str  # the backend id (or, for PIN, the conversation key; for SHARED_STATE, the store: "redis")
    value: str  # STATE: the new state; PIN: the backend pinned; SHARED_STATE: "degraded" or "ok"; else ""


class Subscription:
    """Every change from its creation on, in order; ``aclose`` (or leaving ``async with``) ends it."""

    def __init__(self, changes: Changes) -> None:
        self._changes = changes
        self._queue: deque[Change] = deque()
        self._ready = asyncio.Event()

    def _put(self, change: Change) -> None:
        self._queue.append(change)
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[Change]:
        return self

    async def __anext__(self) -> Change:
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        return self._queue.popleft()

    async def next(self, within: float) -> Change:
        """The next change; TimeoutError if none comes within ``within`` seconds."""
        async with asyncio.timeout(within):
            return await self.__anext__()

    def pending(self) -> list[Change]:
        """The changes received and not read yet, taken out of the queue."""
        taken = list(self._queue)
        self._queue.clear()
        return taken

    async def aclose(self) -> None:
        self._changes._subscriptions.discard(self)

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()


class Changes:
    def __init__(self) -> None:
        self.version = 0
        self._waiters: set[asyncio.Future[None]] = set()
        self._subscriptions: set[Subscription] = set()

    def notify(self, kind: ChangeKind, subject: str, value: str = "") -> None:
        """Announce one change (the writer's side: synchronous, never awaits, never raises)."""
        self.version += 1
        if self._waiters:
            waiters, self._waiters = self._waiters, set()
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)
        if self._subscriptions:
            change = Change(self.version, kind, subject, value)
            for sub in self._subscriptions:
                sub._put(change)

    async def changed(self, since: int) -> int:
        """Wait until ``version`` passes ``since`` (at once if it has); the version then."""
        while self.version <= since:
            fut = asyncio.get_running_loop().create_future()
            self._waiters.add(fut)
            try:
                await fut
            finally:
                self._waiters.discard(fut)  # cancelled or timed out: leave no future behind
        return self.version

    async def wait(self, predicate: Callable[[], object], within: float) -> None:
        """Return once ``predicate()`` is true, re-checked after each change; TimeoutError after
        ``within`` seconds. The predicate reads the state itself, so a change made before the call
        counts as well."""
        async with asyncio.timeout(within):
            while True:
                seen = self.version  # before the check: a change during or after it ends the next wait
                if predicate():
                    return
                await self.changed(seen)

    def subscribe(self) -> Subscription:
        sub = Subscription(self)
        self._subscriptions.add(sub)
        return sub
