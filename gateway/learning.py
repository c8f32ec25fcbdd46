"""The ttft policy's memory in the gateway: what it has seen, turned into the inputs of a pure decision.

``RoutingFeedback`` is both ends of one loop:

- before routing (``plan``, ``request``, ``conversations``): the request's shape in tokens (a learned
  characters-per-token ratio), the key of turns >= 2 extended with the first reply's beginning (identical
  heads told apart, ``routing.keys.reply_key``), which backends recently prefilled the head, the twin hint
  (the backend that produced this conversation's first reply), active conversations: those between turns
  whose last answer ended within ``active_window_s`` (in flight ones count through their leases; pins
  idle for longer do not count at all);
- after sending (``sent``): the request's uncached tokens queue on its backend until the first byte;
- in ``finish`` (``observe``, an ``Observer``): learned prefill rates (``routing.speed``; no decode rates:
  no decision, metric or view reads them, and learning them was a sample per request), the
  typical turn size, the reply index, head holders confirmed or dropped by the reported cached tokens, and
  each backend's cache retention (``routing.retention``: what a follow-up sent home found cached there).
  Rates and retention reach the backends (the candidates' snapshot) when the speeds are recomputed, at most
  every ``_REFRESH_S``: per request that recomputation was the largest share of this module's CPU.

With engines that publish KV cache events (``kv``, a ``routing.kvindex.KvIndex`` fed by
``backends.kv_events``), ``request`` also says what each of them still holds of this conversation
(``RouteRequest.kv_held``) and ``observe`` ties the finished turn to the block that ends its prompt there.

State here is this process's own (with Redis, pins and in-flight counts are shared; all of this is local
and rebuilt from traffic within a minute). Synchronous and I/O-free, like every observer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from math import floor

from backends.registry import Lease, Registry
from gateway.context import RequestContext
from gateway.metrics import KvEventsMetrics
from gateway.observe import Observation, RouteInfo, Usage
from gateway.outcomes import RequestOutcome
from routing.affinity import AffinityTable
from routing.holders import HeadHolders
from routing.keys import first_reply, reply_key, reply_text
from routing.kvindex import KvIndex
from routing.params import DEFAULT_TURN_TOKENS, RoutingParams
from routing.policies import Policy
from routing.retention import RetentionEstimator
from routing.settle import settle_pin
from routing.shape import chat_turns
from routing.speed import Ewma, SpeedEstimator
from routing.types import Decision, RouteRequest

#: Bytes of a request body per prompt token before usage reports teach better (JSON framing included).
DEFAULT_CHARS_PER_TOKEN = 4.0
_REPLIES_TTL_S = 3600.0
_MAX_ENTRIES = 200_000
#: A holder whose reported cached tokens fall below this share of the head has lost it.
_HELD_SHARE = 0.5
#: Learned rates and retention are recomputed and published at most this often (seconds).
_REFRESH_S = 0.25
#: A conversation competes for its engine's KV cache while its pause since its last turn is within this
#: many typical pauses (the mean one learned; never past the active window): one idle for longer has most
#: likely finished.
COMPETING_PAUSES = 4.0
# Compared once per finished request: a module constant, not an Enum class attribute (on Python 3.11 each
# such load goes through ``EnumType``'s slow getattr hook).
_OK = RequestOutcome.OK


class RoutingFeedback:
    def __init__(
        self,
        registry: Registry,
        params: RoutingParams,
        clock: Callable[[], float] = time.monotonic,
        kv: KvIndex | None = None,
        kv_metrics: KvEventsMetrics | None = None,
    ) -> None:
        self.registry = registry
        self.clock = clock
        self.kv = kv
        self.kv_metrics = kv_metrics
        weights = {b.id: b.cfg.weight for b in registry.backends.values()}
        self.speeds = SpeedEstimator(weights, params.speed_half_life_s, refresh_s=_REFRESH_S)
        self.retention = RetentionEstimator(params.speed_half_life_s)
        self.active = AffinityTable(params.active_window_s, _MAX_ENTRIES)  # key -> backend, recent only
        self.replies = AffinityTable(_REPLIES_TTL_S, _MAX_ENTRIES)  # extended key -> first reply's backend
        self.holders = HeadHolders(_MAX_ENTRIES)  # head key -> its holders and its latest turn 1's backend
        self.chars_per_token = Ewma(DEFAULT_CHARS_PER_TOKEN)
        self.turn_tokens = Ewma(DEFAULT_TURN_TOKENS)
        #: The pause between a turn's end and the conversation's next turn (seconds; learned, the window's
        #: share as the prior). ``active`` only knows when pins were used to within a generation's width.
        self.pause_s = Ewma(params.active_window_s / COMPETING_PAUSES)
        self._publish_rates()

    # -- before routing -------------------------------------------------------------------------------

    def plan(self, ctx: RequestContext) -> None:
        """Shape the request and, on turns >= 2 of a chat without a session id, extend the key it is routed
        under (``ctx.route_key``; the endpoint's ``ctx.key`` stays as it was)."""
        messages = None
        if ctx.body is not None:
            read = ctx.shape.conversation  # a shape's own turns (None: chat's ``messages``)
            messages = ctx.body.get("messages") if read is None else read(ctx.body)
        if not isinstance(messages, list):
            # /v1/completions (or a body we do not read): no replies to tell apart, so the pin is the
            # conversation's own; assume it holds all but the last quarter of the prompt.
            size = len(ctx.raw)
            ctx.route = RouteInfo(ctx.key, ctx.body is None, size, 0, size // 4)
            return
        # A session id names the conversation itself: its pin is its own from the first request on (agent
        # sessions of one identical head are separate conversations), and no reply tells it apart.
        own_key = ctx.identity is not None
        turns = ctx.shape.turns  # a shape whose head is not only ``messages`` (Anthropic's ``system``)
        if turns is None or ctx.body is None:
            shape, first = chat_turns(messages)  # the first reply found in the same walk (None: turn 1)
            reply = None if first is None or own_key else reply_text(first)
        else:
            shape = turns(ctx.body)
            reply = first_reply(messages) if shape.turn > 1 and not own_key else None
        if reply is not None:
            ctx.route_key = reply_key(ctx.key, reply)
        # A request that is no turn (a token count) is routed as its conversation's next turn would be (the
        # same key, pin, reply hint and holders), and teaches nothing: no prefill queued, no holder, no speed.
        # Positional (once per request: keywords cost their matching).
        ctx.route = RouteInfo(ctx.key, shape.turn == 1, len(ctx.raw), shape.head_chars, shape.tail_chars,
                              own_key, ctx.shape.pins)  # fmt: skip

    def request(self, ctx: RequestContext, pinned: str | None, exclude: frozenset[str]) -> RouteRequest:
        info = ctx.route
        assert info is not None
        cpt = self.chars_per_token.value
        head_key, key = info.head_key, ctx.route_key  # ``ctx.affinity_key`` inline (a property)
        if key is None:
            key = ctx.key
        holders = self.holders.get(head_key)
        hint = None
        if info.first_turn and not info.own_key:  # ``info.twin_head``
            # The head's pin only says who prefilled the head (a twin, or this conversation's turn 1).
            if pinned is not None:
                holders = holders | {pinned}
            pinned = None
        elif pinned is None:
            # The backend that produced this first reply; else (a client that does not resend replies as
            # they were, an unobserved reply) the one that served this head's latest first turn here.
            hint = self.replies.get(key, self.clock()) or self.holders.latest(head_key)
        info.home = home = pinned or hint
        kv_held = () if self.kv is None else self._kv_held(key, head_key, home)
        # Positional (once per request: keywords cost their matching): key, pinned, exclude, the prompt's,
        # head's and tail's tokens, a turn's, holders, hint, kv_held.
        # ``floor``, not ``int``: the same for these (characters >= 0, a ratio > 0) at half the cost (``int``
        # is a type's call).
        prompt, head = floor(info.prompt_chars / cpt), floor(info.head_chars / cpt)
        tail, turn = floor(info.tail_chars / cpt), int(self.turn_tokens.value)
        return RouteRequest(key, pinned, exclude, prompt, head, tail, turn, holders, hint, kv_held)

    def _kv_held(self, key: str, head_key: str, home: str | None) -> tuple[tuple[str, int], ...]:
        """What each event-publishing engine holds: of this conversation, else (not its home) of its head.

        The home is judged by the conversation's own record only (another replica may have served its last
        turns: then inference stands), and by inference when it still holds the latest prompt (the reply
        that followed it, which the index does not count, is most likely there too)."""
        assert self.kv is not None
        held = {b: tokens for b, tokens, _whole in self.kv.snapshot(head_key) if b != home}
        if key != head_key:
            for b, tokens, whole in self.kv.snapshot(key):
                if b == home:
                    if not whole:
                        held[b] = tokens
                elif tokens >= held.get(b, 0):
                    held[b] = tokens
        return tuple(sorted(held.items()))

    def conversations(self) -> Mapping[str, int]:
        """Active conversations per backend: what the ttft policy counts where affinity counts pins. Also
        publishes those competing for each backend's KV cache (``Backend.competing``): the active ones whose
        pause is within ``COMPETING_PAUSES`` typical pauses; only once an engine reports its KV cache size
        (the cost model reads them only for an engine that does). Called before every decision: it first
        publishes the rates learned since the last refresh, once ``_REFRESH_S`` has passed (``observe``
        refreshes only when a request finishes: the samples of a burst's last ones waited for the next one).
        """
        now = self.clock()
        speeds = self.speeds
        if speeds.dirty and speeds.refresh(now):  # no call while nothing is new
            self._publish_rates(now)
        active = self.active
        counts = active.live_counts(now)
        backends = self.registry.backends.values()
        for b in backends:
            s = b.signals
            if s is not None and s.kv_capacity is not None:
                break
        else:  # no engine reports its KV cache size: the cost model reads ``competing`` of none (-1 stays)
            return counts
        window = COMPETING_PAUSES * self.pause_s.value
        # A window as long as the table's: every pin left after ``expire`` was used within it, so all of them
        # compete (no walk of the generations; while no pause is learned, the prior makes it the whole table).
        whole = window >= active.ttl_s
        recent = counts if whole else active.recent_counts(now - max(active.width_s, window))
        for b in backends:
            b.competing = recent.get(b.id, 0)
        return counts

    def explain(
        self, ctx: RequestContext, pinned: str | None, in_flight: Mapping[str, int] | None, policy: Policy
    ) -> Decision:
        """The decision ``ctx`` would get now, with every candidate's costs (the admin "why" dry run).

        No side effects but ``plan``'s on ``ctx`` (its route key and shape): nothing is claimed, queued or
        learned.
        """
        if ctx.route is None:
            self.plan(ctx)
        request = replace(self.request(ctx, pinned, frozenset()), explain=True)
        now = self.clock()
        candidates = self.registry.candidates(ctx.model, self.conversations(), in_flight, now)
        return self.settle(ctx, pinned, policy.select(candidates, request, now))

    def settle(self, ctx: RequestContext, pinned: str | None, decision: Decision) -> Decision:
        """The pin ``decision`` may write (``routing.settle``): a first turn never claims its twin's head."""
        info = ctx.route
        if info is None or pinned is None or not info.first_turn:  # nothing to settle: every later turn
            return decision
        return settle_pin(decision, first_turn=info.twin_head, pinned=pinned)

    # -- after sending --------------------------------------------------------------------------------

    def sent(self, ctx: RequestContext, lease: Lease, uncached_tokens: int) -> None:
        """The request went to ``lease.backend``: queue its prefill there and remember who holds what."""
        info = ctx.route
        if info is None or not info.teaches:
            return
        lease.prefill(uncached_tokens)
        info.uncached_tokens = uncached_tokens
        info.sent_at = now = self.clock()
        info.busy_s = -1.0  # (a retry's span is its own)
        backend, key = lease.backend.id, ctx.route_key  # ``ctx.affinity_key`` inline (a property)
        body = ctx.body
        if (
            body is not None and body.get("stream") is True
        ):  # a plain body's first byte comes after its decode
            lease.on_first_byte = lambda: self._first_byte(info, backend)
        if key is None:
            key = ctx.key
        if self.kv is not None and backend in self.kv.engines:
            info.kv_mark = self.kv.mark(backend)
            estimate = self.kv.held(key, backend)
            if estimate is None:
                estimate = self.kv.held(info.head_key, backend)
            info.kv_estimate = -1 if estimate is None else estimate
        # In flight now: counted by the lease until it finishes, no longer among the active ones.
        active = self.active
        expires = active.take(key)
        if expires is not None and not info.first_turn:
            # Its last turn ended at most this long ago (its generation's latest use). ``Ewma.add`` and
            # ``max(0.0, pause)`` inline (once per follow-up): the same arithmetic.
            pause, e = now - (expires - active.ttl_s), self.pause_s
            e.value += e.alpha * ((pause if pause > 0.0 else 0.0) - e.value)
        self.holders.add(info.head_key, backend, info.first_turn)

    def _first_byte(self, info: RouteInfo, backend: str) -> None:
        """Its first byte: its span joins the backend's busy time now, in the order the engine finished
        prefilling (``SpeedEstimator.busy``); ``observe`` adds the seconds with the reported tokens."""
        info.busy_s = self.speeds.busy(backend, info.sent_at, self.clock())

    # -- in finish: the Observer ----------------------------------------------------------------------

    def observe(self, obs: Observation) -> None:
        info = obs.route
        if info is None or not info.teaches or obs.outcome is not _OK:
            return
        now = self.clock()
        added = None
        if obs.backend not in self.speeds.weights:  # added at runtime (the admin API): its prior first
            added = self.registry.backends.get(obs.backend)
            if added is not None:
                self.speeds.set_weight(obs.backend, added.cfg.weight)
        usage = obs.usage
        uncached = info.uncached_tokens
        # A first turn's next turn routes by its reply: that key, once (for the replies and the KV index).
        replied = None
        if info.first_turn and obs.reply is not None and (self.kv is not None or not info.own_key):
            replied = reply_key(info.head_key, obs.reply)
        if usage is not None:
            if usage.prompt_tokens > 0:  # ``Ewma.add`` inline (this one and the turn's size: per request)
                e = self.chars_per_token
                e.value += e.alpha * (info.prompt_chars / usage.prompt_tokens - e.value)
            if usage.cached_tokens is not None:
                uncached = usage.prompt_tokens - usage.cached_tokens
                if not info.first_turn:
                    self._held(info, obs.backend, usage.prompt_tokens, usage.cached_tokens, now)
            if self.kv is not None:
                self._kv_learn(obs, info, usage, replied)
        fb = obs.first_byte_s
        if fb is not None and usage is not None and obs.streamed:
            # Only streams that report usage teach speed: anything else (a passthrough GET, a stream
            # without include_usage) may not have prefilled what was estimated, and a whole JSON answer's
            # first byte comes after its decode. The busy time its span (sending to the first byte) added
            # when the first byte came; without one (not sent through ``sent``), the span merged now, on
            # this clock (the request started ``duration_s`` ago).
            if info.busy_s >= 0.0:  # its span was merged at its first byte (``_first_byte``)
                self.speeds.prefill_busy(obs.backend, uncached, info.busy_s, now)
            else:
                end = now - obs.duration_s + fb
                start = info.sent_at
                if start < 0 or start > end:  # not sent through ``sent`` (or another clock): from its start
                    start = end - fb
                self.speeds.prefill_span(obs.backend, uncached, start, end, now)
        next_key = obs.key
        if not info.first_turn:
            # What the turn added to the conversation (its tail), not what it cost: a cold re-prefill of the
            # whole history on an evicting engine is no bigger a conversation (the pressure term prices it).
            grown = int(info.tail_chars / self.chars_per_token.value)
            grew = grown if 0 < grown < uncached else uncached
            e = self.turn_tokens
            e.value += e.alpha * (grew - e.value)
        elif replied is not None and not info.own_key:
            next_key = replied
            self.replies.move(next_key, obs.backend, now)
        # Active until its next turn (or the window's end): keyed as that turn will be, so each of several
        # twins sharing one head counts once.
        self.active.move(next_key, obs.backend, now)
        speeds = self.speeds
        if (speeds.dirty and speeds.refresh(now)) or added is not None:  # no call while nothing is new
            self._publish_rates(now)

    def _kv_learn(self, obs: Observation, info: RouteInfo, usage: Usage, replied: str | None) -> None:
        """Tie the finished turn to the block ending its prompt on its engine, under the key its next turn
        routes by (and, on a first turn, the head's); compare the index's estimate with the report."""
        if self.kv is None or info.kv_mark < 0:
            return
        if info.kv_estimate >= 0 and usage.cached_tokens is not None and self.kv_metrics is not None:
            self.kv_metrics.cached(obs.backend, info.kv_estimate, usage.cached_tokens)
        next_key = obs.key if replied is None else replied
        # A first turn: its next turn routes by the reply (or its session id: ``obs.key``); twins by the head.
        keys = (next_key, obs.key, info.head_key) if info.first_turn else (obs.key,)
        self.kv.record(tuple(dict.fromkeys(keys)), obs.backend, info.kv_mark, usage.prompt_tokens)

    def _held(self, info: RouteInfo, backend: str, prompt: int, cached: int, now: float) -> None:
        """A follow-up's reported cached tokens: the head still held there, the home's retention."""
        cpt = self.chars_per_token.value
        if cached < _HELD_SHARE * info.head_chars / cpt:
            self.holders.drop(info.head_key, backend)
        if backend == info.home:
            self.retention.sample(backend, prompt - info.tail_chars / cpt, cached, now)

    def _publish_rates(self, now: float | None = None) -> None:
        if now is not None:
            self.retention.refresh(now)
        rates, kept = self.speeds.prefill_tps, self.retention.retention
        for b in self.registry.backends.values():
            b.prefill_tps = rates.get(b.id, 0.0)
            b.retention = kept.get(b.id, 1.0)
