"""Learned engine speed: decayed sums with the configured weight as the prior."""

from __future__ import annotations

import pytest

from routing.params import DEFAULT_PREFILL_TPS
from routing.speed import Ewma, SpeedEstimator


def test_before_any_sample_the_rate_is_the_weight_times_the_default() -> None:
    s = SpeedEstimator({"a": 1.0, "b": 2.0})
    assert s.prefill_tps == {"a": DEFAULT_PREFILL_TPS, "b": 2 * DEFAULT_PREFILL_TPS}


def test_samples_pull_the_rate_from_the_prior_towards_what_was_measured() -> None:
    # The prior: ``prior_tokens`` at weight x the fleet's measured rate per unit of weight.
    s = SpeedEstimator({"a": 1.0, "b": 1.0}, half_life_s=10.0, prior_tokens=1000.0)
    s.prefill("a", 9000, 9.0, now=0.0)  # 1000 tok/s, on plenty of evidence
    s.prefill("b", 1000, 0.25, now=0.0)  # 4000 tok/s, on little
    reference = 10_000 / 9.25
    assert s.prefill_tps["a"] == pytest.approx(10_000 / (9.0 + 1000 / reference))
    assert s.prefill_tps["b"] == pytest.approx(2000 / (0.25 + 1000 / reference))
    assert 1000 < s.prefill_tps["a"] < s.prefill_tps["b"] < 4000


def test_unweighted_engines_learn_their_true_ratio() -> None:
    s = SpeedEstimator({"a": 1.0, "b": 1.0}, half_life_s=30.0, prior_tokens=500.0)
    for t in range(20):
        s.prefill("a", 2000, 2.0, now=float(t))  # 1000 tok/s
        s.prefill("b", 2000, 0.5, now=float(t))  # 4000 tok/s
    ratio = s.prefill_tps["b"] / s.prefill_tps["a"]
    assert 3.5 < ratio < 4.0


def test_an_engine_that_slows_down_is_seen_within_a_few_half_lives() -> None:
    s = SpeedEstimator({"a": 1.0}, half_life_s=5.0, prior_tokens=500.0)
    for t in range(30):
        s.prefill("a", 1000, 0.25, now=float(t))  # 4000 tok/s
    before = s.prefill_tps["a"]
    for t in range(30, 45):
        s.prefill("a", 1000, 1.0, now=float(t))  # slowed 4x
    assert s.prefill_tps["a"] < 0.4 * before


def test_a_backend_never_measured_takes_the_fleets_rate_per_weight() -> None:
    s = SpeedEstimator({"a": 1.0, "new": 2.0}, prior_tokens=100.0)
    s.prefill("a", 100_000, 100.0, now=0.0)  # 1000 tok/s per unit of weight
    assert s.prefill_tps["new"] == pytest.approx(2000.0)


def test_nonsense_samples_and_unknown_backends_are_ignored() -> None:
    s = SpeedEstimator({"a": 1.0})
    s.prefill("a", 0, 1.0, now=0.0)
    s.prefill("a", 100, 0.0, now=0.0)
    s.prefill("zz", 100, 1.0, now=0.0)
    s.decode("a", 0, 1.0, now=0.0)
    assert s.prefill_tps == {"a": DEFAULT_PREFILL_TPS}
    assert "zz" not in s.prefill_tps


def test_decode_rate_is_learned_separately() -> None:
    s = SpeedEstimator({"a": 1.0}, prior_tokens=1.0)
    s.decode("a", 1000, 10.0, now=0.0)
    assert s.decode_tps["a"] == pytest.approx(100.0, rel=0.01)
    assert s.prefill_tps["a"] == DEFAULT_PREFILL_TPS


def test_runtime_backend_gets_a_prior() -> None:
    s = SpeedEstimator({"a": 1.0})
    s.set_weight("b", 0.5)
    assert s.prefill_tps["b"] == 0.5 * DEFAULT_PREFILL_TPS


def test_ewma() -> None:
    e = Ewma(10.0, alpha=0.5)
    e.add(20.0)
    assert e.value == 15.0


def test_with_refresh_s_samples_are_summed_and_rates_recomputed_at_most_that_often() -> None:
    s = SpeedEstimator({"a": 1.0}, half_life_s=10.0, prior_tokens=1000.0, refresh_s=0.5)
    s.prefill("a", 9000, 9.0, now=0.0)
    assert s.prefill_tps["a"] == DEFAULT_PREFILL_TPS  # summed, not yet recomputed
    assert s.refresh(now=0.0) is True
    first = s.prefill_tps["a"]
    assert first < DEFAULT_PREFILL_TPS
    s.prefill("a", 9000, 9.0, now=0.1)
    assert s.refresh(now=0.1) is False and s.prefill_tps["a"] == first  # within refresh_s
    assert s.refresh(now=0.6) is True and s.prefill_tps["a"] != first  # the later sample is in
    assert s.refresh(now=5.0) is False  # nothing new since


def test_without_refresh_s_every_sample_recomputes() -> None:
    s = SpeedEstimator({"a": 1.0}, prior_tokens=1000.0)
    s.prefill("a", 9000, 9.0, now=0.0)
    assert s.prefill_tps["a"] < DEFAULT_PREFILL_TPS
    assert s.refresh(now=0.0) is False  # already current


def test_a_sample_with_a_queue_ahead_counts_only_without_a_recent_queue_free_one() -> None:
    s = SpeedEstimator({"a": 1.0, "b": 1.0}, half_life_s=10.0, prior_tokens=1000.0)
    s.prefill("a", 4000, 1.0, now=0.0)  # nothing ahead: 4000 tok/s
    clean = s.prefill_tps["a"]
    # Its queue ahead was estimated at 3000 tokens, but the engine did more (it had evicted them): skipped.
    s.prefill("a", 4000, 2.0, now=5.0, queued=True)
    assert s.prefill_tps["a"] == clean
    # A half-life without a queue-free sample: the queued ones are all there is, and they count.
    s.prefill("a", 4000, 2.0, now=10.0, queued=True)
    assert s.prefill_tps["a"] < clean
    s.prefill("b", 4000, 2.0, now=0.0, queued=True)  # never a queue-free one: counted
    assert s.prefill_tps["b"] < DEFAULT_PREFILL_TPS
