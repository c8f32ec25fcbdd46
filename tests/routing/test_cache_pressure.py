"""Cache pressure in the cost model: learned retention, engines' own cached-token estimates, KV cache sizes,
the estimator."""

from __future__ import annotations

import pytest

from routing.cost import (
    cached_tokens,
    cost,
    load_tokens,
    lost_history,
    overflow_tokens,
    pressure_tokens,
    sharing,
    total_s,
)
from routing.params import RoutingParams
from routing.policies.ttft import TtftPolicy
from routing.retention import RetentionEstimator
from routing.types import BackendState, Candidate, PinAction, Reason, RouteRequest

READY = BackendState.READY


def cand(
    id_: str, *, active: int = 0, retention: float = 1.0, tps: float = 1000.0, capacity: int = 0
) -> Candidate:
    return Candidate(id_, READY, 0, active, 1.0, 0, tps, -1, retention, capacity)


def req(**kw: object) -> RouteRequest:
    fields: dict[str, object] = {"key": "k", "prompt_tokens": 3000, "head_tokens": 2000, "tail_tokens": 300}
    fields.update(kw)
    return RouteRequest(**fields)  # type: ignore[arg-type]


POLICY = TtftPolicy(RoutingParams("ttft", 2.0, 8, False))


def test_retention_scales_what_a_pin_and_a_head_holder_are_inferred_to_hold() -> None:
    r = req(pinned="a", holders=frozenset({"b"}))
    assert cached_tokens(cand("a", retention=0.5), r) == 1350  # (3000 - 300) x 0.5
    assert cached_tokens(cand("b", retention=0.25), r) == 500  # the 2000-token head x 0.25
    assert cached_tokens(cand("a"), r) == 2700  # full retention: as before
    assert cached_tokens(cand("c", retention=0.5), r) == 0


def test_retention_is_not_in_the_load_term() -> None:
    r = req(turn_tokens=600)
    c = cand("a", active=2, retention=0.5)
    assert cost(c, r, 2.0).load_s == pytest.approx(2 * 600 * 2.0 / 1000)
    assert total_s(c, r, 2.0) == cost(c, r, 2.0).total_s


def test_engine_reported_cached_tokens_are_taken_at_their_word() -> None:
    # The engine's own index says the pin lost the history and another engine holds most of it.
    r = req(pinned="a", kv_held=(("a", 0), ("b", 2500)))
    assert cached_tokens(cand("a"), r) == 0
    assert cached_tokens(cand("b", retention=0.1), r) == 2500  # no retention discount on an engine's word
    assert cached_tokens(cand("c"), r) == 0  # not listed: inferred (holds nothing known)
    clipped = req(kv_held=(("a", 10**9), ("b", -5)))
    assert (cached_tokens(cand("a"), clipped), cached_tokens(cand("b"), clipped)) == (3000, 0)


def test_a_pin_whose_engine_evicted_the_prefix_is_cold_and_the_turn_goes_where_it_is_held() -> None:
    r = req(
        pinned="a",
        prompt_tokens=20_000,
        tail_tokens=500,
        head_tokens=1000,
        kv_held=(("a", 0), ("b", 19_000)),
    )
    d = POLICY.select([cand("a"), cand("b")], r, 0.0)
    assert (d.backend, d.uncached_tokens) == ("b", 1000)
    assert d.reason in (Reason.SPILL_OVERLOAD, Reason.MOVE_CHEAPER)


def test_a_twin_goes_past_a_head_holder_that_evicts() -> None:
    # Both hold the head; the one that keeps what it is sent is cheaper for the twin.
    r = req(key="k", holders=frozenset({"tight", "roomy"}))
    d = POLICY.select([cand("tight", retention=0.3), cand("roomy")], r, 0.0)
    assert (d.backend, d.reason, d.pin, d.uncached_tokens) == (
        "roomy",
        Reason.NEW_CHEAPEST,
        PinAction.CLAIM,
        1000,
    )


def test_a_follow_up_at_an_evicting_home_stays_when_elsewhere_is_no_cheaper() -> None:
    # Half evicted at home still beats a cold prefill anywhere else.
    d = POLICY.select([cand("a", retention=0.5), cand("b")], req(pinned="a"), 0.0)
    assert (d.backend, d.reason, d.uncached_tokens) == ("a", Reason.AFFINITY_HIT, 3000 - 1350)


