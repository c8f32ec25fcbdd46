"""The hot path, as named phases around one ``RequestContext``:

    admission -> route -> (seat -> prepare -> send) per attempt, at most two -> relay -> finish

Features take part as modules (gateway/phases.py): one ordered tuple given to the constructor, sorted by
phase once; nothing is attached afterwards (``__slots__``).

- admission: the modules' ``Admission`` (a request for an on-demand engine waits for it);
- route: the route filters' ineligible backends, the route inputs' plan (or a snapshot of the candidates),
  the pure policy's ``Decision``, the pin committed to the store under ``ctx.affinity_key``;
- seat: the attempt's lease on the backend chosen is taken (routing's load counts it from now), then the
  ``BackendAdmission`` modules: the attempt waits for room there (per attempt; released when the attempt is
  abandoned or the request finished);
- prepare: the ``PrepareStep`` modules shape the attempt's ``Draft`` for the chosen backend (per attempt, from
  the original body; untouched bodies go upstream as the client's own bytes);
- send: one upstream attempt, transport errors mapped here and nowhere else. A connect error, timeout or 5xx
  *before the first byte* is retried once on the next choice, unseen by the client;
- admission: a chosen backend must ``admit`` the request (its circuit breaker: when half-open only one
  trial goes); a refusal routes to the next choice. Every attempt's outcome feeds the breaker (connect
  error, timeout, broken before or during the answer: failure; any other answer, 4xx included: success);
  a 5xx answer is judged with the request's other attempt (gateway/blame.py), so that a request every
  engine fails is held against none of them;
- relay: gateway/exchange.py's ``Relay``, the one relay: the response through the attempt's body filters,
  a follow-up exchange on the same lease where a filter asks for one;
- finish: the upstream response closed (that cancels the engine's work), the request counted, the
  observers told, the lease released: in one ``finally``, whatever happened. A client disconnect at any point
  cancels the request.

Pure ASGI: no Request/Response objects, no BaseHTTPMiddleware.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Protocol

from starlette.types import Receive, Send

from backends.registry import Lease, Registry
from config.settings import TimeoutConfig
from gateway.blame import OutcomeFeed, settle
from gateway.context import Attempt, Draft, Release, RequestContext
from gateway.errors import (
    GatewayError,
    ModelNotFound,
    NoHealthyBackend,
    UpstreamBusy,
    UpstreamError,
    UpstreamTimeout,
)
from gateway.exchange import Relay, RelayLimits, answered, outcome_of
from gateway.metrics import Metrics
from gateway.observe import Observation
from gateway.outcomes import NO_BACKEND_LABEL, AttemptOutcome, RequestOutcome
from gateway.phases import Phases
from gateway.relay import Deadline, send_error, upstream_headers
from gateway.shapes.base import ErrorShape
from gateway.state import AffinityStore, StoreView
from gateway.transport import (
    TransportResponse,
    UpstreamConnectError,
    UpstreamPoolTimeout,
    UpstreamTransport,
    UpstreamTransportError,
)
from routing.types import BackendState, Decision, PinAction, Reason, RouteRequest

__all__ = ["AdmitAll", "Proxy", "RequestFeed", "upstream_headers"]

log = logging.getLogger("warmroute.proxy")

Sent = TransportResponse | UpstreamError
#: No pin, no counts: with one eligible backend there is nothing to compare (``Proxy._view``); in-flight
#: counts fall back to this process's own.
_NOTHING_TO_COMPARE = StoreView(None, {}, None)
#: Decisions that place a new conversation: the backend's ``placed_at`` is set as it is decided.
_NEW_CONVERSATION = frozenset({Reason.NEW_CHEAPEST, Reason.NEW_LEAST_LOADED})
# Members compared or counted once per request: on Python 3.11 every ``PinAction.X`` / ``AttemptOutcome.X``
# is a class attribute load through ``EnumType.__getattr__``'s slow hook (~0.25 us each).
_NO_PIN = PinAction.NONE
_OK, _HTTP_5XX = AttemptOutcome.OK, AttemptOutcome.HTTP_5XX


class RequestFeed(OutcomeFeed, Protocol):
    """The backends' lifecycles as the proxy sees them (``backends.fleet.Fleet``). No I/O, never blocks."""

    def admit(self, backend_id: str) -> bool: ...

    def unreachable(self, backend_id: str, error: str) -> None: ...


