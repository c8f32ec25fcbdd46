"""Quotas per client key: requests and tokens per window, requests in flight (an ``Admission`` phase module).

Runs first among the admission modules, before routing: a request over its key's quota is answered 429 at
once (no on-demand engine is woken for it, it waits in no queue). The limits are the key's entry in
``quotas.keys``; a request without a client key, or of a key not listed, is not looked at (no cost).

- Admitted: the window counts it, the key's in-flight count goes up, and its answer's head carries the
  rate-limit headers of the route's API for the limits set (``ApiShape.ratelimit``: OpenAI's
  ``x-ratelimit-*``, or Anthropic's ``anthropic-ratelimit-*`` on ``/v1/messages``), in place of any the
  engine sent of either family: a client reads one set, the gateway's.
- Refused: ``QuotaExceeded`` (429, code ``rate_limit_exceeded``, type ``requests``/``tokens``/``concurrent``)
  with ``Retry-After`` (seconds until the window closes; 1 for a concurrency refusal) and the same headers,
  in the route's error shape (the proxy renders it with ``ctx.shape.errors``).
- Finished, however it ended (answered, failed, client gone): the claim is released in the proxy's
  ``finally``, after the observers, so the usage is known: in-flight down, tokens charged.

The state is this process's (``MemoryQuotas``) or shared through Redis (gateway/redis_quotas.py, one round
trip before routing and one after the answer). Redis unreachable: the request is admitted unchecked (fail
open), counted as ``unchecked`` and logged at most every 30 s: an outage of shared state never refuses work.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

from starlette.types import Message, Send

from config.settings import KeyQuota, QuotasConfig
from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.metrics import QuotaMetrics
from gateway.quota_windows import (
    RATELIMIT_PREFIXES,
    Exhausted,
    Limits,
    MemoryQuotas,
    RateLimitStyle,
    Verdict,
    reset_text,
)
from gateway.redis_quotas import QuotaUnavailable
from gateway.throttle import LogThrottle

log = logging.getLogger("warmroute.quotas")

ADMITTED = "admitted"
UNCHECKED = "unchecked"  # the shared state was unreachable: admitted without a quota (fail open)


class QuotaStore(Protocol):
    async def admit(self, key: str, limits: Limits) -> Verdict: ...

    async def state(self, key: str, limits: Limits) -> Verdict: ...

    def finish(self, key: str, limits: Limits, tokens: int) -> None: ...


class LocalQuotas:
    """``MemoryQuotas`` on a clock (one process)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.windows = MemoryQuotas()
        self.clock = clock

    async def admit(self, key: str, limits: Limits) -> Verdict:
        return self.windows.admit(key, limits, self.clock())

    async def state(self, key: str, limits: Limits) -> Verdict:
        return self.windows.state(key, limits, self.clock())

    def finish(self, key: str, limits: Limits, tokens: int) -> None:
        self.windows.finish(key, limits, tokens, self.clock())


class QuotaExceeded(GatewayError):
    status = 429
    code = "rate_limit_exceeded"

    def __init__(
        self,
        client: str,
        verdict: Verdict,
        style: RateLimitStyle = RateLimitStyle.OPENAI,
        wall_now: float = 0.0,
    ) -> None:
        refused = verdict.refused
        assert refused is not None
        limits = verdict.limits
        if refused is Exhausted.CONCURRENT:
            what = f"requests in flight: limit {limits.concurrent}, in flight {verdict.in_flight}"
            wait = "when one of them finishes"
        else:
            limit, used = (
                (limits.requests, verdict.requests)
                if refused is Exhausted.REQUESTS
                else (limits.tokens, verdict.tokens)
            )
            what = f"{refused.value} per {limits.window_s:g} s: limit {limit}, used {used}"
            wait = f"in {reset_text(verdict.reset_s)}"
        super().__init__(f"Rate limit reached for client key {client!r} on {what}. Please try again {wait}.")
        self.type = refused.value
        self.verdict = verdict
        self.style, self.wall_now = style, wall_now

    def headers(self) -> list[tuple[bytes, bytes]]:
        retry = (b"retry-after", str(self.verdict.retry_after_s()).encode())
        return [retry, *self.verdict.headers(self.style, self.wall_now)]