def test_retention_is_held_over_expected_with_a_full_prior_and_decays_back() -> None:
    est = RetentionEstimator(half_life_s=10.0, prior_tokens=1000.0)
    est.sample("a", expected=3000, held=0, now=0.0)
    assert est.retention["a"] == pytest.approx(1000 / 4000)
    est.sample("a", expected=3000, held=3000, now=0.0)
    assert est.retention["a"] == pytest.approx(4000 / 7000)
    est.sample("b", expected=1000, held=5000, now=0.0)  # more than expected counts as all of it
    assert est.retention["b"] == 1.0
    est.sample("b", expected=1000, held=800, now=0.0)  # within the estimate's noise: all of it too
    assert est.retention["b"] == 1.0
    est.sample("d", expected=1000, held=790, now=0.0)  # below: evidence of eviction
    assert est.retention["d"] == pytest.approx((790 + 1000) / 2000)
    est.sample("c", expected=0.5, held=0, now=0.0)  # nothing was expected: no evidence
    assert "c" not in est.retention
    est.refresh(now=10.0)  # one half-life: the evidence weighs half
    assert est.retention["a"] == pytest.approx((1500 + 1000) / (3000 + 1000))
    est.refresh(now=1000.0)
    assert est.retention["a"] == pytest.approx(1.0)


def test_retention_estimator_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        RetentionEstimator(half_life_s=0)
    with pytest.raises(ValueError):
        RetentionEstimator(prior_tokens=0)


def test_a_pin_is_never_inferred_to_hold_more_than_its_kv_cache() -> None:
    r = req(pinned="a")
    assert cached_tokens(cand("a", capacity=1000), r) == 1000
    assert cached_tokens(cand("a", capacity=1000, retention=0.5), r) == 500
    assert cached_tokens(cand("a", capacity=0), r) == 2700  # unknown size: no limit
    assert not lost_history(cand("a", capacity=1000), r)  # lost is the engine's word alone (KV events)
    assert cached_tokens(cand("a", capacity=10), req(pinned="a", kv_held=(("a", 2000),))) == 2000  # its word


def test_overflow_is_what_this_conversation_adds_beyond_the_cache_at_most_its_size() -> None:
    r = req(prompt_tokens=3000, turn_tokens=600)  # about 3600 tokens each
    assert overflow_tokens(cand("a", active=3, capacity=16_000), r) == 0  # 4 x 3600 fit
    assert overflow_tokens(cand("a", active=4, capacity=16_000), r) == 2000
    assert overflow_tokens(cand("a", active=9, capacity=16_000), r) == 3600  # never more than its own size
    assert overflow_tokens(cand("a", active=9, capacity=0), r) == 0  # unknown size: no pressure
    in_flight = Candidate("a", READY, 4, 0, 1.0, 0, 1000.0, -1, 1.0, 16_000)
    assert overflow_tokens(in_flight, r) == 2000  # requests in flight hold KV blocks too
    c = cand("a", active=4, capacity=16_000)
    assert cost(c, r, 2.0).load_s == pytest.approx((4 * 600 + 5 * 2000) * 2.0 / 1000)  # pressure: all 5
    assert total_s(c, r, 2.0) == cost(c, r, 2.0).total_s


def test_cache_pressure_is_the_overflow_every_conversation_sharing_the_cache_re_prefills() -> None:
    r = req(prompt_tokens=3000, turn_tokens=600)  # about 3600 tokens each
    assert pressure_tokens(cand("a", active=3, capacity=16_000), r) == 0  # 4 x 3600 fit
    assert pressure_tokens(cand("a", active=4, capacity=16_000), r) == 5 * 2000  # each loses the overflow
    assert pressure_tokens(cand("a", active=9, capacity=16_000), r) == 10 * 3600  # each at most its size
    assert pressure_tokens(cand("a", active=9, capacity=0), r) == 0  # unknown size: no pressure
    assert pressure_tokens(cand("a", active=0, capacity=3000), r) == 600  # alone: only what does not fit
    assert pressure_tokens(cand("a", active=1, capacity=3000), r) == 2 * 3600  # two: both cold
    for active, capacity in ((0, 0), (3, 16_000), (4, 16_000), (9, 16_000), (1, 3000)):
        c = cand("a", active=active, capacity=capacity)
        load = (active * 600 + pressure_tokens(c, r)) * 2.0 / 1000
        assert cost(c, r, 2.0).load_s == pytest.approx(load)
        assert total_s(c, r, 2.0) == cost(c, r, 2.0).total_s


