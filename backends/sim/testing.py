"""Helpers for tests that drive a simulator in-process (no socket). ``SimServer`` is the one with a socket."""

from __future__ import annotations

import httpx

from backends.sim.app import create_sim_app
from backends.sim.config import SimConfig
from backends.sim.engine import Sleep


class SleepRecorder:
    """Stands in for ``asyncio.sleep``: records each modelled delay (already time-scaled), waits for none."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


def asgi_client(cfg: SimConfig, *, sleep: Sleep | None = None) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` wired to a fresh simulator app through ``ASGITransport``.

    ``ASGITransport`` buffers whole responses: use ``SimServer`` to observe streaming timing or disconnects.
    """
    app = create_sim_app(cfg, sleep=sleep)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sim")