class QuotaSend:
    """The client's ``send``, putting the admitted request's rate-limit headers on its response head in
    place of the engine's own (``x-ratelimit-*``, ``anthropic-ratelimit-*``): each name once, ours."""

    __slots__ = ("extra", "send")

    def __init__(self, send: Send) -> None:
        self.send = send
        self.extra: list[tuple[bytes, bytes]] = []

    async def __call__(self, message: Message) -> None:
        if self.extra and message["type"] == "http.response.start":
            kept = [h for h in message.get("headers", ()) if not h[0].lower().startswith(RATELIMIT_PREFIXES)]
            message = {**message, "headers": [*kept, *self.extra]}
        await self.send(message)


class QuotaClaim:
    """One admitted request's place in its key's quota; ``release`` (once) charges its tokens."""

    __slots__ = ("_ctx", "_key", "_limits", "_owner")

    def __init__(self, owner: Quotas, key: str, limits: Limits, ctx: RequestContext) -> None:
        self._owner: Quotas | None = owner
        self._key, self._limits, self._ctx = key, limits, ctx

    def release(self) -> None:
        owner, self._owner = self._owner, None
        if owner is None:
            return
        try:
            tokens = charged(self._ctx)
        except Exception:  # a defect reading the usage must not keep the request in flight
            log.exception("quotas: reading a finished request's usage failed")
            tokens = 0
        owner.store.finish(self._key, self._limits, tokens)


class Quotas:
    def __init__(
        self,
        cfg: QuotasConfig,
        store: QuotaStore,
        metrics: QuotaMetrics,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.store = store
        self.metrics = metrics
        self.wall = wall  # dates Anthropic's absolute reset instants
        self.limits = {name: limits_of(q, cfg.window_s) for name, q in cfg.keys.items()}
        self._quiet = LogThrottle(30.0)

    def wrap(self, ctx: RequestContext, send: Send) -> Send:
        return send if ctx.client not in self.limits else QuotaSend(send)

    async def enter(self, ctx: RequestContext, send: Send) -> QuotaClaim | None:
        key = ctx.client
        limits = None if key is None else self.limits.get(key)
        if key is None or limits is None:
            return None
        try:
            verdict = await self.store.admit(key, limits)
        except QuotaUnavailable as exc:
            self.unavailable(str(exc))
            self.metrics.counted(key, UNCHECKED)
            return None
        style = ctx.shape.ratelimit
        if verdict.refused is not None:
            self.metrics.counted(key, verdict.refused.value)
            raise QuotaExceeded(key, verdict, style, self.wall())
        self.metrics.counted(key, ADMITTED)
        if isinstance(send, QuotaSend):
            send.extra = verdict.headers(style, self.wall())
        return QuotaClaim(self, key, limits, ctx)

    def unavailable(self, why: str) -> None:
        """The shared quota state failed a round trip: count it, log it (at most every 30 s)."""
        self.metrics.store_failures += 1
        count = self._quiet.due(time.monotonic())
        if count:
            log.warning("quotas: shared state unavailable (%s); admitted unchecked (%d times)", why, count)

    async def status(self) -> dict[str, Any]:
        """Per key: its limits, its window now (read-only) and its counts (the admin API)."""
        keys: dict[str, Any] = {}
        for name, limits in sorted(self.limits.items()):
            entry: dict[str, Any] = {
                "requests_per_window": limits.requests,
                "tokens_per_window": limits.tokens,
                "concurrent": limits.concurrent,
                "counts": self.metrics.of(name),
            }
            try:
                now = await self.store.state(name, limits)
            except QuotaUnavailable as exc:
                entry["error"] = str(exc)
            else:
                entry |= {
                    "requests": now.requests,
                    "tokens": now.tokens,
                    "in_flight": now.in_flight,
                    "reset_s": round(now.reset_s, 3),
                }
            keys[name] = entry
        return {"window_s": self.cfg.window_s, "keys": keys}


def limits_of(q: KeyQuota, window_s: float) -> Limits:
    return Limits(q.requests_per_window, q.tokens_per_window, q.concurrent, window_s)


def charged(ctx: RequestContext) -> int:
    """A finished request's tokens: prompt + completion from its answer's usage; an answer without usage
    (a stream not asked to include it) is charged its prompt, estimated as bytes / 4; no answer, or a
    refusal (4xx/5xx), nothing."""
    usage = None if ctx.attempt is None else ctx.attempt.usage
    if usage is None and ctx.tap is not None:
        usage = ctx.tap.usage(ctx.shape.usage)
    if usage is not None:
        return usage.prompt_tokens + usage.completion_tokens
    if ctx.upstream is not None and ctx.upstream.status < 400:
        return len(ctx.raw) // 4
    return 0
