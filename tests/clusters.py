"""A gateway in front of fake engines, as one object for tests (the ``cluster`` fixture builds it)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from gateway.app import Gateway

from upstreams import FakeEngine


@dataclass
class Cluster:
    url: str
    engines: dict[str, FakeEngine]
    engine_servers: dict[str, Any]
    gateway: Gateway

    def in_flight(self) -> int:
        return self.gateway.registry.total_in_flight()

    def wait_idle(self, timeout: float = 5.0) -> None:
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
        deadline = time.monotonic() + 5
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
