"""Quota windows shared by every replica through Redis: one Lua script per admission, one per finish.

Round trips: a request of a key with a quota costs one (``QUOTA_ADMIT``, before routing: it reads and
counts the window atomically, and the key's in-flight requests over live replicas), and one more after its
answer (``QUOTA_FINISH``: in-flight down, tokens charged), which no request waits for. A key without a quota,
or quotas off, costs none. Windows are timed by the Redis server's clock (``TIME`` and ``PEXPIRE``), so
replicas' clocks may disagree. In-flight counts are per replica and count only while the replica's lease in
``P replicas`` (the affinity store's heartbeat) is live: a crashed replica's requests stop counting.

A failed round trip raises ``QuotaUnavailable``; the quota module then admits the request (fails open).
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
        self, client: Redis, keys: RedisKeys, replica: str, on_failure: Callable[[str], None]
    ) -> None:
        self.keys = keys
        self.replica = replica
        self.on_failure = on_failure  # told why a background finish failed (the quota module logs it)
        self._admit = client.register_script(redis_scripts.QUOTA_ADMIT)
        self._finish = client.register_script(redis_scripts.QUOTA_FINISH)
        self._tasks: set[asyncio.Task[Any]] = set()  # finishes in flight, held until done

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
        """Sent in the background: nobody waits for it (a failure goes to ``on_failure``)."""
        keys = [self.keys.quota(key), self.keys.quota_in_flight(key)]
        task = asyncio.get_running_loop().create_task(
            self._send_finish(keys, [self.replica, _ms(limits.window_s), tokens])
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

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
        keys = [self.keys.quota(key), self.keys.quota_in_flight(key), self.keys.replicas]
        args: list[str | int] = [
            self.replica,
            _ms(limits.window_s),
            limits.requests or 0,
            limits.tokens or 0,
            limits.concurrent or 0,
            "1" if count else "0",
        ]
        try:
            refused, requests, tokens, reset_ms, in_flight = await self._admit(keys=keys, args=args)
        except _FAILURES as exc:
            raise QuotaUnavailable(f"{type(exc).__name__}: {exc}") from exc
        return Verdict(limits, _REFUSED[int(refused)], int(requests), int(tokens), reset_ms / 1000, in_flight)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
