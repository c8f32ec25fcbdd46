"""The waiting room: a request for a model served on demand waits here until an engine for it is READY.

``Proxy.forward`` calls ``wrap`` and ``enter`` before routing. Nothing to wait for (the model is not on
demand, or its engine is ready) costs one lookup and returns at once. Otherwise:

- a non-streamed request just waits (the scheduler's ``wait_timeout_s`` bounds it);
- a streamed request (``"stream": true``) is answered ``200 text/event-stream`` at once and sent an SSE
  comment every ``keepalive_s`` (``: waiting for <backend> to start (12 s)``), so clients and proxies in
  between do not time out. Its head is gone then, so whatever the proxy sends next goes through the
  ``EarlyHeadSend`` that ``wrap`` made: the relay's own 200 head is dropped, and an error response (the
  start failed, the engine answered 4xx/5xx) becomes an SSE ``error`` event and ``[DONE]`` (on another
  route, that route's own stream end: Anthropic's ``event: error`` without ``[DONE]``).

A refusal (queue full, group held, failed start, wait timeout) is an ``EngineNotReady`` 503 with a
``Retry-After`` where one makes sense. The ``Claim`` returned is released by the proxy when the request is
finished: until then its engine is never stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Callable

from starlette.types import Message, Send

from backends.demand import Claim, EngineUnavailable, Pending
from backends.fleet import Fleet
from backends.ondemand import Phase, RejectWhy
from config.settings import OnDemandConfig
from gateway.context import RequestContext
from gateway.errors import NoHealthyBackend, UpstreamError, error_body
from gateway.relay import DONE, SSE, body
from gateway.shapes.base import OPENAI_ERRORS, ErrorShape

log = logging.getLogger("warmroute.waiting")

HOLD_HEADER = b"x-warmroute-hold"

_CODES = {
    RejectWhy.QUEUE_FULL: "on_demand_queue_full",
    RejectWhy.HELD: "engine_held",
    RejectWhy.START_FAILED: "engine_start_failed",
    RejectWhy.TIMEOUT: "engine_start_timeout",
}


class EngineNotReady(NoHealthyBackend):
    """503: no engine for the model could be made ready (the message says why)."""

    def __init__(self, message: str, code: str, retry_after_s: float | None) -> None:
        super().__init__(message)
        self.code = code
        self.retry_after_s = retry_after_s

    def headers(self) -> list[tuple[bytes, bytes]]:
        if self.retry_after_s is None:
            return []
        return [(b"retry-after", str(max(1, math.ceil(self.retry_after_s))).encode())]


def _trust_all(ctx: RequestContext) -> bool:
    return True


class WaitingRoom:
    def __init__(
        self, fleet: Fleet, cfg: OnDemandConfig, may_hold: Callable[[RequestContext], bool] = _trust_all
    ) -> None:
        assert fleet.demand is not None
        self.demand = fleet.demand
        self.fleet = fleet
        self.cfg = cfg
        #: Which requests may hold their engine with ``x-warmroute-hold`` (when ``cfg.hold_header`` is on).
        #: Until client keys exist every client is trusted; the auth layer replaces this with a key check.
        self.may_hold = may_hold

    def wrap(self, ctx: RequestContext, send: Send) -> Send:
        """The ``send`` the proxy uses from now on: for a stream that may wait, one that can answer early."""
        if ctx.model is None or not self.demand.serves(ctx.model):
            return send
        if ctx.body is None or ctx.body.get("stream") is not True:
            return send
        return EarlyHeadSend(send, ctx.shape.errors)

    async def enter(self, ctx: RequestContext, send: Send) -> Claim | None:
        """Wait for ``ctx.model``'s engine; ``send`` is what ``wrap`` returned. Returns the claim to release
        when the request is finished (None: nothing to wait for). Raises ``EngineNotReady``."""
        model = ctx.model
        if model is None or not self.demand.serves(model):
            return None
        pending = self.demand.request(model)
        try:
            if not pending.done() and isinstance(send, EarlyHeadSend):
                await self._keep_alive(pending, model, send)
            claim = await pending.claim()
        except EngineUnavailable as exc:
            raise EngineNotReady(exc.message, _CODES[exc.why], exc.retry_after_s) from None
        except asyncio.CancelledError:
            pending.abandon()  # the client left: out of the queue, or its admission given back
            raise
        self._maybe_hold(ctx, claim)
        return claim

    async def _keep_alive(self, pending: Pending, model: str, send: EarlyHeadSend) -> None:
        started = time.monotonic()
        await send.head()
        while True:
            backend = self._starting_for(model)
            await send.comment(f"waiting for {backend} to start ({time.monotonic() - started:.0f} s)")
            done, _ = await asyncio.wait({pending.future}, timeout=self.cfg.keepalive_s)
            if done:
                return

    def _starting_for(self, model: str) -> str:
        specs = self.demand.policy.serving(model)
        engines = self.demand.schedule.engines
        starting = [s.id for s in specs if engines[s.id].phase is not Phase.READY]
        return (starting or [s.id for s in specs])[0]

    def _maybe_hold(self, ctx: RequestContext, claim: Claim) -> None:
        if not self.cfg.hold_header:
            return
        value = ctx.first.get(HOLD_HEADER)
        if value is None or not self.may_hold(ctx):
            return
        try:
            seconds = float(value)
        except ValueError:
            log.warning("ignoring %s: %r is not a number of seconds", HOLD_HEADER.decode(), value)
            return
        if seconds > 0:
            seconds = min(seconds, self.cfg.max_hold_s)
            self.fleet.hold(claim.engine, seconds, f"{HOLD_HEADER.decode()} on a request for {ctx.model}")


class EarlyHeadSend:
    """``send`` for a stream that may answer its 200 SSE head while it waits (see the module docstring).
    Until ``head()`` is called it passes every message through."""

    def __init__(self, send: Send, errors: ErrorShape = OPENAI_ERRORS) -> None:
        self._send = send
        self._errors = errors  # the route's: how its stream ends with an error
        self._error: tuple[int, bytearray] | None = None  # an error response being turned into an SSE event
        self._early = self._head_seen = False
        self._started = False  # a head went through as it was (the answer is under way)

    async def head(self) -> None:
        """Answer the 200 SSE head now (once: a second call does nothing, nor one after a head went out)."""
        if self._early or self._started:
            return
        headers = [(b"content-type", SSE), (b"cache-control", b"no-cache")]
        self._early = True
        await self._send({"type": "http.response.start", "status": 200, "headers": headers})

    async def comment(self, text: str) -> None:
        await self._send(body(f": {text}\n\n".encode(), more=True))

    async def __call__(self, message: Message) -> None:
        if not self._early:
            if not self._started and message["type"] == "http.response.start":
                self._started = True
            await self._send(message)
            return
        if message["type"] == "http.response.start" and not self._head_seen:
            self._head_seen = True
            status = int(message["status"])
            content_type = dict(message.get("headers", [])).get(b"content-type", b"")
            if status != 200 or not content_type.startswith(SSE):
                self._error = (status, bytearray())
            return  # our own head went out already
        if self._error is not None and message["type"] == "http.response.body":
            self._error[1].extend(message.get("body", b""))
            if not message.get("more_body", False):
                await self._send(body(self._error_end(), more=False))
            return
        await self._send(message)

    def _error_end(self) -> bytes:
        """OpenAI's routes: the engine's error object (one line) in an error event, then ``[DONE]``; another
        shape's: its own stream end, saying what the engine answered."""
        if self._errors is OPENAI_ERRORS:
            return b"event: error\ndata: " + self._error_data() + b"\n\n" + DONE
        assert self._error is not None
        status, data = self._error
        text = data.decode(errors="replace")
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            text = json.loads(data)["error"]["message"]  # OpenAI's and Anthropic's error objects alike
        err = UpstreamError(f"HTTP {status}: {str(text)[:500]}")
        err.status = status
        return self._errors.stream_end(err)

    def _error_data(self) -> bytes:
        assert self._error is not None
        status, data = self._error
        with contextlib.suppress(ValueError):
            return json.dumps(json.loads(data), separators=(",", ":")).encode()  # one line: SSE framing
        text = data.decode(errors="replace")[:500] or f"HTTP {status}"
        return error_body(f"the engine answered HTTP {status}: {text}", "server_error", "upstream_error")
