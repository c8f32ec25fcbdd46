"""The ttft policy and its cost model, as plain functions of snapshots."""

from __future__ import annotations

import pytest

from routing.cost import cost, in_flight_load_s, rate, total_s, uncached_tokens
from routing.params import DEFAULT_PREFILL_TPS, RoutingParams
from routing.policies import make_policy
from routing.policies.ttft import TtftPolicy
from routing.types import BackendState, Candidate, PinAction, Reason, RouteRequest

READY = BackendState.READY
NOW = 1000.0


def cand(
    id_: str,
    *,
    active: int = 0,
    prefilling: int = 0,
    tps: float = 1000.0,
    waiting: int = -1,
    state: BackendState = READY,
    weight: float = 1.0,
) -> Candidate:
    return Candidate(id_, state, 0, active, weight, prefilling, tps, waiting)


def req(**kw: object) -> RouteRequest:
    fields: dict[str, object] = {"key": "k", "prompt_tokens": 3000, "head_tokens": 2000, "tail_tokens": 300}
    fields.update(kw)
    return RouteRequest(**fields)  # type: ignore[arg-type]


def policy(**kw: object) -> TtftPolicy:
    fields: dict[str, object] = {"policy": "ttft", "spill_factor": 2.0, "spill_min_in_flight": 8,
                                 "repin_on_spill": False}  # fmt: skip
    fields.update(kw)
    return TtftPolicy(RoutingParams(**fields))  # type: ignore[arg-type]


# -- cost model -------------------------------------------------------------------------------------------


def test_cost_is_queue_plus_uncached_plus_active_load_over_rate() -> None:
    c = cand("a", active=2, prefilling=500, tps=1000.0)
    got = cost(c, req(turn_tokens=600), load_share=1.0)
    assert got.uncached_tokens == 3000
    assert (got.queue_s, got.prefill_s, got.load_s) == (0.5, 3.0, 1.2)
    assert got.total_s == pytest.approx(4.7)
    assert total_s(c, req(turn_tokens=600), 1.0) == got.total_s


def test_the_requests_in_flight_bring_a_turn_each_to_the_load_term() -> None:
    # Two active between turns and three in flight: 5 x 600 tokens of load at 1000 tokens/s, load share 2;
    # the three in flight are 3.6 s of the 6.0.
    c = cand("a", active=2, tps=1000.0)._replace(in_flight=3)
    assert cost(c, req(turn_tokens=600), load_share=2.0).load_s == 6.0
    assert in_flight_load_s(c, req(turn_tokens=600), 2.0) == 3.6


def test_pinned_backend_reads_only_the_tail_a_head_holder_the_rest_after_the_head() -> None:
    r = req(pinned="p", holders=frozenset({"h"}))
    assert uncached_tokens(cand("p"), r) == 300
    assert uncached_tokens(cand("h"), r) == 1000
    assert uncached_tokens(cand("x"), r) == 3000


def test_the_twin_hint_holds_the_history_like_a_pin() -> None:
    assert uncached_tokens(cand("t"), req(hint="t")) == 300


def test_engine_reported_queue_counts_when_larger_than_our_own() -> None:
    r = req(turn_tokens=600)
    assert cost(cand("a", waiting=3, prefilling=100), r, 1.0).queue_s == pytest.approx(1.8)
    assert cost(cand("a", waiting=0, prefilling=100), r, 1.0).queue_s == pytest.approx(0.1)
    assert cost(cand("a", waiting=-1, prefilling=100), r, 1.0).queue_s == pytest.approx(0.1)


def test_unknown_rate_is_the_weight_times_the_default() -> None:
    assert rate(cand("a", tps=0.0, weight=2.0)) == 2 * DEFAULT_PREFILL_TPS


# -- decisions --------------------------------------------------------------------------------------------


def test_new_conversation_goes_to_the_cheapest_and_claims() -> None:
    d = policy().select([cand("a", active=3), cand("b", active=1), cand("c", active=2)], req(), NOW)
    assert (d.backend, d.reason, d.pin, d.uncached_tokens) == (
        "b",
        Reason.NEW_CHEAPEST,
        PinAction.CLAIM,
        3000,
    )


