"""``GatewayServer``: between ticks its main loop sleeps; told to stop, it wakes at once."""

from __future__ import annotations

import asyncio

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

import gateway.server
from gateway.server import GatewayServer

pytestmark = pytest.mark.anyio


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    raise AssertionError("no request is sent")


async def test_a_stop_wakes_the_idle_main_loop_without_waiting_for_its_tick(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gateway.server, "TICK_S", 3600.0)  # a tick would never come within the test
    config = uvicorn.Config(_app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
    server = GatewayServer(config)
    ticks: list[int] = []
    ticked = asyncio.Event()
    tick = server.on_tick

    async def counted(counter: int) -> bool:
        ticks.append(counter)
        ticked.set()
        return await tick(counter)

    server.on_tick = counted  # type: ignore[method-assign]
    serving = asyncio.create_task(server.serve())
    await asyncio.wait_for(ticked.wait(), 60)  # the main loop's first tick: the server is up
    server.should_exit = True
    await asyncio.wait_for(serving, 60)
    # The stop woke the loop for one more tick (no hour-long wait); each tick is uvicorn's once-a-second
    # one (a multiple of 10: the Date header is refreshed).
    assert ticks == [0, 10]
    assert server.server_state.default_headers[0][0] == b"date"
