"""The server protocol's keep-alive timer: one stays armed on a busy connection (no timer per request), and an
idle connection still closes ``timeout_keep_alive`` after its last response, as uvicorn's does.

The protocol runs on a loop stand-in whose clock the test moves; "data came" is the hook every received read
calls (``_unset_keepalive_if_required``), "a response completed" is uvicorn's ``on_response_complete``."""

from __future__ import annotations

from typing import Any

import uvicorn
from loop_clock import LoopClock
from uvicorn.server import ServerState

from gateway.server_protocol import GatewayHttpProtocol


class _Transport:
    def __init__(self) -> None:
        self.closed_at: float | None = None
        self.clock: LoopClock | None = None

    def is_closing(self) -> bool:
        return self.closed_at is not None

    def close(self) -> None:
        assert self.clock is not None
        if self.closed_at is None:
            self.closed_at = self.clock.now


class _Flow:
    def resume_reading(self) -> None:
        return None

    def resume_writing(self) -> None:
        return None


async def _app(scope: Any, receive: Any, send: Any) -> None:
    return None


def _connection(keep_alive_s: int = 5) -> tuple[GatewayHttpProtocol, LoopClock, _Transport]:
    config = uvicorn.Config(_app, timeout_keep_alive=keep_alive_s)
    config.load()
    clock, transport = LoopClock(), _Transport()
    transport.clock = clock
    proto = GatewayHttpProtocol(config, ServerState(), {}, _loop=clock)
    proto.transport = transport  # type: ignore[assignment]
    proto.flow = _Flow()  # type: ignore[assignment]
    return proto, clock, transport


def test_an_idle_connection_closes_keep_alive_seconds_after_its_last_response() -> None:
    proto, clock, transport = _connection()
    clock.run_until(1.0)
    proto.on_response_complete()
    clock.run_until(5.99)
    assert transport.closed_at is None
    clock.run_until(100.0)
    assert transport.closed_at == 6.0


def test_a_busy_connection_keeps_one_timer_and_closes_after_its_last_idle_spell() -> None:
    proto, clock, transport = _connection()
    for n in range(20):  # a request every 0.5 s, each answered in 0.1 s
        clock.run_until(0.5 * n)
        proto._unset_keepalive_if_required()  # its bytes came
        clock.run_until(0.5 * n + 0.1)
        proto.on_response_complete()
    assert len(clock.handles) <= 4  # not one per request: re-armed at most once per keep-alive period
    last = 0.5 * 19 + 0.1
    clock.run_until(last + 4.99)
    assert transport.closed_at is None
    clock.run_until(100.0)
    assert transport.closed_at == last + 5.0


def test_a_connection_busy_when_the_timer_fires_is_not_closed_however_long_its_request_takes() -> None:
    proto, clock, transport = _connection()
    proto.on_response_complete()
    clock.run_until(1.0)
    proto._unset_keepalive_if_required()  # a request that runs a minute (a long stream)
    clock.run_until(61.0)
    assert transport.closed_at is None and clock.armed() == []  # the timer went: nothing to time
    proto.on_response_complete()
    assert clock.armed() == [66.0]
    clock.run_until(100.0)
    assert transport.closed_at == 66.0


def test_a_lost_connection_cancels_its_keep_alive_timer() -> None:
    proto, clock, _ = _connection()
    proto.on_response_complete()
    proto.connection_lost(None)
    assert clock.armed() == []