def test_idle_pins_are_not_load_only_active_conversations_are() -> None:
    # conversations = active ones (the gateway's snapshot); the empty newcomer is not flooded because the
    # others' *active* count is what it is compared with, and one more conversation there makes it equal.
    p = policy()
    cands = [cand("old", active=1), cand("new", active=0)]
    assert p.select(cands, req(), NOW).backend == "new"
    cands = [cand("old", active=1), cand("new", active=2)]
    assert p.select(cands, req(), NOW).backend == "old"


def test_faster_engine_wins_a_cold_prompt() -> None:
    d = policy().select([cand("slow", tps=1000.0), cand("fast", tps=4000.0)], req(), NOW)
    assert d.backend == "fast"


def test_head_holder_beats_an_idle_cold_engine_while_its_queue_is_short() -> None:
    r = req(holders=frozenset({"h"}))
    assert policy().select([cand("h", active=1), cand("x")], r, NOW).backend == "h"


def test_twins_spread_when_the_head_holder_is_busy_prefilling() -> None:
    # A twin of a head being prefilled on "h" waits for it there (2000 tokens queued) plus its load.
    r = req(prompt_tokens=2000, head_tokens=2000, tail_tokens=2000, holders=frozenset({"h"}))
    d = policy().select([cand("h", active=1, prefilling=2000), cand("x")], r, NOW)
    assert (d.backend, d.reason) == ("x", Reason.NEW_CHEAPEST)


def test_pinned_stays_while_not_much_dearer() -> None:
    d = policy().select([cand("p", active=2), cand("x")], req(pinned="p"), NOW)
    assert (d.backend, d.reason, d.pin, d.uncached_tokens) == ("p", Reason.AFFINITY_HIT, PinAction.TOUCH, 300)


def test_twin_hint_stays_and_claims_the_extended_key() -> None:
    d = policy().select([cand("t"), cand("x")], req(hint="t"), NOW)
    assert (d.backend, d.reason, d.pin) == ("t", Reason.AFFINITY_HIT, PinAction.CLAIM)


def test_transient_queue_spills_one_turn_and_keeps_the_pin() -> None:
    # The pin's own cost (300 tokens, no load) beats a cold prefill elsewhere; only its queue does not.
    d = policy().select([cand("p", prefilling=20_000), cand("x")], req(pinned="p"), NOW)
    assert (d.backend, d.reason, d.pin) == ("x", Reason.SPILL_OVERLOAD, PinAction.NONE)


def test_a_spill_pays_its_prefill_there_twice_and_the_re_read_of_its_tail_at_home() -> None:
    # Home "p" holds the history (300 tokens to read), "x" the head (1000 to read), both otherwise idle.
    r = req(pinned="p", holders=frozenset({"x"}))
    # Home's queue 4000 tokens: 4.3 s at home; 1 s there + 1 s of the wait it adds there + the tail's 0.3 s
    # read again at home next turn + the 60 % margin (2.58 s) = 4.88 s: stays (by its own wait alone it went).
    d = policy().select([cand("p", prefilling=4000), cand("x")], r, NOW)
    assert (d.backend, d.reason, d.pin) == ("p", Reason.AFFINITY_HIT, PinAction.TOUCH)
    # Twice that queue (8.3 s at home against 2.3 s + 4.98 s): a spill, the pin kept.
    d = policy().select([cand("p", prefilling=8000), cand("x")], r, NOW)
    assert (d.backend, d.reason, d.pin) == ("x", Reason.SPILL_OVERLOAD, PinAction.NONE)


def test_many_active_conversations_without_a_queue_now_do_not_move_the_pin() -> None:
    # This turn is fastest at home; the load term places new conversations, it moves no pin.
    d = policy().select([cand("p", active=20), cand("x")], req(pinned="p"), NOW)
    assert (d.backend, d.reason) == ("p", Reason.AFFINITY_HIT)


