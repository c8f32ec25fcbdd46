"""Runtime backend changes reach every replica: a Redis hash of records plus a version the replicas poll.

Choice: polling a version counter rather than pub/sub. A replica that was down or cut off from Redis
misses pub/sub messages for good, while the hash is the whole current state: one ``GET`` per
``admin.sync_interval_s`` (default 1 s) tells a replica whether anything moved, and an ``HGETALL`` of a
few records brings it up to date, whenever it comes back. A replica that starts later applies the
records before its fleet starts, so it comes up with the backends the others run.

Layout (``gateway.redis_keys``): ``P admin:backends`` maps a backend id to a JSON record; ``P admin:version``
is INCR'd in the same MULTI as every write. A record says
``{"config": {...}}``  (added or changed at runtime: the full ``backends[]`` entry),
``{"config": null}``   (removed), or no ``config`` key (a config-file backend: only operator flags), plus
``"drained"`` / ``"cordoned"`` booleans when an operator set them.

Changes are applied locally first, then published; the feed re-reading our own write applies nothing new
(every ``LocalChanges`` step is idempotent in effect). A lock keeps a poll from interleaving with a local
change and its publication. If Redis is unreachable the change stays local and the API says so
(``propagated: false``; with no Redis configured it says ``null``); the next successful change republishes
only its own record.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from backends.events import Command
from config.settings import BackendConfig
from gateway.admin.runtime import LocalChanges
from gateway.redis_keys import RedisKeys

log = logging.getLogger("warmroute.admin.sync")

_FAILURES = (RedisError, OSError, TimeoutError)


class ChangeFeed:
    def __init__(
        self, redis: Redis, keys: RedisKeys, local: LocalChanges, interval_s: float, allow_managed: bool
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.local = local
        self.interval_s = interval_s
        self.allow_managed = allow_managed
        self.lock = asyncio.Lock()
        self.seen: str | None = None  # the version last applied
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Apply what the other replicas changed so far (Redis down: nothing), then poll in the background."""
        await self.poll()
        self._task = asyncio.create_task(self._run(), name="warmroute-admin-sync")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def publish(self, backend_id: str, **fields: Any) -> bool:
        """Merge ``fields`` into the backend's record and bump the version. False if Redis failed."""
        try:
            raw = await self.redis.hget(self.keys.admin_backends, backend_id)
            record = json.loads(raw) if raw else {}
            record.update(fields)
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(self.keys.admin_backends, backend_id, json.dumps(record, sort_keys=True))
                pipe.incr(self.keys.admin_version)
                await pipe.execute()
        except _FAILURES as exc:
            log.warning("admin change to %s not propagated: Redis failed (%s)", backend_id, exc)
            return False
        return True

    async def poll(self) -> bool:
        """Re-read and apply the records if the version moved; True if it did."""
        try:
            version = _text(await self.redis.get(self.keys.admin_version))
            if version == self.seen:
                return False
            raw_records = await self.redis.hgetall(self.keys.admin_backends)
            records = {_text(k) or "": _text(v) or "{}" for k, v in raw_records.items()}
        except _FAILURES as exc:
            log.debug("admin change feed: Redis unavailable (%s)", exc)
            return False
        async with self.lock:
            for backend_id, raw in sorted(records.items()):
                try:
                    await self._apply(backend_id, json.loads(raw))
                except Exception:  # one bad record must not stop the others (nor the feed)
                    log.exception("admin change feed: cannot apply the record of %s", backend_id)
        self.seen = version
        return True

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.poll()

    async def _apply(self, backend_id: str, record: dict[str, Any]) -> None:
        registry = self.local.gw.registry
        if "config" in record:
            if record["config"] is None:
                if backend_id in registry.backends:
                    await self.local.remove(backend_id)
                return
            if not await self._apply_config(backend_id, record["config"]):
                return
        controller = self.local.gw.fleet.controllers.get(backend_id)
        if controller is None:
            return
        lc = controller.lifecycle
        for flag, on, off in (
            ("drained", Command.DRAIN, Command.UNDRAIN),
            ("cordoned", Command.CORDON, Command.UNCORDON),
        ):
            wanted = record.get(flag)
            if isinstance(wanted, bool) and wanted != getattr(lc, flag):
                self.local.command(backend_id, on if wanted else off)

    async def _apply_config(self, backend_id: str, data: Any) -> bool:
        try:
            cfg = BackendConfig.model_validate(data)
        except ValidationError as exc:
            log.error("admin change feed: invalid config for backend %s: %s", backend_id, exc)
            return False
        if cfg.managed is not None and not self.allow_managed:
            log.error("admin change feed: backend %s is managed and admin.allow_managed is off here", cfg.id)
            return False
        registry = self.local.gw.registry
        current = registry.backends.get(cfg.id)
        if current is None:
            self.local.add(cfg)
        elif current.cfg != cfg:
            if (current.cfg.url, current.cfg.models) == (cfg.url, cfg.models) and _only_weight(
                current.cfg, cfg
            ):
                self.local.reconfigure(cfg)
            else:
                await self.local.remove(cfg.id)
                self.local.add(cfg)
        return True


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def _only_weight(a: BackendConfig, b: BackendConfig) -> bool:
    return a.model_copy(update={"weight": b.weight}) == b
