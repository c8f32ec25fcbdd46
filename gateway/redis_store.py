"""``RedisAffinityStore``: affinity pins, pinned-conversation counts and in-flight counts shared in Redis.

Round trips. A routed request costs at most two, each one Lua script (``gateway.redis_scripts``): ``view``
reads the pin, every backend's pinned count and the other replicas' in-flight counts; ``commit`` claims,
touches or moves the pin atomically and returns the winner (the first claim wins, so two replicas never
split a new conversation). ``started``/``finished`` only change this replica's local counts; every script
also publishes them (a per-replica hash with a lease TTL), and a heartbeat does so when the replica is idle.

Leases. A replica's in-flight hash expires ``lease_ttl_s`` after its last publication, and readers sum only
replicas whose lease is live, so a crashed replica's requests stop counting. Pinned counts come from
per-backend sorted sets scored by expiry, trimmed on read, so they follow expiring pins.

Outages. A round trip gives up after ``timeout_s`` without progress (waiting for a pooled connection,
connecting, reading), with no redis-py retries. On any failure the store turns *degraded*: it routes
from a local ``AffinityTable`` (a mirror of every pin this replica committed) and this process's own
in-flight counts, records the pins it makes meanwhile, and a background task retries with exponential
backoff. When Redis answers again it writes those pins back (SET NX; a move made during the outage
overwrites), and, if Redis lost its data (its epoch token changed), the whole local mirror; then it reads
from Redis again. Clients never see a Redis error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import BlockingConnectionPool, Connection, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from backends.changes import ChangeKind, Changes
from config.settings import RedisConfig, RoutingConfig
from gateway import redis_scripts
from gateway.redis_keys import RedisKeys
from gateway.state import AdminChannel, MemoryAffinityStore, Pin, StoreView
from routing.types import Decision, PinAction

log = logging.getLogger("warmroute.state")

#: What an unreachable, slow or confused Redis raises through redis-py (timeouts included).
_FAILURES = (RedisError, OSError, TimeoutError)
_RESTORE_BATCH = 500


def redis_pool(cfg: RedisConfig, connection_class: type[Connection] = Connection) -> BlockingConnectionPool:
    """A pool that fails fast: short timeouts and no redis-py retries (the store falls back instead)."""
    assert cfg.url is not None
    return BlockingConnectionPool.from_url(
        cfg.url,
        connection_class=connection_class,
        max_connections=cfg.max_connections,
        timeout=cfg.timeout_s,
        socket_timeout=cfg.timeout_s,
        socket_connect_timeout=cfg.timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )


class RedisAffinityStore:
    #: The commit is a script call: the proxy counts the decision meanwhile, so this replica's counts as the
    #: commit publishes them include it (other replicas see it placed with no round trip of its own).
    commit_is_round_trip = True

    def __init__(
        self,
        cfg: RedisConfig,
        routing: RoutingConfig,
        backends: Sequence[str],
        *,
        pool: BlockingConnectionPool | None = None,
        clock: Callable[[], float] = time.monotonic,
        changes: Changes | None = None,
    ) -> None:
        self.cfg = cfg
        self.keys = RedisKeys(cfg.prefix)
        self.changes = changes if changes is not None else Changes()
        # Mirror of our pins; the whole truth when degraded (its commits announce on the same changes).
        self.local = MemoryAffinityStore(routing, clock, self.changes)
        self.replica = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._client = Redis(connection_pool=pool or redis_pool(cfg))
        self._view = self._client.register_script(redis_scripts.VIEW)
        self._commit = self._client.register_script(redis_scripts.COMMIT)
        self._heartbeat = self._client.register_script(redis_scripts.HEARTBEAT)
        self._restore = self._client.register_script(redis_scripts.RESTORE)
        self._forget = self._client.register_script(redis_scripts.FORGET)
        self._ttl_ms = max(1, int(routing.affinity_ttl_s * 1000))
        self._owner_ttl_ms = max(1, int(routing.response_owner_ttl_s * 1000))
        self._max_pending = routing.affinity_max_entries
        self._backends = tuple(backends)
        self._in_flight = dict.fromkeys(self._backends, 0)
        self._seq = 0
        self._lease_ms = max(1, int(cfg.lease_ttl_s * 1000))
        self._degraded = False
        self._degraded_since: float | None = None
        self._last_error: str | None = None
        self._pending: dict[str, bool] = {}  # pins made while degraded -> overwrite on resync (a move)?
        self._resync_all = False
        self._epoch: str | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # -- the AffinityStore port ---------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self._beat()
        except _FAILURES as exc:
            self._degrade(exc)
        self._ensure_task()

    async def view(self, key: str | None) -> StoreView:
        if self._degraded:
            return await self.local.view(key)
        keys = [self.keys.replicas, self.keys.in_flight(self.replica)]
        if key is not None:
            keys.append(self.keys.pin(key))
        extra = (self.keys.in_flight_prefix, self.keys.conversations_prefix, "0" if key is None else "1")
        backends = self._backends  # what the script is asked about (set_backends may change it meanwhile)
        try:
            pin, convs, others = await self._run(self._view, keys, extra)
        except _FAILURES as exc:
            self._degrade(exc)
            return await self.local.view(key)
        if pin is None and key is not None:
            # Redis has no pin but we remember one: Redis lost it (restart, eviction). Our pin is at least
            # as fresh as Redis's would be (we wrote both), so use it; the commit writes it back.
            pin = self.local.table.get(key, self.local.clock())
        conversations = dict(zip(backends, convs, strict=True))
        in_flight = {b: n + self._in_flight.get(b, 0) for b, n in zip(backends, others, strict=True)}
        return StoreView(pin, conversations, in_flight)

    async def commit(self, key: str, decision: Decision) -> str:
        assert decision.backend is not None
        if self._degraded:
            return self._commit_locally(key, decision)
        keys = [self.keys.replicas, self.keys.in_flight(self.replica), self.keys.pin(key)]
        action = "move" if decision.pin is PinAction.MOVE else "claim"  # touch == claim: keep what is there
        extra = (action, decision.backend, key, self._ttl_ms, self.keys.conversations_prefix)
        try:
            winner: str = await self._run(self._commit, keys, extra)
        except _FAILURES as exc:
            self._degrade(exc)
            return self._commit_locally(key, decision)
        self.local.table.move(key, winner, self.local.clock())
        if decision.pin is not PinAction.TOUCH:
            self.changes.notify(ChangeKind.PIN, key, winner)
        return winner

    def started(self, backend: str) -> None:
        self._in_flight[backend] = self._in_flight.get(backend, 0) + 1
        self._seq += 1

    def finished(self, backend: str) -> None:
        self._in_flight[backend] = self._in_flight.get(backend, 0) - 1
        self._seq += 1

    async def own(self, response_id: str, backend: str) -> None:
        """SET with the owner TTL, kept locally too; while degraded (or on a failure) local only: other
        replicas then answer 404 for it, until its owner answers the client again after Redis is back."""
        await self.local.own(response_id, backend)
        if self._degraded:
            return
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                await self._client.set(self.keys.response_owner(response_id), backend, px=self._owner_ttl_ms)
        except _FAILURES as exc:
            self._degrade(exc)

    async def owner(self, response_id: str) -> str | None:
        """From Redis, else (degraded, or not there) what this replica recorded itself."""
        if not self._degraded:
            try:
                async with asyncio.timeout(self.cfg.timeout_s):
                    found = await self._client.get(self.keys.response_owner(response_id))
            except _FAILURES as exc:
                self._degrade(exc)
            else:
                if found is not None:
                    return found if isinstance(found, str) else bytes(found).decode()
        return await self.local.owner(response_id)

    @property
    def degraded(self) -> bool:
        """Redis failed a round trip and has not answered since (routing is local meanwhile)."""
        return self._degraded

    def status(self) -> dict[str, object]:
        return {
            "backend": "redis",
            "degraded": self._degraded,
            "replica": self.replica,
            "degraded_since": self._degraded_since,
            "last_error": self._last_error,
            "pending_resync": len(self._pending),
            "local_entries": len(self.local.table),
        }

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if not self._degraded:
            # A clean exit withdraws this replica's in-flight counts at once instead of letting them expire.
            with contextlib.suppress(*_FAILURES):
                async with asyncio.timeout(self.cfg.timeout_s):
                    async with self._client.pipeline(transaction=False) as pipe:
                        pipe.zrem(self.keys.replicas, self.replica)
                        pipe.delete(self.keys.in_flight(self.replica))
                        await pipe.execute()
        await self._client.aclose(close_connection_pool=True)

    # -- the admin API ------------------------------------------------------------------------------

    @property
    def client(self) -> Redis:
        """The store's Redis client (the admin API's change feed shares its pool)."""
        return self._client

    def admin_channel(self) -> AdminChannel:
        return AdminChannel(self._client, self.keys)

    def backends_changed(self, backends: Sequence[str]) -> None:
        self.set_backends(backends)

    def set_backends(self, backends: Sequence[str]) -> None:
        """The backends to count from now on (one added or removed at runtime). No I/O."""
        known = set(self._backends)
        self._backends = tuple(backends)
        # A backend added again starts from zero (its old incarnation's leases may have left a stray count).
        self._in_flight = {b: self._in_flight.get(b, 0) if b in known else 0 for b in self._backends}
        self._seq += 1

    async def forget_backend(self, backend: str) -> None:
        """A removed backend's shared counts go: its pinned-conversation set and our in-flight field. Its
        pins stay, so each conversation re-pins on its next turn (``repin_removed``)."""
        if self._degraded:
            return
        with contextlib.suppress(*_FAILURES):
            async with asyncio.timeout(self.cfg.timeout_s):
                async with self._client.pipeline(transaction=False) as pipe:
                    pipe.delete(self.keys.conversations(backend))
                    pipe.hdel(self.keys.in_flight(self.replica), backend)
                    await pipe.execute()

    async def pin(self, key: str) -> Pin | None:
        """(backend, seconds left) of the pin of ``key``, or None; from the local mirror when degraded."""
        if not self._degraded:
            try:
                async with self._client.pipeline(transaction=False) as pipe:
                    pipe.get(self.keys.pin(key))
                    pipe.pttl(self.keys.pin(key))
                    backend, ttl_ms = await pipe.execute()
            except _FAILURES as exc:
                self._degrade(exc)
            else:
                return None if backend is None else Pin(backend, ttl_ms / 1000 if ttl_ms >= 0 else None)
        found = self.local.table.entry(key)
        return None if found is None else Pin(found[0], max(0.0, found[1] - self.local.clock()))

    async def forget(self, key: str) -> str | None:
        """Drop the pin of ``key`` everywhere; the backend it named, or None."""
        local = self.local.table.forget(key)
        self._pending.pop(key, None)
        if self._degraded:
            return local
        try:
            found: str | None = await self._forget(
                keys=[self.keys.pin(key)], args=[self.keys.conversations_prefix, key]
            )
        except _FAILURES as exc:
            self._degrade(exc)
            return local
        return found or local

    # -- round trips --------------------------------------------------------------------------------

    async def _run(self, script: Any, keys: list[str], extra: Sequence[str | int]) -> Any:
        """One script call; publishes this replica's in-flight counts as a side effect."""
        counts = [self._in_flight.get(b, 0) for b in self._backends]
        args = [
            self.replica,
            self._lease_ms,
            self._seq,
            len(self._backends),
            *self._backends,
            *counts,
            *extra,
        ]
        return await script(keys=keys, args=args)

    async def _beat(self) -> None:
        keys = [self.keys.replicas, self.keys.in_flight(self.replica), self.keys.epoch]
        epoch: str = await self._run(self._heartbeat, keys, (secrets.token_hex(8),))
        if self._epoch is not None and epoch != self._epoch:
            log.warning("shared state: Redis lost its data (new epoch); writing local pins back")
            self._resync_all = True
        self._epoch = epoch
        await self._resync()

    async def _resync(self) -> int:
        """Write pending local pins to Redis until none are left. Restores the batch if a write fails."""
        written = 0
        while self._pending or self._resync_all:
            batch, self._pending = self._pending, {}
            if self._resync_all:
                self._resync_all = False
                entries = [(k, b, exp, batch.get(k, False)) for k, b, exp in self.local.table.items()]
            else:
                entries = []
                for k, force in batch.items():
                    found = self.local.table.entry(k)
                    if found is not None:
                        entries.append((k, found[0], found[1], force))
            try:
                for i in range(0, len(entries), _RESTORE_BATCH):
                    written += await self._restore_batch(entries[i : i + _RESTORE_BATCH])
            except _FAILURES:
                for k, force in batch.items():
                    self._pending[k] = self._pending.get(k, False) or force
                raise
        return written

    async def _restore_batch(self, entries: list[tuple[str, str, float, bool]]) -> int:
        now = self.local.clock()
        keys: list[str] = []
        args: list[str | int] = [self.keys.conversations_prefix]
        for key, backend, expires_at, force in entries:
            ttl_ms = int((expires_at - now) * 1000)
            if ttl_ms > 0:
                keys.append(self.keys.pin(key))
                args += [key, backend, ttl_ms, "1" if force else "0"]
        if not keys:
            return 0
        written: int = await self._restore(keys=keys, args=args)
        return written

    # -- degraded mode ------------------------------------------------------------------------------

    def _commit_locally(self, key: str, decision: Decision) -> str:
        assert decision.backend is not None
        table, now = self.local.table, self.local.clock()
        move = decision.pin is PinAction.MOVE
        if move:
            table.move(key, decision.backend, now)
            winner = decision.backend
        else:
            winner = table.claim(key, decision.backend, now)  # an existing pin is refreshed and kept
        if len(self._pending) < self._max_pending:
            self._pending[key] = move or self._pending.get(key, False)
        else:
            self._resync_all = True  # too many to track one by one: write the whole table back
        if decision.pin is not PinAction.TOUCH:
            self.changes.notify(ChangeKind.PIN, key, winner)
        return winner

    def _degrade(self, exc: BaseException) -> None:
        self._last_error = f"{type(exc).__name__}: {exc}"
        if not self._degraded:
            log.warning("shared state: Redis unavailable (%s); routing from local state", self._last_error)
            self._degraded = True
            self._degraded_since = time.time()
            self.changes.notify(ChangeKind.SHARED_STATE, "redis", "degraded")
        self._wake.set()
        self._ensure_task()

    def _ensure_task(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._maintain(), name="warmroute-redis")

    async def _maintain(self) -> None:
        """Heartbeat while healthy; while degraded, reconnect with backoff, resync, and resume."""
        delay = self.cfg.reconnect_min_s
        while True:
            if not self._degraded:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.cfg.heartbeat_s):
                        await self._wake.wait()
                if not self._degraded:
                    try:
                        await self._beat()
                    except Exception as exc:  # the loop must outlive any surprise; Redis errors are expected
                        _log_unexpected(exc)
                        self._degrade(exc)
                continue
            await asyncio.sleep(delay)
            if await self._recover():
                delay = self.cfg.reconnect_min_s
            else:
                delay = min(delay * 2, self.cfg.reconnect_max_s)

    async def _recover(self) -> bool:
        pending = len(self._pending)
        try:
            # Connections from before the outage may still sit in the pool, their sockets reset by the old
            # server without the pool noticing: the first command on one after recovery would fail and
            # degrade the store again. Nothing else uses the pool while degraded, so drop them all.
            await self._client.connection_pool.disconnect()
            await self._beat()  # publishes our counts, checks the epoch and resyncs pending pins
        except Exception as exc:
            _log_unexpected(exc)
            self._last_error = f"{type(exc).__name__}: {exc}"
            return False
        # No await since _resync found nothing pending: no pin made locally can be left behind.
        self._degraded = False
        self._degraded_since = None
        self.changes.notify(ChangeKind.SHARED_STATE, "redis", "ok")
        log.warning("shared state: Redis is back; %d pins made meanwhile written back", pending)
        return True


def _log_unexpected(exc: Exception) -> None:
    if not isinstance(exc, _FAILURES):
        log.error("shared state: unexpected error talking to Redis", exc_info=exc)
