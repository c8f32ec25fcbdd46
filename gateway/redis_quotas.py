"""Quota windows shared by every replica through Redis: one Lua script per admission, one per finish.

Round trips: a request of a key with a quota costs one (``QUOTA_ADMIT``, before routing: it reads and
counts the window atomically, and the key's in-flight requests over live replicas), and one more after its
answer (``QUOTA_FINISH``: in-flight down, tokens charged), which no request waits for. A key without a quota,
or quotas off, costs none. Windows are timed by the Redis server's clock (``TIME`` and ``PEXPIRE``), so
replicas' clocks may disagree. In-flight counts: each replica publishes its own count per key (written
over, newest first), counted only while the replica's lease in ``P replicas`` (the affinity store's
heartbeat) is live: a crashed replica's requests stop counting, a finish lost in an outage heals at the
key's next call.

A failed round trip raises ``QuotaUnavailable``, and so does every call while the affinity store is
degraded (Redis known down: no request waits for a timeout); the quota module then admits the request
(fails open). A finish that cannot be sent loses its tokens (they are not charged).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway import redis_scripts
from gateway.quota_windows import Exhausted, Limits, Verdict
from gateway.redis_keys import RedisKeys

_FAILURES = (RedisError, OSError, TimeoutError)
_REFUSED = {0: None, 1: Exhausted.REQUESTS, 2: Exhausted.TOKENS, 3: Exhausted.CONCURRENT}


class QuotaUnavailable(Exception):
    """The shared quota state could not be read or written (Redis down, slow or confused)."""


class RedisQuotas:
    def __init__(
        self,
        client: Redis,
        keys: RedisKeys,
        replica: str,
        on_failure: Callable[[str], None],
        degraded: Callable[[], bool] = lambda: False,
    ) -> None:
        self.keys = keys
        self.replica = replica
        self.on_failure = on_failure  # told why a background finish failed (the quota module logs it)
        self.degraded = degraded  # the affinity store's outage flag: no round trip is tried meanwhile
        self._admit = client.register_script(redis_scripts.QUOTA_ADMIT)
        self._finish = client.register_script(redis_scripts.QUOTA_FINISH)
        self._tasks: set[asyncio.Task[Any]] = set()  # finishes in flight, held until done
        self.in_flight: dict[str, int] = {}  # this replica's own count per key (what it publishes)
        self._seq = 0

    async def admit(self, key: str, limits: Limits) -> Verdict:
        """Count the request if the window has room. The client leaving meanwhile (the caller cancelled)
        does not cancel the script: if it admitted the request, the request is finished at once."""
        task = asyncio.ensure_future(self._window(key, limits, count=True))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda done: self._undo(done, key, limits))
            raise

    def _undo(self, done: asyncio.Future[Verdict], key: str, limits: Limits) -> None:
        if not done.cancelled() and done.exception() is None and done.result().refused is None:
            self.finish(key, limits, 0)

    async def state(self, key: str, limits: Limits) -> Verdict:
        return await self._window(key, limits, count=False)

    def finish(self, key: str, limits: Limits, tokens: int) -> None:
        """Sent in the background: nobody waits for it (a failure goes to ``on_failure``; the count it
        would have published goes with the key's next call)."""
        self.in_flight[key] = count = max(0, self.in_flight.get(key, 0) - 1)
        if self.degraded():
            self.on_failure("shared state degraded; tokens not charged")
            return
        keys = [self.keys.quota(key), self.keys.quota_in_flight(key)]
        args: list[str | int] = [self.replica, _ms(limits.window_s), tokens, count, self._next()]
        task = asyncio.get_running_loop().create_task(self._send_finish(keys, args))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _next(self) -> int:
        self._seq += 1
        return self._seq

    async def _send_finish(self, keys: list[str], args: list[str | int]) -> None:
        try:
            await self._finish(keys=keys, args=args)
        except _FAILURES as exc:
            self.on_failure(f"{type(exc).__name__}: {exc}")

    async def drained(self) -> None:
        """Wait for the finishes still being sent (shutdown, tests)."""
        while self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _window(self, key: str, limits: Limits, *, count: bool) -> Verdict:
        if self.degraded():
            raise QuotaUnavailable("shared state degraded (reconnecting)")
        mine = self.in_flight.get(key, 0) + (1 if count else 0)
        if count:
            self.in_flight[key] = mine  # reserved: another admission meanwhile counts this one
        keys = [self.keys.quota(key), self.keys.quota_in_flight(key), self.keys.replicas]
        args: list[str | int] = [
            self.replica,
            _ms(limits.window_s),
            limits.requests or 0,
            limits.tokens or 0,
            limits.concurrent or 0,
            "1" if count else "0",
            mine,
            self._next(),
        ]
        try:
            refused, requests, tokens, reset_ms, in_flight = await self._admit(keys=keys, args=args)
        except _FAILURES as exc:
            if count:
                self.in_flight[key] -= 1
            raise QuotaUnavailable(f"{type(exc).__name__}: {exc}") from exc
        verdict = Verdict(
            limits, _REFUSED[int(refused)], int(requests), int(tokens), reset_ms / 1000, in_flight
        )
        if count and verdict.refused is not None:
            self.in_flight[key] -= 1
        return verdict


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
