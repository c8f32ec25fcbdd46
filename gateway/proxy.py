"""The hot path, as named phases around one ``RequestContext``:

    route -> (prepare -> send) per attempt, at most two -> relay -> finish

- route: a snapshot of the candidates, the pure policy's ``Decision``, the pin committed to the store;
- prepare: the configured ``PrepareStep``s shape a ``Draft`` for the chosen backend (per attempt, from the
  original body; untouched bodies go upstream as the client's own bytes);
- send: one upstream attempt, transport errors mapped here and nowhere else. A connect error, timeout or 5xx
  *before the first byte* is retried once on the next choice, unseen by the client;
- admission: a chosen backend must ``admit`` the request (its circuit breaker: when half-open only one
  trial goes); a refusal routes to the next choice. Every attempt's outcome feeds the breaker (connect
  error, timeout, broken before or during the answer: failure; any other answer, 4xx included: success);
  a 5xx answer is judged with the request's other attempt (gateway/blame.py), so that a request every
  engine fails is held against none of them;
- relay: the response streamed through unbuffered, each chunk shown to the output guard first; a failure
  *after* bytes were sent ends an SSE stream with an error event and ``[DONE]``, never a hang. Engine
  silence is timed, the client's reading is not;
- finish: the upstream response closed (that cancels the engine's work), the lease released, the request
  counted: in one ``finally``, whatever happened. A client disconnect at any point cancels the request.

Pure ASGI: no Request/Response objects, no BaseHTTPMiddleware.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from starlette.types import Message, Receive, Send

from backends.registry import Registry
from config.settings import GuardAction, GuardConfig, TimeoutConfig
from gateway.blame import OutcomeFeed, settle
from gateway.context import Draft, PrepareStep, RequestContext, RouteFilter
from gateway.errors import (
    EngineFailed,
    GatewayError,
    ModelNotFound,
    NoHealthyBackend,
    UpstreamBusy,
    UpstreamError,
    UpstreamReplyTooLarge,
    UpstreamTimeout,
)
from gateway.guard import StreamGuard
from gateway.metrics import Metrics
from gateway.not_found import relay_404
from gateway.observe import Observation, Observer, ResponseTap
from gateway.outcomes import NO_BACKEND_LABEL, AttemptOutcome, RequestOutcome
from gateway.relay import Expiry, Rewrite, SilenceWatch, body, response_head, send_error, sse_error
from gateway.state import AffinityStore, StoreView
from gateway.transport import (
    TransportResponse,
    UpstreamConnectError,
    UpstreamPoolTimeout,
    UpstreamReadError,
    UpstreamTransport,
    UpstreamTransportError,
)
from routing.types import BackendState, Decision, PinAction, RouteRequest

if TYPE_CHECKING:
    from gateway.continuation import Continuation
    from gateway.learning import RoutingFeedback
    from gateway.reasoning import ReasoningRelay
    from gateway.waiting import WaitingRoom

log = logging.getLogger("warmroute.proxy")

Attempt = TransportResponse | UpstreamError


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
    def __init__(
        self,
        timeouts: TimeoutConfig,
        registry: Registry,
        store: AffinityStore,
        feed: RequestFeed,
        metrics: Metrics,
        transport: UpstreamTransport,
        steps: Sequence[PrepareStep] = (),
        guard: GuardConfig | None = None,
        observers: Sequence[Observer] = (),
        hide_engine_errors: bool = False,
    ) -> None:
        self.hide_engine_errors = hide_engine_errors  # an engine's 5xx body stays here (internal names)
        self.registry = registry
        self.store = store
        self.feed = feed
        self.guard = guard if guard is not None and guard.enabled else None
        self.metrics = metrics
        self.timeouts = timeouts
        self.transport = transport
        self.steps = tuple(steps)
        self.filters: tuple[RouteFilter, ...] = ()  # backends a request cannot use (gateway/vision.py)
        self.observers = tuple(observers)  # told what each answered request looked like, in finish
        self.continuation: Continuation | None = None  # gateway-enforced thinking budgets (set by the app)
        self.reasoning: ReasoningRelay | None = None  # reasoning in the client's field(s); set by the app
        self.waiting: WaitingRoom | None = None  # requests for on-demand engines wait here; set by the app
        self.feedback: RoutingFeedback | None = None  # the ttft policy's inputs and learning; set by the app

    async def forward(self, receive: Receive, send: Send, ctx: RequestContext) -> None:
        ctx.task = task = asyncio.current_task()
        assert task is not None
        watcher = asyncio.create_task(_watch_disconnect(receive, ctx))
        claim = None  # an on-demand engine's: it is not stopped before this request is finished
        try:
            try:
                if self.waiting is not None:  # gateway/waiting.py: wait for an on-demand engine to start
                    send = self.waiting.wrap(ctx, send)
                    claim = await self.waiting.enter(ctx, send)
                upstream = await self._open(ctx)
            except GatewayError as err:
                ctx.outcome = _outcome_of(err)
                ctx.finishing = ctx.responded = True
                await send_error(send, err)
                return
            thinking = ctx.thinking
            if thinking is not None and thinking.gateway_enforced and upstream.status == 200:
                assert self.continuation is not None  # two phases, one response: gateway/continuation.py
                await self.continuation.relay(ctx, upstream, send)
                return
            await self._relay(ctx, upstream, send)
        except asyncio.CancelledError:
            if not ctx.client_gone:
                raise
            task.uncancel()
            ctx.outcome = RequestOutcome.CLIENT_DISCONNECT
        except Exception as exc:  # a defect of ours: one log entry with the trace, and no hang
            log.exception("unexpected error proxying %s %s", ctx.method, ctx.path, exc_info=exc)
            if ctx.responded:
                raise  # the head is gone: the server closes the connection
            ctx.outcome = RequestOutcome.UPSTREAM_ERROR
            ctx.finishing = True
            await send_error(send, GatewayError("internal error in the gateway; see its log"))
        finally:
            watcher.cancel()
            await self._finish(ctx)
            if claim is not None:
                claim.release()

    async def reject(self, send: Send, err: GatewayError) -> None:
        """Answer a request refused before routing (bad input) and count it."""
        self.metrics.request(NO_BACKEND_LABEL, _outcome_of(err), 0.0, None)
        await send_error(send, err)

    # -- route ----------------------------------------------------------------------------------------

    async def _open(self, ctx: RequestContext) -> TransportResponse:
        """Route, prepare, send; once more on the next choice if the first backend fails before answering."""
        if ctx.model is not None and not self.registry.serves(ctx.model):
            available = ", ".join(self.registry.models())
            raise ModelNotFound(
                f"model {ctx.model!r} is not served here; available: {available}", param="model"
            )
        for rule in self.filters:
            ctx.ineligible |= rule.ineligible(ctx)
        if self.feedback is not None:
            self.feedback.plan(ctx)  # may extend ctx.key (turns >= 2 of identical heads told apart)
        view = await self.store.view(ctx.key if ctx.policy.uses_affinity else None)
        ctx.pinned = view.pinned
        backend, refused = await self._choose(ctx, view, frozenset())
        if backend is None:
            raise NoHealthyBackend(self._nothing_ready(ctx.model))
        result = await self._attempt(ctx, backend)
        if not isinstance(result, UpstreamError) and result.status < 500:
            return result
        retry, _ = await self._choose(ctx, view, refused | {backend})
        if retry is None:
            settle(self.feed, ctx.requester, [(backend, _status(result))], f"{ctx.method} {ctx.path}")
            if isinstance(result, UpstreamError):
                raise result
            return result  # nobody else to ask: the engine's own 5xx is the most useful answer
        await self._abandon(ctx, result)
        second = await self._attempt(ctx, retry)
        attempts = [(backend, _status(result)), (retry, _status(second))]
        settle(self.feed, ctx.requester, attempts, f"{ctx.method} {ctx.path}")
        if isinstance(second, UpstreamError):
            raise second
        return second

    async def _choose(
        self, ctx: RequestContext, view: StoreView, exclude: frozenset[str]
    ) -> tuple[str | None, frozenset[str]]:
        """The routed backend that admits the request (and those that refused it), or None."""
        while True:
            decision = self._route(ctx, view, exclude)
            if decision.backend is None:
                return None, exclude
            backend = await self._commit(ctx, decision)
            if self.feed.admit(backend):
                return backend, exclude
            exclude = exclude | {backend}  # its breaker is half-open and its one trial is taken

    def _route(self, ctx: RequestContext, view: StoreView, exclude: frozenset[str]) -> Decision:
        feedback = self.feedback if ctx.route is not None else None  # the ttft policy: gateway/learning.py
        if feedback is None:
            conversations, request = view.conversations, RouteRequest(ctx.key, ctx.pinned, exclude)
        else:
            conversations, request = feedback.conversations(), feedback.request(ctx, ctx.pinned, exclude)
        now = time.monotonic()
        candidates = self.registry.candidates(ctx.model, conversations, view.in_flight, now)
        if ctx.ineligible:  # absent, not excluded: a policy treats an exclusion as a retry
            candidates = tuple(c for c in candidates if c.id not in ctx.ineligible)
        decision = ctx.policy.select(candidates, request, now)
        if feedback is not None and ctx.route is not None:
            ctx.route.uncached_tokens = decision.uncached_tokens
            return feedback.settle(ctx, ctx.pinned, decision)
        return decision

    async def _commit(self, ctx: RequestContext, decision: Decision) -> str:
        assert decision.backend is not None
        backend = decision.backend
        if decision.pin is not PinAction.NONE:
            winner = await self.store.commit(ctx.key, decision)
            ctx.pinned = winner
            if winner != backend and self._routable(winner):
                backend = winner  # another replica claimed this conversation first
        self.metrics.decision(decision.reason)
        ctx.reason = decision.reason
        return backend

    # -- prepare and send -----------------------------------------------------------------------------

    async def _attempt(self, ctx: RequestContext, backend_id: str) -> Attempt:
        backend = self.registry.backends[backend_id]
        ctx.lease = self.registry.lease(backend_id)
        if self.feedback is not None and ctx.route is not None:
            self.feedback.sent(ctx, ctx.lease, ctx.route.uncached_tokens)
        payload = ctx.raw
        if ctx.body is not None:  # only bodies an endpoint owns are shaped; passthrough bodies go as they are
            draft = Draft(ctx.body)
            for step in self.steps:
                await step.prepare(ctx, backend, draft)
            payload = draft.payload(ctx.raw)
        forward = ctx.client is None or backend.cfg.forward_client_key  # a gateway client key stays here
        headers = upstream_headers(ctx.headers, backend.cfg.api_key, forward)
        budget = min(self.timeouts.first_byte_s, ctx.remaining(self.timeouts.request_s))
        try:
            async with asyncio.timeout(budget):
                response = await self.transport.request(
                    ctx.method, backend.cfg.url, ctx.path, headers, payload
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
        self.metrics.attempt(backend_id, AttemptOutcome.HTTP_5XX if failed else AttemptOutcome.OK)
        return response

    def _failed(
        self, backend: str, outcome: AttemptOutcome, error: type[UpstreamError], what: str
    ) -> UpstreamError:
        self.metrics.attempt(backend, outcome)
        return error(f"backend {backend} {what}")

    async def _abandon(self, ctx: RequestContext, result: Attempt) -> None:
        """Drop a failed first attempt before the retry: close its response, give its lease back."""
        if not isinstance(result, UpstreamError):
            await result.aclose()
        ctx.upstream = None
        if ctx.lease is not None:
            ctx.lease.release()

    # -- relay ----------------------------------------------------------------------------------------

    async def _relay(self, ctx: RequestContext, upstream: TransportResponse, send: Send) -> None:
        assert ctx.lease is not None
        if self.hide_engine_errors and upstream.status >= 500:
            await self._withhold(ctx, upstream, send)
            return
        if upstream.status == 404 and ctx.body is None:  # a forwarded route the engine does not serve
            await relay_404(ctx, upstream, send, self.timeouts.read_s)
            ctx.outcome = RequestOutcome.HTTP_4XX
            return
        sse, head = response_head(upstream, ctx.lease.backend.id, ctx.reason)
        if self.observers:
            ctx.tap = ResponseTap(reply=ctx.route is not None and ctx.route.first_turn)
        error = await self._pump(ctx, upstream, sse, head, send)
        if error is None:
            ctx.outcome = _answered(upstream.status)
            ctx.finishing = True
            await send(body(b"", more=False))
            return
        if not ctx.responded:  # a body read whole was refused before its head went: a proper error response
            ctx.outcome = _outcome_of(error)
            ctx.finishing = ctx.responded = True
            await send_error(send, error)
            return
        ctx.outcome = RequestOutcome.MID_STREAM_ERROR
        if sse:
            ctx.finishing = True
            await send(sse_error(error))
        else:
            # A non-streamed body's status line is gone: returning without finishing makes the server close
            # the connection, which is the only honest signal left.
            log.warning("%s; closing the client connection", error.message)

    async def _withhold(self, ctx: RequestContext, upstream: TransportResponse, send: Send) -> None:
        """An engine 5xx answered generically; its body is never read (``_finish`` closes it)."""
        assert ctx.lease is not None
        backend = ctx.lease.backend.id
        log.warning("backend %s answered %d; its body is withheld from the client", backend, upstream.status)
        ctx.outcome = RequestOutcome.HTTP_5XX
        ctx.finishing = ctx.responded = True
        await send_error(send, EngineFailed(backend, upstream.status, upstream.header(b"retry-after")))

    async def _pump(
        self, ctx: RequestContext, upstream: TransportResponse, sse: bool, head: Message, send: Send
    ) -> UpstreamError | None:
        """Send the head and stream the body through; None when it ended properly, else why it ended early.

        Engine silence is timed on the bytes the engine sends (``read_s``), whatever a body filter holds
        back; the client's reading is not timed; ``request_s`` bounds the whole.
        """
        assert ctx.lease is not None and ctx.task is not None
        backend = ctx.lease.backend.id
        guard, tap = self._guard_for(ctx, sse), ctx.tap
        watch = SilenceWatch.for_request(ctx, self.timeouts)
        relayed = Rewrite(head, watch.heard(upstream.aiter_raw()))
        try:
            if self.reasoning is not None and upstream.status == 200:  # gateway/reasoning.py
                relayed = self.reasoning.wrap(ctx, sse, head, relayed.chunks)
            if not relayed.whole:
                await _send_head(ctx, send, relayed.head, watch)
            async for chunk in relayed.chunks:
                if ctx.first_byte_at is None:
                    ctx.first_byte_at = time.monotonic()
                    ctx.lease.first_byte()  # its prefill is no longer queued on the engine
                if tap is not None:
                    tap.feed(chunk)
                if guard is not None and guard.feed(chunk) and self._tripped(backend, guard):
                    # The guard's action is to end it (the tripping chunk is not sent); the engine answered,
                    # so this is no breaker failure.
                    return UpstreamError(
                        f"backend {backend} output degenerated: {guard.unit()!r} repeated; stream ended"
                    )
                if not ctx.responded:
                    await _send_head(ctx, send, relayed.head, watch)
                watch.sending = True
                await send(body(chunk, more=True))
                watch.chunk_sent()
        except asyncio.CancelledError:
            if watch.fired is None:
                raise  # the client left, or the server is stopping
            ctx.task.uncancel()
            failure: str = f"sent nothing for {self.timeouts.read_s:g}s"
            if watch.fired is Expiry.DEADLINE:
                failure = f"did not finish within request_s={self.timeouts.request_s:g}s"
            error: UpstreamError = UpstreamTimeout(f"backend {backend} {failure}")
        except UpstreamReplyTooLarge as exc:
            log.warning("%s", exc.message)
            return exc  # the engine answered: too large to rewrite is no failure of its health
        except UpstreamReadError as exc:
            log.warning("backend %s broke mid-response: %s", backend, exc)
            error = UpstreamError(f"backend {backend} failed mid-stream (the connection broke)")
        else:
            return None
        finally:
            watch.cancel()
            if guard is not None and guard.finish:
                self.metrics.finished(backend, guard.finish)
        self.feed.outcome(backend, False)  # the engine broke or went silent mid-answer
        return error

    def _guard_for(self, ctx: RequestContext, sse: bool) -> StreamGuard | None:
        if self.guard is None:
            return None
        return StreamGuard(self.guard, completions=ctx.path.startswith("/v1/completions"), sse=sse)

    def _tripped(self, backend: str, guard: StreamGuard) -> bool:
        """A degenerate stream: count and log it; True when the configured action ends it here."""
        assert self.guard is not None
        action = self.guard.action if guard.sse else GuardAction.RECORD
        self.metrics.guard_tripped(backend, action.value)
        n = self.guard.repeat_count
        log.warning(
            "backend %s: output guard tripped (%r %d times in a row): %s", backend, guard.unit(), n, action
        )
        return action is GuardAction.END

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
        if lease is not None:
            if self.observers:
                self._observe(ctx, lease.backend.id, duration, first_byte)
            lease.release()  # last: once in-flight reads zero, the request is fully accounted for

    def _observe(self, ctx: RequestContext, backend: str, duration: float, first_byte: float | None) -> None:
        tap, upstream = ctx.tap, ctx.upstream
        obs = Observation(
            backend=backend,
            model=ctx.model,
            key=ctx.key,
            reason=ctx.reason,
            outcome=ctx.outcome,
            status=0 if upstream is None else upstream.status,
            streamed=tap is not None and tap.events > 0,
            duration_s=duration,
            first_byte_s=first_byte,
            events=0 if tap is None else tap.events,
            body_bytes=0 if tap is None else tap.body_bytes,
            usage=None if tap is None else tap.usage(),
            route=ctx.route,
            reply=None if tap is None else tap.reply(),
        )
        for observer in self.observers:
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


def _status(attempt: Attempt) -> int | None:
    """An attempt's answer (None: it failed without one)."""
    return None if isinstance(attempt, UpstreamError) else attempt.status