class AdmitAll:
    """A feed for a proxy without lifecycles (benchmarks, phase tests): admits all, records nothing."""

    def admit(self, backend_id: str) -> bool:
        return True

    def outcome(self, backend_id: str, ok: bool) -> None:
        return None

    def answer_failed(self, backend_id: str, client: str) -> None:
        return None

    def abstain(self, backend_id: str) -> None:
        return None

    def unreachable(self, backend_id: str, error: str) -> None:
        return None


class Proxy:
    __slots__ = (
        "_holds",
        "feed",
        "metrics",
        "phases",
        "registry",
        "relay",
        "store",
        "timeouts",
        "transport",
    )

    def __init__(
        self,
        timeouts: TimeoutConfig,
        registry: Registry,
        store: AffinityStore,
        feed: RequestFeed,
        metrics: Metrics,
        transport: UpstreamTransport,
        modules: Sequence[object] = (),
        *,
        hide_engine_errors: bool = False,
        limits: RelayLimits | None = None,
    ) -> None:
        self.registry = registry
        self.store = store
        # A commit that is a round trip holds the decision's count meanwhile (``_hold``); a store that says it
        # commits in place (the memory store) costs nothing. A store that does not say holds.
        self._holds: bool = getattr(store, "commit_is_round_trip", True)
        self.feed = feed
        self.metrics = metrics
        self.timeouts = timeouts
        self.transport = transport
        self.phases = phases = Phases.of(modules)  # per phase, in module order: sorted once, here
        self.relay = Relay(
            timeouts,
            transport,
            feed,
            phases.body_filters,
            tap=bool(phases.observers),
            hide_engine_errors=hide_engine_errors,
            limits=limits,
        )

    async def forward(self, receive: Receive, send: Send, ctx: RequestContext) -> None:
        # The loop looked up once: on Python 3.11 each ``get_running_loop()``, ``current_task()`` without a
        # loop and ``asyncio.create_task()`` is a ``getpid()`` system call. Later phases: ``task.get_loop()``.
        loop = asyncio.get_running_loop()
        ctx.task = task = asyncio.current_task(loop)
        assert task is not None
        watcher = loop.create_task(_watch_disconnect(receive, ctx))
        claims: list[Release] = []  # admission's: an on-demand engine is not stopped before this finishes
        try:
            try:
                for admission in self.phases.admission:
                    send = admission.wrap(ctx, send)
                    claim = await admission.enter(ctx, send)
                    if claim is not None:
                        claims.append(claim)
                upstream = await self._open(ctx, send)
            except GatewayError as err:
                ctx.outcome = outcome_of(err)
                ctx.finishing = ctx.responded = True
                await send_error(send, err, ctx.shape.errors)
                return
            await self.relay.answer(ctx, upstream, send)
        except asyncio.CancelledError:
            if not ctx.client_gone:
                raise
            task.uncancel()
            ctx.outcome = _after_hang_up(ctx)
        except Exception as exc:  # a defect of ours: one log entry with the trace, and no hang
            log.exception("unexpected error proxying %s %s", ctx.method, ctx.path, exc_info=exc)
            if ctx.responded:
                raise  # the head is gone: the server closes the connection
            ctx.outcome = RequestOutcome.UPSTREAM_ERROR
            ctx.finishing = True
            internal = GatewayError("internal error in the gateway; see its log")
            await send_error(send, internal, ctx.shape.errors)
        finally:
            watcher.cancel()
            await self._finish(ctx)
            for claim in claims:
                claim.release()

    async def reject(self, send: Send, err: GatewayError, errors: ErrorShape) -> None:
        """Answer a request refused before routing (bad input), in its route's error shape, and count it."""
        self.metrics.request(NO_BACKEND_LABEL, outcome_of(err), 0.0, None)
        await send_error(send, err, errors)

    # -- route ----------------------------------------------------------------------------------------

    async def _open(self, ctx: RequestContext, send: Send) -> TransportResponse:
        """Route, prepare, send; once more on the next choice if the first backend fails before answering."""
        if ctx.model is not None and not self.registry.serves(ctx.model):
            available = ", ".join(self.registry.models())
            raise ModelNotFound(
                f"model {ctx.model!r} is not served here; available: {available}", param="model"
            )
        for rule in self.phases.route_filters:
            ctx.ineligible |= rule.ineligible(ctx)
        if self.phases.route_inputs is not None:
            self.phases.route_inputs.plan(ctx)  # may set ctx.route_key (identical heads told apart)
        key = ctx.affinity_key  # fixed from here on; a property is a call, read once
        view = await self._view(ctx, key)
        ctx.pinned = view.pinned
        backend, refused = await self._choose(ctx, key, view, frozenset())
        if backend is None:
            raise NoHealthyBackend(self._nothing_ready(ctx.model))
        await self._seat(ctx, backend, send)
        result = await self._attempt(ctx, backend)
        if not isinstance(result, UpstreamError) and result.status < 500:
            return result
        retry, _ = await self._choose(ctx, key, view, refused | {backend})
        if retry is None:
            settle(self.feed, ctx.requester, [(backend, _status(result))], f"{ctx.method} {ctx.path}")
            if isinstance(result, UpstreamError):
                raise result
            return result  # nobody else to ask: the engine's own 5xx is the most useful answer
        await self._abandon(ctx, result)
        await self._seat(ctx, retry, send)
        second = await self._attempt(ctx, retry)
        attempts = [(backend, _status(result)), (retry, _status(second))]
        settle(self.feed, ctx.requester, attempts, f"{ctx.method} {ctx.path}")
        if isinstance(second, UpstreamError):
            raise second
        return second

    async def _view(self, ctx: RequestContext, key: str) -> StoreView:
        """The store's pin and per-backend counts, or none where they decide nothing: a policy that keeps no
        pins, with one eligible backend left (a stored response's owner: gateway/ownership.py). With Redis
        that is one round trip fewer before the request is sent."""
        policy = ctx.policy
        if not policy.uses_affinity and ctx.ineligible:
            eligible = [b for b in self.registry.for_model(ctx.model) if b.id not in ctx.ineligible]
            if len(eligible) <= 1:
                return _NOTHING_TO_COMPARE
        return await self.store.view(key if policy.uses_affinity else None)

    async def _choose(
        self, ctx: RequestContext, key: str, view: StoreView, exclude: frozenset[str]
    ) -> tuple[str | None, frozenset[str]]:
        """The routed backend that admits the request (and those that refused it), or None. ``key``: the
        request's ``affinity_key``."""
        while True:
            decision = self._route(ctx, key, view, exclude)
            if decision.backend is None:
                return None, exclude
            held = None
            if self._holds and decision.pin is not _NO_PIN:
                held = self._hold(ctx, decision.backend)
            try:
                backend = await self._commit(ctx, key, decision)
            finally:
                if held is not None:
                    held.release()  # no await before the seat's lease: the count passes straight to it
            if self.feed.admit(backend):
                return backend, exclude
            exclude = exclude | {backend}  # its breaker is half-open and its one trial is taken

    def _route(self, ctx: RequestContext, key: str, view: StoreView, exclude: frozenset[str]) -> Decision:
        inputs = self.phases.route_inputs if ctx.route is not None else None  # ttft: gateway/learning.py
        if inputs is None:
            conversations = view.conversations
            request = RouteRequest(key, ctx.pinned, exclude)
        else:
            conversations, request = inputs.conversations(), inputs.request(ctx, ctx.pinned, exclude)
        now = time.monotonic()
        candidates = self.registry.candidates(ctx.model, conversations, view.in_flight, now)
        if ctx.ineligible:  # absent, not excluded: a policy treats an exclusion as a retry
            candidates = tuple(c for c in candidates if c.id not in ctx.ineligible)
        decision = ctx.policy.select(candidates, request, now)
        if (
            decision.reason in _NEW_CONVERSATION
            and decision.backend is not None
            and (ctx.route is None or ctx.route.teaches)
        ):
            # Marked now, not when the lease is taken: with Redis the pin's commit is awaited in between, and
            # a session starting meanwhile must already see this one placed (ttft spreads new ones by it).
            self.registry.placed(decision.backend, now)
        if inputs is not None and ctx.route is not None:
            ctx.route.uncached_tokens = decision.uncached_tokens
            return inputs.settle(ctx, ctx.pinned, decision)
        return decision

    def _hold(self, ctx: RequestContext, backend: str) -> Lease:
        """Count the decision on ``backend`` while its pin commits (a round trip with Redis): requests routed
        meanwhile, here or (the commit publishes this replica's counts) on other replicas, see it placed.
        Released after the commit in every case (an error, a client gone); the seat's lease follows it."""
        held = self.registry.lease(backend)
        if ctx.route is not None and ctx.route.teaches:
            held.prefill(ctx.route.uncached_tokens)  # the ttft policy's queued prefill, as the lease's
        return held

    async def _commit(self, ctx: RequestContext, key: str, decision: Decision) -> str:
        assert decision.backend is not None
        backend = decision.backend
        if decision.pin is not _NO_PIN:
            winner = await self.store.commit(key, decision)
            ctx.pinned = winner
            if winner != backend and self._routable(winner):
                backend = winner  # another replica claimed this conversation first
        self.metrics.decision(decision.reason)
        ctx.reason = decision.reason
        return backend

    # -- backend admission ----------------------------------------------------------------------------

    async def _seat(self, ctx: RequestContext, backend: str, send: Send) -> None:
        """Count the request on ``backend``, then wait for room there (each ``BackendAdmission``); released
        by ``_release_seats``.

        The lease (in flight, and the ttft policy's queued prefill) is taken before the wait, so the load
        routing sees on a backend includes the requests waiting for admission there, as it includes those
        waiting in an engine's own queue when admission is off: turning admission on does not hide a queue
        from the policy. A request refused (or whose client left) while waiting gives the lease back."""
        self._claim(ctx, backend)
        try:
            for seating in self.phases.seating:
                ctx.seats = (*ctx.seats, await seating.seat(ctx, backend, send))
        except BaseException:
            if ctx.lease is not None:
                ctx.lease.release()
                ctx.lease = None  # counted as before routing: no backend served it
            raise

    def _claim(self, ctx: RequestContext, backend_id: str) -> None:
        ctx.lease = self.registry.lease(backend_id)
        inputs = self.phases.route_inputs
        if inputs is not None and ctx.route is not None:
            inputs.sent(ctx, ctx.lease, ctx.route.uncached_tokens)

    @staticmethod
    def _release_seats(ctx: RequestContext) -> None:
        seats, ctx.seats = ctx.seats, ()
        for seat in seats:
            seat.release()

    # -- prepare and send -----------------------------------------------------------------------------

    async def _attempt(self, ctx: RequestContext, backend_id: str) -> Sent:
        backend = self.registry.backends[backend_id]
        ctx.attempt = attempt = Attempt(backend, Draft(ctx.body), ctx.path)
        payload = ctx.raw
        if ctx.body is not None:  # only bodies an endpoint owns are shaped; passthrough bodies go as they are
            for step in self.phases.prepare:
                await step.prepare(ctx, backend, attempt.draft)
            payload = attempt.draft.payload(ctx.raw)
        forward = ctx.client is None or backend.cfg.forward_client_key  # a gateway client key stays here
        headers = upstream_headers(ctx.headers, ctx.first, backend.cfg.api_key, forward)
        budget = min(self.timeouts.first_byte_s, ctx.remaining(self.timeouts.request_s))
        try:
            # asyncio.timeout's behaviour at ~half its cost (gateway/relay.py); this task is ``ctx.task``
            async with Deadline(budget, ctx.task):
                response = await self.transport.request(
                    ctx.method, backend.cfg.url, attempt.path, headers, payload
                )
        except TimeoutError:
            self.feed.outcome(backend_id, False)
            return self._failed(
                backend_id, AttemptOutcome.TIMEOUT, UpstreamTimeout, "sent no response in time"
            )
        except UpstreamConnectError as exc:
            self.feed.unreachable(backend_id, f"connect failed: {exc}")
            return self._failed(backend_id, AttemptOutcome.CONNECT_ERROR, UpstreamError, "is unreachable")
        except UpstreamPoolTimeout:
            # Our own pool is full: nothing the engine did, so nothing for its breaker (the pool logs it).
            return self._failed(backend_id, AttemptOutcome.POOL_TIMEOUT, UpstreamBusy, "is saturated")
        except UpstreamTransportError as exc:
            # Sent, then broken before the head (a stale keep-alive connection of a POST included): the
            # retry on the next backend is visible (retry_next), never a silent resend to the same one.
            log.warning("backend %s failed before answering: %s", backend_id, exc)
            self.feed.outcome(backend_id, False)
            return self._failed(backend_id, AttemptOutcome.BROKEN, UpstreamError, "failed before answering")
        ctx.upstream = response
        failed = response.status >= 500
        if not failed:  # a 5xx is judged once the request's other attempt is known (``settle``)
            self.feed.outcome(backend_id, True)
        self.metrics.attempt(backend_id, _HTTP_5XX if failed else _OK)
        return response

    def _failed(
        self, backend: str, outcome: AttemptOutcome, error: type[UpstreamError], what: str
    ) -> UpstreamError:
        self.metrics.attempt(backend, outcome)
        return error(f"backend {backend} {what}")

    async def _abandon(self, ctx: RequestContext, result: Sent) -> None:
        """Drop a failed first attempt before the retry: close its response, give its lease back."""
        if not isinstance(result, UpstreamError):
            await result.aclose()
        ctx.upstream = None
        self._release_seats(ctx)
        if ctx.lease is not None:
            ctx.lease.release()

    # -- finish ---------------------------------------------------------------------------------------

    async def _finish(self, ctx: RequestContext) -> None:
        if ctx.upstream is not None:
            await ctx.upstream.aclose()  # an unfinished body closes the connection, and the engine stops
        duration = time.monotonic() - ctx.started_at
        first_byte = None if ctx.first_byte_at is None else ctx.first_byte_at - ctx.started_at
        lease = ctx.lease
        self.metrics.request(
            NO_BACKEND_LABEL if lease is None else lease.backend.id, ctx.outcome, duration, first_byte
        )
        if lease is not None and self.phases.observers:
            self._observe(ctx, lease.backend.id, duration, first_byte)
        self._release_seats(ctx)  # its usage is known now: the response is over
        if lease is not None:
            lease.release()  # last: once in-flight reads zero, the request is fully accounted for

    def _observe(self, ctx: RequestContext, backend: str, duration: float, first_byte: float | None) -> None:
        tap, upstream = ctx.tap, ctx.upstream
        usage = None if ctx.attempt is None else ctx.attempt.usage  # a follow-up's, put together
        if usage is None and tap is not None:
            usage = tap.usage(ctx.shape.usage)  # where the shape's answers keep it
        obs = Observation(
            backend=backend,
            model=ctx.model,
            key=ctx.affinity_key,
            reason=ctx.reason,
            outcome=ctx.outcome,
            status=0 if upstream is None else upstream.status,
            streamed=tap is not None and tap.events > 0,
            duration_s=duration,
            first_byte_s=first_byte,
            events=0 if tap is None else tap.events,
            body_bytes=0 if tap is None else tap.body_bytes,
            usage=usage,
            route=ctx.route,
            reply=None if tap is None else tap.reply(),
        )
        for observer in self.phases.observers:
            try:
                observer.observe(obs)
            except Exception:  # an observer's defect must not break the request's accounting
                log.exception("observer %r failed", observer)

    def _routable(self, backend_id: str) -> bool:
        b = self.registry.backends.get(backend_id)
        return b is not None and b.routing_state is BackendState.READY

    def _nothing_ready(self, model: str | None) -> str:
        states = ", ".join(
            f"{b.id}={b.state.value}{' (circuit open)' if b.circuit_open else ''}"
            for b in self.registry.for_model(model)
        )
        what = f"model {model!r}" if model else "this request"
        return f"no healthy backend for {what} ({states or 'none configured'})"


def _status(attempt: Sent) -> int | None:
    """An attempt's answer (None: it failed without one)."""
    return None if isinstance(attempt, UpstreamError) else attempt.status


def _after_hang_up(ctx: RequestContext) -> RequestOutcome:
    """A client that hung up once it was sent its stream's terminal event (``[DONE]``, ``message_stop``...)
    had its answer, whether or not the engine's body had ended yet: the request is answered, and observers
    learn from what was relayed. Anything earlier is a disconnect."""
    tap, upstream = ctx.tap, ctx.upstream
    if tap is not None and upstream is not None and tap.ended(ctx.shape.terminal):
        return answered(upstream.status)
    return RequestOutcome.CLIENT_DISCONNECT


async def _watch_disconnect(receive: Receive, ctx: RequestContext) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not ctx.finishing and ctx.task is not None:
                ctx.client_gone = True
                ctx.task.cancel()
            return
