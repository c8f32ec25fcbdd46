"""One ready backend behind a ``Proxy`` on the in-memory transport, and clients forwarded through it as
tasks: what proxy-module tests (admission, quotas) build their rig from.

    rig = OneBackend(quotas={...})
    rig.proxy = rig.build_proxy(module)  # the metrics module first, then the module under test
    client = ProxyClient(rig, ctx)  # rig.proxy forwards it
    await client.sent_body(lambda body: body.startswith(b": waiting"))  # announced, not polled
    status, headers, body = await client.answer()
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from backends.registry import Registry
from config.settings import load_settings
from gateway.context import RequestContext
from gateway.metrics import Metrics
from gateway.proxy import AdmitAll, Proxy
from gateway.state import MemoryAffinityStore
from routing.types import BackendState

from transports import FakeTransport


class OneBackend:
    """Backend ``a`` (``http://a``, model ``m``), ready; ``settings`` are the rest of the gateway's."""

    def __init__(self, **settings: Any) -> None:
        self.settings = load_settings(
            None, backends=[{"id": "a", "url": "http://a", "models": ["m"]}], **settings
        )
        self.affinity = MemoryAffinityStore(self.settings.routing)
        self.registry = Registry(self.settings.backends, listener=self.affinity)
        self.registry.backends["a"].state = BackendState.READY
        self.metrics = Metrics(self.registry)
        self.fake = FakeTransport()

    def build_proxy(self, *modules: Any) -> Proxy:
        """The proxy over this backend, its modules the metrics and then ``modules`` in order."""
        return Proxy(
            self.settings.timeouts,
            self.registry,
            self.affinity,
            AdmitAll(),
            self.metrics,
            self.fake,
            (self.metrics, *modules),
        )

    def sample(self, name: str, **labels: str) -> float:
        """A metric's exact value; 0 where the series was never written."""
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


class Rigged(Protocol):
    proxy: Proxy


class ProxyClient:
    """One request forwarded by ``rig.proxy`` as a task: the ASGI messages the proxy sent, and ``leave`` to
    make the client disconnect."""

    def __init__(self, rig: Rigged, ctx: RequestContext) -> None:
        self.sent: list[dict[str, Any]] = []
        self.leave = asyncio.Event()
        self._more = asyncio.Event()
        self.task = asyncio.create_task(rig.proxy.forward(self._receive, self._send, ctx))

    async def _receive(self) -> dict[str, Any]:
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        self._more.set()

    async def sent_body(self, match: Callable[[bytes], bool] = bool) -> None:
        """Return once a body message whose bytes ``match`` accepts was sent (by default: any with bytes)."""
        while not any(m["type"] == "http.response.body" and match(m.get("body", b"")) for m in self.sent):
            self._more.clear()
            await self._more.wait()

    async def answer(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """The status, the headers in order, and the whole body, once the request is finished."""
        await self.task
        head = self.sent[0]
        return head["status"], list(head["headers"]), b"".join(m.get("body", b"") for m in self.sent[1:])
