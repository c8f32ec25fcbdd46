"""Active health checks: a dead backend stops receiving new work; a recovered one gets it back.

Probe: GET ``health.path`` (default /health); a 404 there falls back to GET /v1/models, which every
OpenAI-compatible server has. ``fail_threshold`` consecutive failures mark a backend DOWN; one success
marks it READY again. Draining/cordoned backends keep their state (an operator set it).
Passive signal: the proxy calls ``mark_failed`` on a connect error, which marks DOWN at once.
"""

from __future__ import annotations

import asyncio
import logging
import time

import httpx

from backends.registry import Backend, Registry
from config.settings import HealthConfig
from routing.types import BackendState

log = logging.getLogger("warmroute.health")

_OPERATOR_STATES = frozenset({BackendState.DRAINING, BackendState.CORDONED})


class HealthChecker:
    def __init__(self, registry: Registry, client: httpx.AsyncClient, cfg: HealthConfig) -> None:
        self.registry = registry
        self.client = client
        self.cfg = cfg

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.registry.backends.values()))

    async def run(self) -> None:
        """Forever: check every backend each ``interval_s``. Cancel to stop."""
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            await self.check_all()

    async def check(self, backend: Backend) -> None:
        error = await self._probe(backend)
        backend.last_checked = time.time()
        if error is None:
            self._mark_ok(backend)
        else:
            self.mark_failed(backend, error, threshold=self.cfg.fail_threshold)

    def mark_failed(self, backend: Backend, error: str, threshold: int = 1) -> None:
        backend.consecutive_failures += 1
        backend.last_error = error
        if backend.consecutive_failures >= threshold and backend.state not in _OPERATOR_STATES:
            if backend.state is not BackendState.DOWN:
                log.warning("backend %s is down: %s", backend.id, error)
            backend.state = BackendState.DOWN

    def _mark_ok(self, backend: Backend) -> None:
        backend.consecutive_failures = 0
        if backend.state not in _OPERATOR_STATES and backend.state is not BackendState.READY:
            log.info("backend %s is ready", backend.id)
            backend.state = BackendState.READY

    async def _probe(self, backend: Backend) -> str | None:
        timeout = httpx.Timeout(self.cfg.timeout_s)
        headers = {"authorization": f"Bearer {backend.cfg.api_key}"} if backend.cfg.api_key else None
        try:
            resp = await self.client.get(backend.cfg.url + self.cfg.path, timeout=timeout, headers=headers)
            if resp.status_code == 404 and self.cfg.path != "/v1/models":
                resp = await self.client.get(backend.cfg.url + "/v1/models", timeout=timeout, headers=headers)
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if resp.status_code >= 400:
            return f"health probe answered HTTP {resp.status_code}"
        return None
