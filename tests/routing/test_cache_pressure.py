"""Cache pressure in the cost model: learned retention, engines' own cached-token estimates, the estimator."""

from __future__ import annotations

import pytest

from routing.cost import cached_tokens, cost, total_s
from routing.params import RoutingParams
from routing.policies.ttft import TtftPolicy
from routing.retention import RetentionEstimator
from routing.types import BackendState, Candidate, PinAction, Reason, RouteRequest

READY = BackendState.READY


def cand(id_: str, *, active: int = 0, retention: float = 1.0, tps: float = 1000.0) -> Candidate:
    return Candidate(id_, READY, 0, active, 1.0, 0, tps, -1, retention)


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
    r = req(pinned="a", engine_cached={"a": 0, "b": 2500})
    assert cached_tokens(cand("a"), r) == 0
    assert cached_tokens(cand("b", retention=0.1), r) == 2500  # no retention discount on an engine's word
    assert cached_tokens(cand("c"), r) == 0  # not listed: inferred (holds nothing known)
    clipped = req(engine_cached={"a": 10**9, "b": -5})
    assert (cached_tokens(cand("a"), clipped), cached_tokens(cand("b"), clipped)) == (3000, 0)


def test_a_pin_whose_engine_evicted_the_prefix_is_cold_and_the_turn_goes_where_it_is_held() -> None:
    r = req(
        pinned="a",
        prompt_tokens=20_000,
        tail_tokens=500,
        head_tokens=1000,
        engine_cached={"a": 0, "b": 19_000},
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