def test_structural_overload_moves_the_pin() -> None:
    cands = [cand("p", active=20, prefilling=20_000), cand("x")]
    d = policy().select(cands, req(pinned="p", turn_tokens=600), NOW)
    assert (d.backend, d.reason, d.pin, d.uncached_tokens) == ("x", Reason.MOVE_CHEAPER, PinAction.MOVE, 3000)


def test_a_move_pays_its_prefill_there_twice() -> None:
    # Home "p" busier in the long run (2 other active conversations) with a 10000-token queue: 10.3 s; "x"
    # 3 s there + the 2.7 s it reads there beyond home's 300 tokens, once more (the wait it adds there) +
    # the 60 % margin (6.18 s) = 11.88 s: stays (by its own wait alone it moved).
    d = policy().select([cand("p", active=3, prefilling=10_000), cand("x")], req(pinned="p"), NOW)
    assert (d.backend, d.reason, d.pin) == ("p", Reason.AFFINITY_HIT, PinAction.TOUCH)
    d = policy().select([cand("p", active=3, prefilling=20_000), cand("x")], req(pinned="p"), NOW)
    assert (d.backend, d.reason, d.pin) == ("x", Reason.MOVE_CHEAPER, PinAction.MOVE)


def test_moving_a_twin_hint_claims_instead_of_moving() -> None:
    d = policy().select([cand("t", active=20, prefilling=20_000), cand("x")], req(hint="t"), NOW)
    assert (d.reason, d.pin) == (Reason.MOVE_CHEAPER, PinAction.CLAIM)


def test_pinned_down_repins_to_the_cheapest() -> None:
    cands = [cand("p", state=BackendState.DOWN), cand("x", active=1), cand("y")]
    d = policy().select(cands, req(pinned="p"), NOW)
    assert (d.backend, d.reason, d.pin) == ("y", Reason.REPIN_UNHEALTHY, PinAction.MOVE)


def test_pinned_removed_repins() -> None:
    d = policy().select([cand("x")], req(pinned="gone"), NOW)
    assert (d.backend, d.reason, d.pin) == ("x", Reason.REPIN_REMOVED, PinAction.MOVE)


def test_retry_skips_the_failed_and_moves_the_pin_off_it() -> None:
    d = policy().select([cand("p"), cand("x")], req(pinned="p", exclude=frozenset({"p"})), NOW)
    assert (d.backend, d.reason, d.pin) == ("x", Reason.RETRY_NEXT, PinAction.MOVE)
    d = policy().select([cand("p"), cand("x")], req(pinned="p", exclude=frozenset({"x"})), NOW)
    assert (d.backend, d.reason, d.pin) == ("p", Reason.RETRY_NEXT, PinAction.NONE)


def test_nothing_routable_is_no_backend() -> None:
    d = policy().select([cand("a", state=BackendState.DRAINING)], req(), NOW)
    assert (d.backend, d.reason) == (None, Reason.NO_BACKEND)


def test_explain_lists_every_cost_cheapest_first_and_only_when_asked() -> None:
    cands = [cand("a", active=3), cand("b")]
    assert policy().select(cands, req(), NOW).costs == ()
    d = policy().select(cands, req(explain=True), NOW)
    assert [c.backend for c in d.costs] == ["b", "a"]
    assert d.costs[0].total_s == pytest.approx(3.0)
    assert d.explain()[0] == "-> b (new_cheapest, pin claim)"
    assert d.explain()[1].startswith("b: 3000 ms = queue 0 + prefill 3000 (3000 uncached tokens) + load 0")


def test_ttft_is_in_the_policy_table() -> None:
    p = make_policy(RoutingParams("ttft", 2.0, 8, False))
    assert isinstance(p, TtftPolicy) and p.uses_affinity


# -- new conversations started close together: spread in turn ------------------------------------------


def placed(c: Candidate, at: float) -> Candidate:
    return c._replace(placed_at=at)


