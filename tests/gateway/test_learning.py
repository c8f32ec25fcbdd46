"""Routing v2 in the proxy: identical heads told apart by their first reply, the prefill ledger, learning."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from test_proxy_phases import backends_ab, make_proxy, run

from backends.signals import EngineSignals
from gateway.context import RequestContext
from gateway.identity import Identity
from gateway.inbound import first_values
from gateway.learning import RoutingFeedback
from gateway.observe import Observation, RouteInfo, Usage
from gateway.outcomes import RequestOutcome
from gateway.proxy import Proxy
from gateway.shapes.table import CHAT, COMPLETIONS
from gateway.state import MemoryAffinityStore
from routing.keys import chat_key, reply_key, session_key
from routing.params import DEFAULT_PREFILL_TPS, RoutingParams
from routing.policies.ttft import TtftPolicy
from routing.types import Decision, Reason

from transports import FakeTransport, Reply

pytestmark = pytest.mark.anyio

PARAMS = RoutingParams("ttft", 2.0, 8, False)
POLICY = TtftPolicy(PARAMS)
HEAD = [{"role": "system", "content": "You are a helper."}, {"role": "user", "content": "Solve the task."}]
SSE = [(b"content-type", b"text/event-stream")]


def streamed(text: str) -> Reply:
    events = [{"choices": [{"delta": {"role": "assistant"}}]}]
    words = text.split(" ")
    events += [{"choices": [{"delta": {"content": w if i == 0 else " " + w}}]} for i, w in enumerate(words)]
    return Reply(200, SSE, [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"])


def v2_proxy(fake: FakeTransport) -> tuple[Proxy, RoutingFeedback]:
    parts = backends_ab()
    feedback = RoutingFeedback(parts[2], PARAMS)
    return make_proxy(fake, feedback, parts=parts), feedback  # its inputs before routing, learning in finish


def chat(messages: list[dict[str, Any]], headers: list[tuple[bytes, bytes]] | None = None) -> RequestContext:
    body = {"model": "m", "messages": messages, "stream": True}
    sent = headers or []
    return RequestContext("POST", "/v1/chat/completions", json.dumps(body).encode(), body, "m",
                          chat_key(body), POLICY, sent, first_values(sent), CHAT)  # fmt: skip


async def test_twins_sharing_a_head_spread_and_each_follows_its_own_first_reply() -> None:
    fake = FakeTransport()
    fake.script("http://a", streamed("from a , one"), streamed("from a , two"))
    fake.script("http://b", streamed("from b , one"), streamed("from b , two"))
    proxy, _ = v2_proxy(fake)
    await run(proxy, x := chat(HEAD))
    await run(proxy, y := chat(HEAD))
    assert x.key == y.key and x.backend is not None and y.backend is not None
    assert {x.backend.id, y.backend.id} == {"a", "b"}  # the second twin did not pile onto the first's engine
    replies = {c.backend.id: f"from {c.backend.id} , one" for c in (x, y) if c.backend is not None}
    for first in (x, y):
        assert first.backend is not None
        home = first.backend.id
        follow = chat(
            [*HEAD, {"role": "assistant", "content": replies[home]}, {"role": "user", "content": "go"}]
        )
        await run(proxy, follow)
        assert follow.backend is not None and follow.backend.id == home
        routed = follow.affinity_key  # the endpoint's key stays; routing's own is told apart by the reply
        assert follow.key == chat_key(json.loads(follow.raw)) and follow.route_key is not None
        assert (follow.reason, routed) == (Reason.AFFINITY_HIT, reply_key(first.key, replies[home]))
        assert isinstance(proxy.store, MemoryAffinityStore)
        assert proxy.store.table.get(routed, 0.0) == home  # claimed: later turns are plain pins


async def test_a_session_id_keeps_its_key_on_every_turn() -> None:
    fake = FakeTransport()
    fake.script("http://a", streamed("x"), streamed("y"))
    fake.script("http://b", streamed("x"), streamed("y"))
    proxy, _ = v2_proxy(fake)
    ctx = chat([*HEAD, {"role": "assistant", "content": "x"}, {"role": "user", "content": "go"}],
               headers=[(b"x-session-id", b"s1")])  # fmt: skip
    ctx.key, ctx.identity = session_key("m", "s1"), Identity("header:x-session-id")  # as the endpoint keys it
    key = ctx.key
    await run(proxy, ctx)
    assert ctx.key == key and ctx.affinity_key == key


async def test_any_session_source_keeps_its_key_and_the_header_alone_does_not() -> None:
    """Learning reads what keyed the request (``ctx.identity``), not a header of its own: a body source
    counts as a session, and a session header the endpoint did not key by is just a header."""
    fake = FakeTransport()
    fake.script("http://a", streamed("x"), streamed("y"))
    fake.script("http://b", streamed("x"), streamed("y"))
    proxy, _ = v2_proxy(fake)
    turn2 = [*HEAD, {"role": "assistant", "content": "x"}, {"role": "user", "content": "go"}]
    named = chat(turn2)
    named.key = session_key("m", "pck", "body:prompt_cache_key")
    named.identity = Identity("body:prompt_cache_key")
    await run(proxy, named)
    assert named.route_key is None and named.affinity_key == named.key
    unnamed = chat(turn2, headers=[(b"x-session-id", b"s1")])
    await run(proxy, unnamed)
    assert unnamed.route_key == reply_key(unnamed.key, "x")


async def test_the_prefill_ledger_is_empty_once_requests_are_done() -> None:
    fake = FakeTransport()
    fake.script("http://a", streamed("one"), streamed("two"))
    fake.script("http://b", streamed("one"), streamed("two"))
    proxy, _ = v2_proxy(fake)
    for _ in range(2):
        await run(proxy, chat([{"role": "user", "content": "q" * 4000}]))
    assert [b.prefilling for b in proxy.registry.backends.values()] == [0, 0]


def observation(feedback: RoutingFeedback, **kw: Any) -> Observation:
    info = RouteInfo("head", kw.pop("first_turn", False), 40_000, 8000, uncached_tokens=5000)
    fields: dict[str, Any] = dict(backend="a", model="m", key="k", reason=Reason.NEW_CHEAPEST,
                                  outcome=RequestOutcome.OK, status=200, streamed=True, duration_s=3.0,
                                  first_byte_s=1.0, events=40, body_bytes=4000,
                                  usage=Usage(10_000, 41, 8000), route=info)  # fmt: skip
    fields.update(kw)
    return Observation(**fields)


def test_observations_teach_prefill_rates_and_the_turn_size() -> None:
    proxy = make_proxy(FakeTransport())
    clock = iter(range(100, 200))
    feedback = RoutingFeedback(proxy.registry, PARAMS, clock=lambda: float(next(clock)))
    for _ in range(20):
        feedback.observe(observation(feedback))  # 2000 uncached tokens in 1 s
    a, b = proxy.registry.backends["a"], proxy.registry.backends["b"]
    assert a.prefill_tps == pytest.approx(2000.0)
    assert b.prefill_tps == a.prefill_tps  # never measured: the fleet's rate per weight
    assert feedback.speeds.decode_tps["a"] == 50.0  # decode rates are not learned: nothing reads them
    # From 600 towards the 2000 uncached tokens of each follow-up, 5 % a sample.
    assert feedback.turn_tokens.value == pytest.approx(2000 - 1400 * 0.95**20)
    assert feedback.chars_per_token.value == pytest.approx(4.0)


def test_the_turn_size_is_what_a_follow_up_added_not_a_cold_re_prefill_of_its_history() -> None:
    proxy = make_proxy(FakeTransport())
    clock = iter(range(100, 200))
    feedback = RoutingFeedback(proxy.registry, PARAMS, clock=lambda: float(next(clock)))

    def follow_up(tail_chars: int, cached: int) -> Observation:
        info = RouteInfo("head", False, 40_000, 8000, tail_chars, uncached_tokens=5000)
        return observation(feedback, route=info, usage=Usage(10_000, 41, cached))

    # A cold re-prefill (an evicting engine): 9000 uncached, but the turn appended only its 2400-char tail
    # (600 tokens at the learned 4 characters a token): the conversation grew by 600.
    feedback.observe(follow_up(2400, 1000))
    assert feedback.turn_tokens.value == pytest.approx(600.0)
    # Warm: fewer uncached than the tail (its head was cached): those 200.
    feedback.observe(follow_up(2400, 9800))
    assert feedback.turn_tokens.value == pytest.approx(600 - 400 * 0.05)
    # No tail known (0): the uncached tokens, as before.
    before = feedback.turn_tokens.value
    feedback.observe(follow_up(0, 1000))
    assert feedback.turn_tokens.value == pytest.approx(before + 0.05 * (9000 - before))


def test_a_request_that_waited_behind_another_adds_only_the_engines_busy_time() -> None:
    # Two requests sent to "a" at 10 and 10.5; the engine prefilled 4000 tokens for the first (first byte at
    # 11) then 2000 for the second (first byte at 11.5). Both finish at 14, the second observed first.
    proxy = make_proxy(FakeTransport())
    feedback = RoutingFeedback(proxy.registry, PARAMS, clock=lambda: 14.0)
    second = observation(feedback, duration_s=3.5, first_byte_s=1.0, usage=Usage(10_000, 41, 8000))
    assert second.route is not None
    second.route.sent_at = 10.5
    feedback.observe(second)
    first = observation(feedback, duration_s=4.0, first_byte_s=1.0, usage=Usage(10_000, 41, 6000))
    assert first.route is not None
    first.route.sent_at = 10.0
    feedback.observe(first)
    # 6000 tokens in the 1.5 s the engine was busy: 4000 tok/s (each span alone said 2000 and 4000).
    assert feedback.speeds.refresh(now=15.0)
    assert feedback.speeds.prefill_tps["a"] == pytest.approx(4000.0)


def test_a_twin_observed_before_the_head_it_waited_behind_takes_only_its_own_prefill_time() -> None:
    # The head (2400 uncached tokens) sent to "a" at 10, first byte at 10.6; its twin (13 tokens, the head
    # cached) sent at 10.1, first byte at 10.62, its answer done first. Merged at the first bytes, the twin's
    # sample is its own 0.02 s, not the head's prefill.
    proxy = make_proxy(FakeTransport())
    now = [10.0]
    feedback = RoutingFeedback(proxy.registry, PARAMS, clock=lambda: now[0])
    head, twin = chat(HEAD), chat(HEAD)
    leases = []
    for ctx in (head, twin):
        feedback.plan(ctx)
        leases.append(lease := proxy.registry.lease("a"))
        feedback.sent(ctx, lease, 100)
        now[0] += 0.1
    for lease, at in zip(leases, (10.6, 10.62), strict=True):
        now[0] = at
        lease.first_byte()
    now[0] = 11.0
    twin_obs = observation(
        feedback, duration_s=0.9, first_byte_s=0.52, usage=Usage(2413, 41, 2400), route=twin.route
    )
    feedback.observe(twin_obs)
    sums = feedback.speeds._prefill["a"]
    assert sums.tokens == 13 and sums.seconds == pytest.approx(0.02)
    now[0] = 12.0
    feedback.observe(
        observation(feedback, duration_s=2.0, first_byte_s=0.6, usage=Usage(2400, 41, 0), route=head.route)
    )
    # (both decayed for 1 s)
    assert sums.tokens == pytest.approx(2413, rel=1e-2) and sums.seconds == pytest.approx(0.62, rel=1e-2)


def test_a_request_that_does_not_stream_is_not_timed_at_its_first_byte() -> None:
    # A plain JSON answer's first byte comes after its decode: no span from it.
    proxy = make_proxy(FakeTransport())
    feedback = RoutingFeedback(proxy.registry, PARAMS, clock=lambda: 10.0)
    ctx = chat(HEAD)
    assert ctx.body is not None
    ctx.body["stream"] = False
    feedback.plan(ctx)
    lease = proxy.registry.lease("a")
    feedback.sent(ctx, lease, 100)
    assert lease.on_first_byte is None


def test_rates_learned_within_the_refresh_interval_are_published_before_the_next_decision() -> None:
    # Two requests finish 0.1 s apart: the second one's sample is summed but not recomputed (within the
    # refresh interval), and no request finishes after it. The next decision (``conversations``, read before
    # every one) still sees it.
    proxy = make_proxy(FakeTransport())
    now = [100.0]
    feedback = RoutingFeedback(proxy.registry, PARAMS, clock=lambda: now[0])
    feedback.observe(observation(feedback, usage=Usage(10_000, 41, 8000)))  # 2000 tokens in 1 s
    a = proxy.registry.backends["a"]
    first = a.prefill_tps
    now[0] = 100.1
    feedback.observe(observation(feedback, usage=Usage(30_000, 41, 0)))  # 30000 tokens in 1 s
    assert a.prefill_tps == first  # summed, not yet published
    feedback.conversations()
    assert a.prefill_tps == first  # still within the refresh interval
    now[0] = 101.0
    feedback.conversations()
    assert a.prefill_tps == pytest.approx(feedback.speeds.prefill_tps["a"]) and a.prefill_tps > 2 * first


def test_failed_requests_and_answers_without_usage_teach_no_speed() -> None:
    proxy = make_proxy(FakeTransport())
    feedback = RoutingFeedback(proxy.registry, PARAMS)
    feedback.observe(observation(feedback, outcome=RequestOutcome.HTTP_5XX, first_byte_s=100.0))
    feedback.observe(observation(feedback, usage=None, first_byte_s=100.0))
    assert proxy.registry.backends["a"].prefill_tps == DEFAULT_PREFILL_TPS


def test_a_first_reply_is_indexed_and_a_holder_that_lost_the_head_is_dropped() -> None:
    proxy = make_proxy(FakeTransport())
    feedback = RoutingFeedback(proxy.registry, PARAMS)
    feedback.holders.add("head", "a")
    feedback.observe(observation(feedback, first_turn=True, reply="hello"))
    assert feedback.replies.get(reply_key("head", "hello"), 0.0) == "a"
    feedback.observe(observation(feedback, usage=Usage(10_000, 41, 16)))  # cached 16 of a 2000-token head
    assert feedback.holders.get("head") == frozenset()


async def test_explain_shows_the_costs_compared_and_changes_nothing() -> None:
    fake = FakeTransport()
    fake.script("http://a", streamed("one"))
    fake.script("http://b", streamed("one"))
    proxy, feedback = v2_proxy(fake)
    await run(proxy, first := chat(HEAD))
    assert first.backend is not None
    d = feedback.explain(chat(HEAD), None, None, POLICY)
    assert d.backend is not None and d.reason is Reason.NEW_CHEAPEST
    assert d.costs[0].backend == d.backend and {c.backend for c in d.costs} == {"a", "b"}
    assert "uncached tokens" in d.explain()[1]
    assert [b.prefilling for b in proxy.registry.backends.values()] == [0, 0]


async def test_completions_keep_their_pin_under_ttft() -> None:
    fake = FakeTransport()
    fake.script("http://a", *[Reply.json({"choices": [{"text": "x"}]}) for _ in range(4)])
    fake.script("http://b", *[Reply.json({"choices": [{"text": "x"}]}) for _ in range(4)])
    proxy, _ = v2_proxy(fake)
    seen = []
    for i in range(4):
        body = {"model": "m", "prompt": "The same long document. " * 40 + f"question {i}"}
        ctx = RequestContext(
            "POST", "/v1/completions", json.dumps(body).encode(), body, "m", "ck", POLICY, [], {}, COMPLETIONS
        )
        await run(proxy, ctx)
        assert ctx.backend is not None
        seen.append((ctx.backend.id, ctx.reason))
    assert len({b for b, _ in seen}) == 1
    assert [r for _, r in seen] == [Reason.NEW_CHEAPEST] + [Reason.AFFINITY_HIT] * 3


def test_a_backend_added_at_runtime_learns_too() -> None:
    proxy = make_proxy(FakeTransport())
    feedback = RoutingFeedback(proxy.registry, PARAMS)
    del feedback.speeds.weights["b"]  # as if "b" had been added after the feedback was built
    feedback.observe(observation(feedback, backend="b"))
    assert "b" in feedback.speeds.weights and proxy.registry.backends["b"].prefill_tps != DEFAULT_PREFILL_TPS


def test_a_follow_up_sent_home_teaches_its_backends_retention_and_others_do_not() -> None:
    proxy = make_proxy(FakeTransport())
    clock = iter(range(100, 200))
    feedback = RoutingFeedback(proxy.registry, PARAMS, clock=lambda: float(next(clock)))
    away = observation(feedback)  # went to "a", but its home was elsewhere: no evidence about "a"
    assert away.route is not None
    away.route.home = "b"
    feedback.observe(away)
    a = proxy.registry.backends["a"]
    assert a.retention == 1.0 and feedback.retention.retention == {}
    # Expected all 10,000 prompt tokens (no tail) cached at home; 5,000 were.
    home = observation(feedback, usage=Usage(10_000, 41, 5000))
    assert home.route is not None
    home.route.home = "a"
    feedback.observe(home)
    # (5000 held + the 4000-token prior) / (10000 expected + the prior), decayed one clock tick; published.
    assert a.retention == pytest.approx(9000 / 14_000, rel=1e-3)
    assert proxy.registry.candidates("m", {}, None, 0.0)[0].retention == a.retention


def session(i: int, messages: list[dict[str, Any]]) -> RequestContext:
    ctx = chat(messages, headers=[(b"x-session-id", f"s{i}".encode())])
    ctx.key, ctx.identity = session_key("m", f"s{i}"), Identity("header:x-session-id")  # as the endpoint does
    return ctx


async def test_new_sessions_go_in_turn_where_none_went_for_longest_and_follow_ups_mark_nothing() -> None:
    """Sessions one after another onto two equal engines: each new one goes to the engine given one least
    recently (by cost alone, each key's hash would pick between the equally loaded two). The proxy marks the
    backend when it sends a new conversation there; a follow-up leaves the mark as it was."""
    fake = FakeTransport()
    fake.script("http://a", *(streamed(f"a{i}") for i in range(8)))
    fake.script("http://b", *(streamed(f"b{i}") for i in range(8)))
    proxy, _ = v2_proxy(fake)
    placed = []
    for i in range(6):
        ctx = session(i, [*HEAD, {"role": "user", "content": f"task {i}"}])
        await run(proxy, ctx)
        assert ctx.backend is not None and ctx.reason is Reason.NEW_CHEAPEST
        placed.append(ctx.backend.id)
    assert placed[0] != placed[1] and placed[0::2] == [placed[0]] * 3 and placed[1::2] == [placed[1]] * 3
    marks = {b.id: b.placed_at for b in proxy.registry.backends.values()}
    assert marks[placed[0]] < marks[placed[1]]  # the latest new one went to placed[1]
    follow = session(4, [*HEAD, {"role": "user", "content": "task 4"}, {"role": "assistant", "content": "a2"},
                         {"role": "user", "content": "go"}])  # fmt: skip
    await run(proxy, follow)
    assert follow.reason is Reason.AFFINITY_HIT
    assert {b.id: b.placed_at for b in proxy.registry.backends.values()} == marks


class _SlowCommit(MemoryAffinityStore):
    """A store whose pin commit is a round trip (as Redis's): other requests run in between."""

    commit_is_round_trip = True

    async def commit(self, key: str, decision: Decision) -> str:
        for _ in range(5):
            await asyncio.sleep(0)
        return await super().commit(key, decision)


async def test_sessions_starting_while_a_pin_commit_is_in_flight_see_it_placed() -> None:
    """Two new sessions at once over a store whose commit awaits: the second is routed while the first's
    commit is in flight, before its lease counts it; the mark set at decision time sends it elsewhere."""
    fake = FakeTransport()
    fake.script("http://a", streamed("a0"), streamed("a1"))
    fake.script("http://b", streamed("b0"), streamed("b1"))
    settings, _, registry = backends_ab()
    store = _SlowCommit(settings.routing)
    feedback = RoutingFeedback(registry, PARAMS)
    proxy = make_proxy(fake, feedback, parts=(settings, store, registry))
    first, second = (session(i, [*HEAD, {"role": "user", "content": f"task {i}"}]) for i in range(2))
    await asyncio.gather(run(proxy, first), run(proxy, second))
    assert first.backend is not None and second.backend is not None
    assert {first.backend.id, second.backend.id} == {"a", "b"}


def test_the_conversations_competing_for_a_cache_are_those_whose_pause_is_typical() -> None:
    proxy = make_proxy(FakeTransport())
    now = [100.0]
    feedback = RoutingFeedback(proxy.registry, PARAMS, clock=lambda: now[0])
    a = proxy.registry.backends["a"]
    a.signals = EngineSignals(at=now[0], kv_capacity=16_000)  # the cost model reads them for such an engine
    assert a.competing == -1  # nothing published yet: the cost model counts the active ones
    feedback.observe(observation(feedback, key="k1"))
    feedback.observe(observation(feedback, key="k2"))
    feedback.pause_s.value = 0.5  # as learned: 4 pauses make a 2 s window, more than a generation
    assert feedback.conversations() == {"a": 2} and a.competing == 2
    assert proxy.registry.candidates("m", {}, None, now[0])[0].competing == 2
    now[0] += 3.0  # idle past 4 typical pauses: most likely finished; still active in the 10 s window
    assert feedback.conversations() == {"a": 2} and a.competing == 0
    assert proxy.registry.backends["b"].competing == 0


def test_without_an_engine_reporting_its_kv_cache_size_no_competing_ones_are_published() -> None:
    proxy = make_proxy(FakeTransport())
    now = [100.0]
    feedback = RoutingFeedback(proxy.registry, PARAMS, clock=lambda: now[0])
    a, b = proxy.registry.backends["a"], proxy.registry.backends["b"]
    a.signals = EngineSignals(at=now[0], waiting=0.0)  # signals, but no KV cache size
    feedback.observe(observation(feedback, key="k1"))
    feedback.observe(observation(feedback, key="k2"))
    feedback.pause_s.value = 0.5  # a window narrower than the table's: the generations would be walked
    assert feedback.conversations() == {"a": 2}
    assert a.competing == -1 and b.competing == -1  # nothing published: the cost model reads none
    assert proxy.registry.candidates("m", {}, None, now[0])[0].competing == -1
    b.signals = EngineSignals(at=now[0], kv_capacity=16_000)  # one engine reports it: all are published
    assert feedback.conversations() == {"a": 2} and a.competing == 2 and b.competing == 0


def test_the_typical_pause_is_learned_from_follow_ups_leaving_the_active_table() -> None:
    proxy = make_proxy(FakeTransport())
    now = [100.0]
    feedback = RoutingFeedback(proxy.registry, PARAMS, clock=lambda: now[0])
    prior = feedback.pause_s.value
    assert prior == PARAMS.active_window_s / 4  # before any: the whole window counts
    feedback.observe(observation(feedback, key="k"))
    now[0] += 0.5
    follow = chat([*HEAD, {"role": "assistant", "content": "x"}, {"role": "user", "content": "go"}])
    feedback.plan(follow)
    follow.route_key = "k"
    assert follow.route is not None and not follow.route.first_turn
    feedback.sent(follow, proxy.registry.lease("a"), 100)
    assert feedback.pause_s.value == pytest.approx(prior + 0.05 * (0.5 - prior))
    assert feedback.active.get("k", now[0]) is None  # in flight now
    first = chat(HEAD)  # a first turn has no pause before it
    feedback.plan(first)
    feedback.sent(first, proxy.registry.lease("a"), 100)
    assert feedback.pause_s.value == pytest.approx(prior + 0.05 * (0.5 - prior))