def _answered(status: int) -> RequestOutcome:
    if status < 400:
        return RequestOutcome.OK
    return RequestOutcome.HTTP_4XX if status < 500 else RequestOutcome.HTTP_5XX


def _outcome_of(err: GatewayError) -> RequestOutcome:
    if isinstance(err, UpstreamTimeout):
        return RequestOutcome.UPSTREAM_TIMEOUT
    if isinstance(err, UpstreamError):
        return RequestOutcome.UPSTREAM_ERROR
    if isinstance(err, NoHealthyBackend):
        return RequestOutcome.NO_BACKEND
    return RequestOutcome.REJECTED


async def _send_head(ctx: RequestContext, send: Send, head: Message, watch: SilenceWatch) -> None:
    ctx.responded = True
    watch.sending = True  # a client slow to take it is not a silent engine
    await send(head)
    watch.chunk_sent()


async def _watch_disconnect(receive: Receive, ctx: RequestContext) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            if not ctx.finishing and ctx.task is not None:
                ctx.client_gone = True
                ctx.task.cancel()
            return


def upstream_headers(
    client: Sequence[tuple[bytes, bytes]], api_key: str | None, forward_auth: bool = True
) -> list[tuple[bytes, bytes]]:
    """What the engine gets: our framing, the client's accept and request id, and the right credentials
    (the client's own Authorization only with ``forward_auth``; the backend's ``api_key`` wins anyway)."""
    accept = request_id = auth = None
    for name, value in client:
        if name == b"accept":
            accept = accept or value
        elif name == b"x-request-id":
            request_id = request_id or value
        elif name == b"authorization" and forward_auth:
            auth = auth or value
    headers = [
        (b"content-type", b"application/json"),
        (b"accept", accept or b"*/*"),
        (b"accept-encoding", b"identity"),
    ]
    if api_key:
        auth = f"Bearer {api_key}".encode()
    if auth:
        headers.append((b"authorization", auth))
    if request_id:
        headers.append((b"x-request-id", request_id))
    return headers
