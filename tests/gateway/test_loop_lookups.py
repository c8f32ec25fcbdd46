"""The request path looks the event loop up once per request. On Python 3.11 each ``get_running_loop()``,
``current_task()`` without a loop, ``create_task()`` and ``get_event_loop()`` is a ``getpid()`` system call;
a request through the proxy and the upstream pool made eleven. Counted here at the source: every call of
those that code in ``gateway`` makes, through the proxy, a real pool and an engine on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from backends.registry import Registry
from config.settings import load_settings
from gateway.context import RequestContext
from gateway.metrics import Metrics
from gateway.proxy import AdmitAll, Proxy
from gateway.shapes.table import CHAT
from gateway.state import MemoryAffinityStore
from gateway.upstream import UpstreamPool
from routing.policies.round_robin import RoundRobinPolicy
from routing.types import BackendState
from tools.bench_proxy import upstream_app

from upstreams import serve

pytestmark = pytest.mark.anyio
LOOKUPS = ("get_running_loop", "current_task", "create_task", "get_event_loop")
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(params=["asyncio", ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


def count_gateway_calls(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Each of ``LOOKUPS`` called from a ``gateway`` module, by name (other callers are not counted)."""
    counts: Counter[str] = Counter()

    def counted(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            given = name == "current_task" and (args or kwargs)  # ``current_task(loop)`` looks nothing up
            if not given and sys._getframe(1).f_globals.get("__name__", "").startswith("gateway."):
                counts[name] += 1
            return real(*args, **kwargs)

        return call

    for name in LOOKUPS:
        monkeypatch.setattr(asyncio, name, counted(name, getattr(asyncio, name)))
    return counts


async def test_a_request_through_the_proxy_and_its_pool_looks_the_loop_up_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with serve(upstream_app) as (url, _server):
        settings = load_settings(None, backends=[{"id": "e", "url": url, "models": ["m"]}])
        store = MemoryAffinityStore(settings.routing)
        registry = Registry(settings.backends, listener=store)
        registry.backends["e"].state = BackendState.READY
        pool = UpstreamPool(connect_timeout=5.0)
        proxy = Proxy(settings.timeouts, registry, store, AdmitAll(), Metrics(registry), pool)
        never = asyncio.Event()

        async def receive() -> dict[str, Any]:
            await never.wait()
            return {"type": "http.disconnect"}

        async def one() -> list[dict[str, Any]]:
            sent: list[dict[str, Any]] = []

            async def send(message: dict[str, Any]) -> None:
                sent.append(message)

            raw = json.dumps(BODY).encode()
            ctx = RequestContext(
                "POST", "/v1/chat/completions", raw, BODY, "m", "k", RoundRobinPolicy(), [], {}, CHAT
            )
            await proxy.forward(receive, send, ctx)
            return sent

        try:
            await one()  # opens the pool's connection (a connect looks the loop up, once per connection)
            counts = count_gateway_calls(monkeypatch)
            for _ in range(5):
                sent = await one()
                assert sent[0]["status"] == 200
            # The proxy's, once a request. Before: 11 (get_running_loop 8, current_task 2, create_task 1).
            assert counts == {"get_running_loop": 5}
            assert pool.connections(url) == 1  # every request on the one pooled connection
        finally:
            await pool.aclose()