def test_a_new_conversation_goes_where_the_cache_holds_it_not_beside_conversations_it_would_thrash() -> None:
    # A large cache with 4 conversations (a 5th overflows it by 2000: all 5 re-prefill that each round,
    # 10,000) against a small one with 2 (cold there anyway: 3 x 3600): the small engine's cold turns cost
    # less than thrashing the large one. Charged only the arriving one's overflow (2000 against 3600) the
    # large engine looked cheaper.
    r = req(prompt_tokens=3000, turn_tokens=600)
    small = cand("small", active=2, capacity=3000)._replace(competing=2)
    large = cand("large", active=4, capacity=16_000)._replace(competing=4)
    assert (pressure_tokens(small, r), pressure_tokens(large, r)) == (3 * 3600, 5 * 2000)
    assert overflow_tokens(large, r) + 4 * 600 < overflow_tokens(small, r) + 2 * 600
    d = POLICY.select([small, large], r, 0.0)
    assert (d.backend, d.reason, d.pin) == ("small", Reason.NEW_CHEAPEST, PinAction.CLAIM)
    # With 3 on the large one a 4th fits: it goes there.
    roomy = large._replace(conversations=3, competing=3)
    assert POLICY.select([small, roomy], r, 0.0).backend == "large"


def test_a_new_conversation_goes_to_the_engine_with_room_not_one_whose_cache_is_full() -> None:
    r = req(prompt_tokens=3000, turn_tokens=600)
    full, roomy = cand("full", active=2, capacity=8000), cand("roomy", active=3, capacity=16_000)
    d = POLICY.select([full, roomy], r, 0.0)
    assert (d.backend, d.reason, d.pin) == ("roomy", Reason.NEW_CHEAPEST, PinAction.CLAIM)
    # Without the sizes the one with fewer conversations wins, as before.
    d = POLICY.select([full._replace(kv_capacity=0), roomy._replace(kv_capacity=0)], r, 0.0)
    assert d.backend == "full"


def test_a_pin_whose_cache_holds_little_of_the_history_stays_unless_elsewhere_is_cheaper_now() -> None:
    # Home's cache holds 900 of the 4400-token history: the turn is nearly cold there, but cold elsewhere
    # too; a queue at home moves it only beyond the stay margin.
    r = req(pinned="a", prompt_tokens=5000, tail_tokens=600, head_tokens=1000, turn_tokens=600)
    home = Candidate("a", READY, 0, 1, 1.0, 400, 1000.0, -1, 1.0, 900)
    other = cand("b", active=1, capacity=16_000)
    assert cost(home, r, 2.0).uncached_tokens == 4100
    d = POLICY.select([home, other], r, 0.0)
    assert (d.backend, d.reason, d.pin) == ("a", Reason.AFFINITY_HIT, PinAction.TOUCH)
    # (A move also pays the 900 tokens it reads there beyond home once more: 10000 queued no longer moves it.)
    d = POLICY.select([home._replace(prefilling=12_000), other], r, 0.0)
    assert d.backend == "b" and d.reason in (Reason.SPILL_OVERLOAD, Reason.MOVE_CHEAPER)


def test_a_turn_leaving_a_home_that_evicted_it_goes_where_it_fits_not_where_it_evicts() -> None:
    # Home's events say it evicted the history (cold there, no margin). "full" has the shorter queue but
    # no room: arriving there evicts a conversation's worth, paid in the move; "roomy" does not.
    r = req(pinned="a", prompt_tokens=3000, tail_tokens=300, turn_tokens=600, kv_held=(("a", 0),))
    home = Candidate("a", READY, 0, 2, 1.0, 3000, 1000.0, -1, 1.0, 16_000)
    full = Candidate("full", READY, 0, 4, 1.0, 0, 1000.0, -1, 1.0, 14_000)
    roomy = Candidate("roomy", READY, 0, 1, 1.0, 500, 1000.0, -1, 1.0, 16_000)
    assert overflow_tokens(full, r) == 3600 and overflow_tokens(roomy, r) == 0
    d = POLICY.select([home, full, roomy], r, 0.0)
    assert (d.backend, d.reason, d.pin) == ("roomy", Reason.MOVE_CHEAPER, PinAction.MOVE)
    # Where no other engine has room, the cold turn waits at home (which has) rather than evict elsewhere;
    # without the sizes it would leave for the shorter queue.
    d = POLICY.select([home, full, roomy._replace(kv_capacity=3000)], r, 0.0)
    assert (d.backend, d.reason) == ("a", Reason.AFFINITY_HIT)
    unsized = [c._replace(kv_capacity=0) for c in (home, full, roomy)]
    assert POLICY.select(unsized, r, 0.0).backend != "a"


