"""Active health checks: a dead backend stops receiving new work; a recovered one gets it back.

Probe: GET ``health.path`` (default /health); a 404 there falls back to GET /v1/models, which every
OpenAI-compatible server has. The checker writes no state: it reports every result to its ``ProbeSink``
(the lifecycle controllers, via ``backends.fleet``), where ``fail_threshold`` failures make an outage and a
success after one starts the canary.

Each backend is probed by its own task on its own interval, so a slow engine delays only its own probes.
A probe, fallback included, has a total deadline of ``timeout_s``: httpx's timeout bounds each read, and an
engine that answers one byte at a time would otherwise never time out. Whatever a probe raises counts as a
failure of that backend; the loop goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

import httpx

from backends.registry import Backend, Registry
from config.settings import HealthConfig

log = logging.getLogger("warmroute.health")


class ProbeSink(Protocol):
    """Told every probe's result: ``error`` is None for a healthy answer. Must not block."""

    def probed(self, backend_id: str, error: str | None) -> None: ...


class HealthChecker:
    """Owns one probing task per watched backend: ``start()`` and ``aclose()`` in the app's lifespan."""

    def __init__(
        self, registry: Registry, client: httpx.AsyncClient, cfg: HealthConfig, sink: ProbeSink
    ) -> None:
        self.registry = registry
        self.client = client
        self.cfg = cfg
        self.sink = sink
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def check_all(self) -> None:
        """Probe every backend once, concurrently; returns within about ``timeout_s`` (start-up)."""
        await asyncio.gather(*(self.check(b) for b in self.registry.backends.values()))

    def start(self) -> None:
        """Probe every registered backend in the background, each every ``interval_s``. Idempotent."""
        for backend in self.registry.backends.values():
            self.watch(backend)

    def watch(self, backend: Backend) -> None:
        """Start probing ``backend`` (for one added at runtime); nothing happens if it is already watched."""
        task = self._tasks.get(backend.id)
        if task is None or task.done():
            name = f"warmroute-health-{backend.id}"
            self._tasks[backend.id] = asyncio.create_task(self._watch(backend), name=name)

    async def unwatch(self, backend_id: str) -> None:
        """Stop probing a backend (for one removed at runtime); returns once its task has ended."""
        task = self._tasks.pop(backend_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def aclose(self) -> None:
        """Stop every probing task and wait for them to end."""
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self) -> None:
        """``start()``, then wait until cancelled, then ``aclose()``: for callers that own one task."""
        self.start()
        try:
            await asyncio.get_running_loop().create_future()  # never resolves
        finally:
            await self.aclose()

    async def check(self, backend: Backend) -> None:
        """Probe ``backend`` once and report the outcome. Raises nothing but ``CancelledError``."""
        error = await self._bounded_probe(backend)
        backend.last_checked = time.time()
        backend.last_error = error
        self.sink.probed(backend.id, error)

    async def _watch(self, backend: Backend) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            await self.check(backend)

    async def _bounded_probe(self, backend: Backend) -> str | None:
        """``_probe`` within ``timeout_s`` in all; a timeout or any exception becomes the failure's text."""
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                return await self._probe(backend)
        except TimeoutError:
            return f"health probe got no complete answer within {self.cfg.timeout_s}s"
        except Exception as exc:  # a bug or a surprise in one probe must not stop the probing
            error = f"health probe raised {_describe(exc)}"
            if error != backend.last_error:  # one line per new kind of failure, no traceback per round
                log.warning("backend %s: %s", backend.id, error)
            return error

    async def _probe(self, backend: Backend) -> str | None:
        timeout = httpx.Timeout(self.cfg.timeout_s)
        headers = {"authorization": f"Bearer {backend.cfg.api_key}"} if backend.cfg.api_key else None
        try:
            resp = await self.client.get(backend.cfg.url + self.cfg.path, timeout=timeout, headers=headers)
            if resp.status_code == 404 and self.cfg.path != "/v1/models":
                resp = await self.client.get(backend.cfg.url + "/v1/models", timeout=timeout, headers=headers)
        except httpx.HTTPError as exc:
            return _describe(exc)
        if resp.status_code >= 400:
            return f"health probe answered HTTP {resp.status_code}"
        return None


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
