"""The hot path: route one request, send it upstream, relay the answer chunk by chunk.

Pure ASGI (no Request/Response objects, no BaseHTTPMiddleware): the proxy owns the whole exchange so that

- a connect error, timeout or 5xx *before the first byte* is retried once on the next choice, unseen;
- a failure *after* bytes were sent ends an SSE stream with an error event and ``[DONE]``, never a hang;
- a client disconnect at any point (waiting for headers or mid-stream) cancels the upstream request;
- the in-flight lease is released in one ``finally``, whatever happened.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

from starlette.types import Message, Receive, Scope, Send

from backends.health import HealthChecker
from backends.registry import Lease, Registry
from config.settings import Settings
from gateway.errors import GatewayError, ModelNotFound, NoHealthyBackend, UpstreamError, UpstreamTimeout
from gateway.inbound import header
from gateway.metrics import Metrics
from gateway.state import AffinityStore
from gateway.upstream import (
    UpstreamConnectError,
    UpstreamPool,
    UpstreamProtocolError,
    UpstreamReadError,
    UpstreamResponse,
)
from routing.policies import Policy
from routing.types import BackendState, PinAction, Reason, RouteRequest

log = logging.getLogger("warmroute.proxy")

_SSE = b"text/event-stream"
_DONE = b"data: [DONE]\n\n"


@dataclass(slots=True)
class Exchange:
    """Per-request state shared by the relay and the disconnect watcher."""

    task: asyncio.Task[None]
    started_at: float
    client_gone: bool = False
    finished: bool = False  # the last body message is being sent; a disconnect now is normal
    lease: Lease | None = None
    upstream: UpstreamResponse | None = None  # closed in ``finally``: that is what cancels the engine's work
    outcome: str = "error"
    reason: Reason = Reason.NO_BACKEND
    first_byte_at: float | None = field(default=None)


@dataclass(frozen=True, slots=True)
class Outbound:
    """What to send upstream: the original bytes, plus routing inputs."""

    method: str
    path: str
    raw: bytes
    model: str | None
    key: str


class Proxy:
    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        store: AffinityStore,
        policy: Policy,
        health: HealthChecker,
        metrics: Metrics,
    ) -> None:
        self.registry = registry
        self.store = store
        self.policy = policy
        self.health = health
        self.metrics = metrics
        self.timeouts = settings.timeouts
        # The hot path's own HTTP/1.1 client: httpx costs ~1.4 ms CPU per request here, this ~0.02 ms.
        self.pool = UpstreamPool(
            connect_timeout=settings.timeouts.connect_s,
            max_connections_per_origin=settings.limits.max_connections,
        )

    async def aclose(self) -> None:
        await self.pool.aclose()

    async def forward(
        self, scope: Scope, receive: Receive, send: Send, out: Outbound, policy: Policy
    ) -> None:
        task = asyncio.current_task()
        assert task is not None
        ex = Exchange(task, time.monotonic())
        watcher = asyncio.create_task(_watch_disconnect(receive, ex))
        try:
            try:
                upstream = await self._open(scope, out, policy, ex)
            except GatewayError as err:
                ex.outcome = err.code
                ex.finished = True
                await send_error(send, err)
                return
            await self._relay(upstream, send, ex)
        except asyncio.CancelledError:
            if not ex.client_gone:
                raise
            task.uncancel()
            ex.outcome = "client_disconnect"
        finally:
            watcher.cancel()
            await self._finish(ex)

    async def _open(self, scope: Scope, out: Outbound, policy: Policy, ex: Exchange) -> UpstreamResponse:
        """Route and send; retry once on the next choice if the first backend fails before answering."""
        if out.model is not None and not self.registry.serves(out.model):
            raise ModelNotFound(
                f"model {out.model!r} is not served here; available: {', '.join(self.registry.models())}",
                param="model",
            )
        view = await self.store.view(out.key if policy.uses_affinity else None)
        candidates = self.registry.snapshot(out.model, view.conversations, view.in_flight)
        decision = policy.select(candidates, RouteRequest(out.key, view.pinned))
        if decision.backend is None:
            raise NoHealthyBackend(self._nothing_ready(out.model))
        backend = decision.backend
        if decision.pin is not PinAction.NONE:
            winner = await self.store.commit(out.key, decision)
            if winner != backend and self._routable(winner):
                backend = winner  # another replica claimed this conversation first
        self.metrics.decision(decision.reason)
        ex.reason = decision.reason
        result = await self._attempt(scope, out, backend, ex)
        if isinstance(result, UpstreamResponse) and result.status < 500:
            return result
        retry = policy.select(
            self.registry.snapshot(out.model, view.conversations, view.in_flight),
            RouteRequest(out.key, view.pinned, exclude=frozenset({backend})),
        )
        if retry.backend is None:
            if isinstance(result, UpstreamResponse):
                return result  # nobody else to ask: the engine's own 5xx is the most useful answer
            raise result
        await self._abandon(result, ex)
        self.metrics.decision(retry.reason)
        ex.reason = retry.reason
        result = await self._attempt(scope, out, retry.backend, ex)
        if isinstance(result, UpstreamResponse):
            return result
        raise result

    async def _attempt(
        self, scope: Scope, out: Outbound, backend_id: str, ex: Exchange
    ) -> UpstreamResponse | UpstreamError:
        backend = self.registry.backends[backend_id]
        ex.lease = self.registry.lease(backend_id)
        await self.store.started(backend_id)
        headers = _upstream_headers(scope, backend.cfg.api_key)
        try:
            async with asyncio.timeout(self.timeouts.first_byte_s):
                response = await self.pool.request(out.method, backend.cfg.url, out.path, headers, out.raw)
        except TimeoutError:
            self.metrics.upstream_outcome(backend_id, "timeout")
            return UpstreamTimeout(
                f"backend {backend_id} sent no response within {self.timeouts.first_byte_s}s"
            )
        except UpstreamConnectError as exc:
            self.health.mark_failed(backend, f"connect failed: {exc}")
            self.metrics.upstream_outcome(backend_id, "connect_error")
            return UpstreamError(f"backend {backend_id} is unreachable")
        except (UpstreamProtocolError, UpstreamReadError) as exc:
            self.metrics.upstream_outcome(backend_id, "error")
            return UpstreamError(f"backend {backend_id} failed before answering: {type(exc).__name__}")
        ex.upstream = response
        if response.status >= 500:
            self.metrics.upstream_outcome(backend_id, "http_5xx")
        return response

    async def _abandon(self, result: UpstreamResponse | UpstreamError, ex: Exchange) -> None:
        """Drop a failed first attempt before the retry: close its response, give its lease back."""
        if isinstance(result, UpstreamResponse):
            await result.aclose()
        ex.upstream = None
        await self._release(ex)

    async def _relay(self, upstream: UpstreamResponse, send: Send, ex: Exchange) -> None:
        content_type = upstream.header(b"content-type") or b"application/json"
        sse = content_type.startswith(_SSE)
        headers = [(b"content-type", content_type)]
        if sse:
            headers.append((b"cache-control", b"no-cache"))
        else:
            length = upstream.header(b"content-length")
            if length is not None:
                headers.append((b"content-length", length))
        assert ex.lease is not None
        headers.append((b"x-warmroute-backend", ex.lease.backend.id.encode()))
        headers.append((b"x-warmroute-route", ex.reason.value.encode()))
        await send({"type": "http.response.start", "status": upstream.status, "headers": headers})
        try:
            await self._pump(upstream, send, ex)
        except (UpstreamReadError, TimeoutError) as exc:
            ex.outcome = "mid_stream_error"
            log.warning("backend %s broke mid-response: %r", ex.lease.backend.id, exc)
            if not sse:
                raise UpstreamBroke(f"backend {ex.lease.backend.id} broke mid-response") from exc
            err = UpstreamTimeout if isinstance(exc, TimeoutError) else UpstreamError
            message = f"backend {ex.lease.backend.id} failed mid-stream ({type(exc).__name__})"
            ex.finished = True
            await send(_body(b"event: error\ndata: " + err(message).body() + b"\n\n" + _DONE, more=False))
            return
        ex.outcome = "ok" if upstream.status < 400 else f"http_{upstream.status // 100}xx"
        ex.finished = True
        await send(_body(b"", more=False))

    async def _pump(self, upstream: UpstreamResponse, send: Send, ex: Exchange) -> None:
        loop = asyncio.get_running_loop()
        deadline = ex.started_at - time.monotonic() + loop.time() + self.timeouts.request_s
        read_s = self.timeouts.read_s
        async with asyncio.timeout(min(deadline, loop.time() + read_s)) as budget:
            async for chunk in upstream.aiter_raw():
                if ex.first_byte_at is None:
                    ex.first_byte_at = time.monotonic()
                await send(_body(chunk, more=True))
                budget.reschedule(min(deadline, loop.time() + read_s))

    async def _finish(self, ex: Exchange) -> None:
        if ex.upstream is not None:
            await ex.upstream.aclose()  # unfinished body: closes the connection, and the engine stops
        lease = ex.lease
        if lease is None:
            return
        await self._release(ex)
        first_byte = None if ex.first_byte_at is None else ex.first_byte_at - ex.started_at
        self.metrics.finished(lease.backend.id, ex.outcome, time.monotonic() - ex.started_at, first_byte)

    async def _release(self, ex: Exchange) -> None:
        lease = ex.lease
        if lease is not None and not lease.released:
            lease.release()
            await self.store.finished(lease.backend.id)

    def _routable(self, backend_id: str) -> bool:
        b = self.registry.backends.get(backend_id)
        return b is not None and b.state is BackendState.READY

    def _nothing_ready(self, model: str | None) -> str:
        states = ", ".join(f"{b.id}={b.state.value}" for b in self.registry.for_model(model))
        what = f"model {model!r}" if model else "this request"
        return f"no healthy backend for {what} ({states or 'none configured'})"


class UpstreamBroke(Exception):
    """A non-streamed body broke after its headers were sent: the connection must be aborted."""


async def _watch_disconnect(receive: Receive, ex: Exchange) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not ex.finished:
                ex.client_gone = True
                ex.task.cancel()
            return


def _upstream_headers(scope: Scope, api_key: str | None) -> list[tuple[bytes, bytes]]:
    headers = [
        (b"content-type", b"application/json"),
        (b"accept", header(scope, b"accept") or b"*/*"),
        (b"accept-encoding", b"identity"),
    ]
    auth = f"Bearer {api_key}".encode() if api_key else header(scope, b"authorization")
    if auth:
        headers.append((b"authorization", auth))
    request_id = header(scope, b"x-request-id")
    if request_id:
        headers.append((b"x-request-id", request_id))
    return headers


def _body(data: bytes, more: bool) -> Message:
    return {"type": "http.response.body", "body": data, "more_body": more}


async def send_error(send: Send, err: GatewayError) -> None:
    body = err.body()
    await send(
        {
            "type": "http.response.start",
            "status": err.status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send(_body(body, more=False))
