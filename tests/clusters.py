"""A gateway in front of fake engines, as one object for tests (the ``cluster`` fixture builds it)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from backends.changes import Changes
from config.settings import Settings
from gateway.app import Gateway, create_app

from upstreams import AnnouncedServer, FakeEngine


@dataclass
class Cluster:
    url: str
    engines: dict[str, FakeEngine]
    engine_servers: dict[str, Any]
    gateway: Gateway
    loop: asyncio.AbstractEventLoop  # the gateway's own (its server's thread)

    def wait_for(self, predicate: Callable[[], object], what: str, within: float = 10.0) -> None:
        """Wait for a state the gateway announces (backend states, additions, removals, pins): the
        predicate runs on the gateway's loop, re-checked after each change (``Gateway.changes``)."""
        wait_on_loop(self.gateway, self.loop, predicate, what, within)

    def in_flight(self) -> int:
        return self.gateway.registry.total_in_flight()

    def wait_idle(self, timeout: float = 10.0) -> None:
        """Wait until the gateway and every engine have let go of every request."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.in_flight() == 0 and all(e.active == 0 for e in self.engines.values()):
                return
            time.sleep(0.01)
        raise AssertionError(
            f"not idle: gateway in_flight={self.in_flight()}, "
            f"engines={ {n: e.active for n, e in self.engines.items()} }"
        )

    def stop_engine(self, name: str) -> None:
        """Close engine ``name``'s port and wait until connecting to it is refused."""
        self.engine_servers[name].should_exit = True
        url = self.gateway.registry.backends[name].cfg.url
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                httpx.get(url + "/health", timeout=0.5)
            except httpx.ConnectError:
                return
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        raise AssertionError(f"engine {name} still accepts connections")


ClusterFactory = Callable[..., Cluster]


def loop_of(server: uvicorn.Server) -> asyncio.AbstractEventLoop:
    """The event loop a started uvicorn server runs on (in its own thread)."""
    return server.servers[0].get_loop()


def wait_on_loop(
    gw: Gateway, loop: asyncio.AbstractEventLoop, predicate: Callable[[], object], what: str, within: float
) -> None:
    """From the test's thread: wait on ``gw.changes`` on the gateway's loop until ``predicate()``."""
    wait_on_changes(gw.changes, loop, predicate, what, within)


def wait_on_changes(
    changes: Changes,
    loop: asyncio.AbstractEventLoop,
    predicate: Callable[[], object],
    what: str,
    within: float,
) -> None:
    """From the test's thread: wait on ``changes`` (announced on ``loop``) until ``predicate()``, re-checked
    on that loop after each change."""
    done = asyncio.run_coroutine_threadsafe(changes.wait(predicate, within), loop)
    try:
        done.result(within + 5.0)
    except TimeoutError:
        done.cancel()
        pytest.fail(f"{what}: not reached within {within} s")


@contextlib.asynccontextmanager
async def served_gateway(
    settings: Settings, within_s: float, modules: tuple[object, ...] = ()
) -> AsyncIterator[tuple[str, Gateway]]:
    """A gateway under uvicorn on the test's own event loop (so the test can watch its controllers); yields
    its URL and the ``Gateway``. ``within_s`` bounds the start-up (managed engines' canaries included);
    ``modules``: further request-path modules (gateway/phases.py)."""
    app = create_app(settings, modules=modules)
    gw: Gateway = app.state.gateway
    server = AnnouncedServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.create_task(server.serve())
    up = asyncio.create_task(asyncio.to_thread(server.up.wait, within_s))
    await asyncio.wait({task, up}, return_when=asyncio.FIRST_COMPLETED)
    server.up.set()  # releases the waiting thread if serve() ended before its start-up
    await up
    if task.done():
        task.result()  # start-up raised: so does the test
    if not server.started:
        raise RuntimeError(f"the gateway did not start within {within_s} s")
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", gw
    finally:
        server.should_exit = True
        await task