def test_the_conversations_competing_for_the_cache_replace_the_active_ones_when_known() -> None:
    r = req(prompt_tokens=3000, turn_tokens=600)  # about 3600 tokens each
    # 6 active, finished ones among them; only 2 still compete: 3 x 3600 fit in 16,000.
    lingering = cand("a", active=6, capacity=16_000)
    assert sharing(lingering, r) == 7 and overflow_tokens(lingering, r) == 3600
    recent = lingering._replace(competing=2)
    assert sharing(recent, r) == 3 and overflow_tokens(recent, r) == 0
    assert total_s(recent, r, 2.0) == cost(recent, r, 2.0).total_s
    # The load term too: the 2 still competing bring their next turns, not the 4 finished ones lingering.
    assert cost(recent, r, 2.0).load_s == pytest.approx(2 * 600 * 2.0 / 1000)
    assert cost(lingering, r, 2.0).load_s == pytest.approx((6 * 600 + 7 * 3600) * 2.0 / 1000)  # unknown: all
    flying = recent._replace(in_flight=2)
    assert sharing(flying, r) == 5 and overflow_tokens(flying, r) == 2000  # in flight hold KV blocks too


def test_a_home_already_counts_its_own_conversation_among_the_competing_ones() -> None:
    c = cand("a", active=5, capacity=16_000)._replace(competing=4)
    assert sharing(c, req(pinned="a")) == 4  # this conversation is one of the 4
    assert sharing(c, req(hint="a")) == 4
    assert sharing(c, req(pinned="b")) == 5  # elsewhere it would be one more
    assert sharing(c._replace(competing=0), req(pinned="a")) == 1  # idle for long: not counted, so added
    # Without competing counts the policy passes a home's conversations without this one: +1 as before.
    assert sharing(cand("a", active=3), req(pinned="a")) == 4


def test_a_new_conversation_skips_a_large_cache_full_only_of_finished_conversations_no_more() -> None:
    r = req(prompt_tokens=3000, turn_tokens=600)
    small = cand("small", active=1, capacity=3000)._replace(competing=1)
    large = cand("large", active=6, capacity=16_000)
    # Every active one counted: the large cache looks full too, and the small one's lighter load wins.
    assert POLICY.select([small, large._replace(competing=-1)], r, 0.0).backend == "small"
    # Only 2 of its 6 still compete: it has room.
    d = POLICY.select([small, large._replace(competing=2)], r, 0.0)
    assert (d.backend, d.reason) == ("large", Reason.NEW_CHEAPEST)


def test_the_load_term_counts_the_others_sharing_the_cache_not_the_lingering_active_ones() -> None:
    r = req(prompt_tokens=3000, turn_tokens=600)  # 3600 each: 4 fit in 16,000
    big = 16_000
    # Unknown competing counts: every active one and those in flight, as before.
    unknown = cand("a", active=5, capacity=big)._replace(in_flight=1)
    assert load_tokens(unknown, r) == 6 * 600 + pressure_tokens(unknown, r)
    # Known: the competing ones and those in flight; the 8 active include finished ones.
    known = cand("a", active=8, capacity=big)._replace(competing=1, in_flight=1)
    assert load_tokens(known, r) == 2 * 600 and pressure_tokens(known, r) == 0
    # At home this conversation is one of the competing ones: not its own load.
    assert load_tokens(known, req(prompt_tokens=3000, turn_tokens=600, pinned="a")) == 1 * 600
    assert load_tokens(known, req(prompt_tokens=3000, turn_tokens=600, hint="a")) == 1 * 600
    # A home it is not counted in (idle for longer than the competing window): the others only.
    idle = known._replace(competing=0)
    assert load_tokens(idle, req(prompt_tokens=3000, turn_tokens=600, pinned="a")) == 1 * 600
    # Over capacity the pressure comes on top: 6 sharing x 3600 = 21,600, over by 5600 > a size.
    full = known._replace(competing=4)
    assert load_tokens(full, r) == 5 * 600 + 6 * 3600
    for c in (unknown, known, idle, full):
        for rr in (r, req(prompt_tokens=3000, turn_tokens=600, pinned="a")):
            assert total_s(c, rr, 2.0) == cost(c, rr, 2.0).total_s
            assert cost(c, rr, 2.0).load_s == pytest.approx(load_tokens(c, rr) * 2.0 / 1000)


def test_a_new_conversation_goes_where_fewer_still_run_not_where_fewer_were_active_lately() -> None:
    # "quick" finished 6 of its 7 active conversations (they linger in the active window); "slow" still
    # runs both of its 2. Caches large enough for all: the load term alone decides.
    r = req(prompt_tokens=3000, turn_tokens=600)
    quick = cand("quick", active=7, capacity=200_000)._replace(competing=1)
    slow = cand("slow", active=2, capacity=200_000)._replace(competing=2)
    d = POLICY.select([quick, slow], r, 0.0)
    assert (d.backend, d.reason, d.pin) == ("quick", Reason.NEW_CHEAPEST, PinAction.CLAIM)
    # Without competing counts (no engine reports its cache size) the active ones decide, as before.
    unknown = [c._replace(competing=-1, kv_capacity=0) for c in (quick, slow)]
    assert POLICY.select(unknown, r, 0.0).backend == "slow"
