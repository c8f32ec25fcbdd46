"""Shared fixtures: fake engines and a real gateway, each served by uvicorn on 127.0.0.1."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from config.settings import load_settings
from gateway.app import Gateway, create_app

from upstreams import FakeEngine, serve


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


ClusterFactory = Callable[..., Cluster]


@pytest.fixture
def cluster() -> Iterator[ClusterFactory]:
    """``cluster(["a", "b"], routing={...}, ...)`` starts fake engines and a gateway in front of them."""
    stack = contextlib.ExitStack()

    def make(
        names: list[str] | None = None,
        engines: list[FakeEngine] | None = None,
        **overrides: Any,
    ) -> Cluster:
        fakes = engines or [FakeEngine(n) for n in (names or ["a", "b"])]
        urls: dict[str, str] = {}
        servers: dict[str, Any] = {}
        for fake in fakes:
            urls[fake.name], servers[fake.name] = stack.enter_context(serve(fake.app()))
        backends = [{"id": f.name, "url": urls[f.name], "models": list(f.models)} for f in fakes]
        overrides.setdefault("health", {"interval_s": 0.2, "timeout_s": 1, "fail_threshold": 1})
        settings = load_settings(None, backends=backends, **overrides)
        app = create_app(settings)
        url, _server = stack.enter_context(serve(app))
        return Cluster(url, {f.name: f for f in fakes}, servers, app.state.gateway)

    with stack:
        yield make


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