def test_a_new_conversation_goes_to_the_backend_given_one_least_recently_among_near_equals() -> None:
    # "a" is a few ms cheaper (prefilling 5 tokens less), but was given a new conversation just now.
    cands = [placed(cand("a", prefilling=1000), NOW), placed(cand("b", prefilling=1005), NOW - 1.0)]
    d = policy().select(cands, req(), NOW)
    assert (d.backend, d.reason, d.pin) == ("b", Reason.NEW_CHEAPEST, PinAction.CLAIM)


def test_beyond_the_spread_margin_the_cheapest_wins_however_recently_it_was_given_one() -> None:
    # 4.0 s against 4.3 s: dearer by more than the margin (5 % of the cheapest, and 20 ms).
    cands = [placed(cand("a", prefilling=1000), NOW), placed(cand("b", prefilling=1300), NOW - 60.0)]
    assert policy().select(cands, req(), NOW).backend == "a"
    # On a cheap request the 20 ms floor: 30 ms dearer of 0.1 s is beyond it, 15 ms is not.
    small = req(prompt_tokens=100, head_tokens=0, tail_tokens=100)
    cands = [placed(cand("a"), NOW), placed(cand("b", prefilling=30), NOW - 60.0)]
    assert policy().select(cands, small, NOW).backend == "a"
    cands = [placed(cand("a"), NOW), placed(cand("b", prefilling=15), NOW - 60.0)]
    assert policy().select(cands, small, NOW).backend == "b"


def test_never_given_one_counts_as_least_recent_and_equal_recency_goes_by_cost_then_hash() -> None:
    cands = [placed(cand("a"), NOW), cand("b", prefilling=10)]  # b: never (placed_at -inf)
    assert policy().select(cands, req(), NOW).backend == "b"
    both = [placed(cand("a", prefilling=10), NOW), placed(cand("b"), NOW)]
    assert policy().select(both, req(), NOW).backend == "b"  # equally recent: the cheaper
    tied = [cand("a"), cand("b")]
    picks = {policy().select(tied, req(key=f"k{i}"), NOW).backend for i in range(20)}
    assert picks == {"a", "b"}  # equal in everything: the per-key rendezvous hash


def test_a_burst_of_new_conversations_alternates_over_equal_backends() -> None:
    """Eight sessions arriving 10 ms apart onto two idle engines, each queueing its prefill where it goes
    (as the gateway's ledger does): the placements alternate, so consecutive starters never share one. (By
    cost alone the third would join the second, whose prompt is 10 tokens shorter: then the fourth the
    first, and so on: which sessions share an engine decided by a few tokens of their prompts.)"""
    p = policy()
    state = {"a": cand("a"), "b": cand("b")}
    order = []
    for i in range(8):
        now = NOW + 0.01 * i
        r = req(key=f"session-{i}", prompt_tokens=3010 if i % 2 == 0 else 3000)
        d = p.select(list(state.values()), r, now)
        assert d.backend is not None and d.reason is Reason.NEW_CHEAPEST
        c = state[d.backend]
        state[d.backend] = c._replace(in_flight=c.in_flight + 1, prefilling=c.prefilling + r.prompt_tokens,
                                      placed_at=now)  # fmt: skip
        order.append(d.backend)
    assert order[0::2] == [order[0]] * 4 and order[1::2] == [order[1]] * 4 and order[0] != order[1]


def test_a_pinned_conversation_is_not_moved_by_recency() -> None:
    cands = [placed(cand("p"), NOW), placed(cand("x"), NOW - 100.0)]
    d = policy().select(cands, req(pinned="p"), NOW)
    assert (d.backend, d.reason) == ("p", Reason.AFFINITY_HIT)


def test_a_repin_takes_the_cheapest_not_the_least_recent() -> None:
    down = cand("p", state=BackendState.DOWN)
    cands = [down, placed(cand("a"), NOW), placed(cand("b", prefilling=5), NOW - 100.0)]
    d = policy().select(cands, req(pinned="p"), NOW)
    assert (d.backend, d.reason) == ("a", Reason.REPIN_UNHEALTHY)
