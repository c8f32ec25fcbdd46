"""Learned engine speed: decayed sums with the configured weight as the prior."""

from __future__ import annotations

import pytest

from routing.params import DEFAULT_PREFILL_TPS
from routing.speed import _MAX_SPANS, BusyTime, Ewma, SpeedEstimator


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


def test_busy_time_yields_what_each_span_adds_to_the_union_in_any_order() -> None:
    busy = BusyTime()
    assert busy.add(0.0, 1.0) == pytest.approx(1.0)
    assert busy.add(2.0, 3.0) == pytest.approx(1.0)  # after an idle gap: all of it
    assert busy.add(0.5, 2.5) == pytest.approx(1.0)  # bridges the two: only the gap is new
    assert busy.add(0.2, 2.8) == 0.0  # within the union
    assert (busy.starts, busy.ends) == ([0.0], [3.0])
    assert busy.add(-1.0, 4.0) == pytest.approx(2.0)  # around it: both ends
    assert busy.add(5.0, 5.0) == 0.0 and len(busy) == 1


def test_busy_time_of_spans_finishing_out_of_order_is_their_union() -> None:
    # Sent at 0, 0.1, 0.2 to a serial engine that takes 1 s each: first bytes at 1, 2, 3; the later ones
    # finish (and are observed) first, a long answer last.
    spans = [(0.2, 3.0), (0.1, 2.0), (0.0, 1.0), (5.0, 6.0), (4.0, 5.5)]
    busy = BusyTime()
    assert sum(busy.add(*span) for span in spans) == pytest.approx(3.0 + 2.0)
    assert (busy.starts, busy.ends) == ([0.0, 4.0], [3.0, 6.0])


def test_busy_time_keeps_a_bounded_number_of_spans() -> None:
    busy = BusyTime()
    for i in range(_MAX_SPANS + 10):
        busy.add(2.0 * i, 2.0 * i + 1)
    assert len(busy) == _MAX_SPANS
    assert busy.add(0.0, 19.5) == pytest.approx(0.5)  # before the oldest kept span counts as covered


def _serial_engine(sends: list[tuple[float, int]], tps: float) -> list[tuple[int, float, float]]:
    """A serial prefill engine at ``tps``: each (send time, uncached tokens) -> (tokens, sent, first byte)."""
    free, out = 0.0, []
    for sent, tokens in sends:
        free = max(free, sent) + tokens / tps
        out.append((tokens, sent, free))
    return out


def test_identical_engines_are_learned_alike_whatever_queue_each_saw() -> None:
    # "a" gets requests one at a time; "b" the same work in bursts of 4, the queued ones observed first
    # (shorter answers) and one of them a request that found its head cached behind the first.
    s = SpeedEstimator({"a": 1.0, "b": 1.0}, half_life_s=15.0)
    for burst in range(5):
        t = 10.0 * burst
        alone = _serial_engine([(t + 2.0 * i, 3000) for i in range(4)], 4000.0)
        queued = _serial_engine([(t + 0.05 * i, 3000 if i != 1 else 16) for i in range(4)], 4000.0)
        for tokens, sent, first in alone:
            s.prefill_span("a", tokens, sent, first, now=first + 0.5)
        for tokens, sent, first in reversed(queued):
            s.prefill_span("b", tokens, sent, first, now=queued[-1][2] + 0.5)
    assert s.prefill_tps["a"] == pytest.approx(4000.0, rel=1e-6)
    assert s.prefill_tps["b"] == pytest.approx(4000.0, rel=1e-6)


def test_a_span_that_prefilled_nothing_is_no_sample() -> None:
    s = SpeedEstimator({"a": 1.0}, prior_tokens=1000.0)
    s.prefill_span("a", 0, 0.0, 0.5, now=1.0)  # all cached: the engine's fixed overhead only
    s.prefill_span("zz", 100, 0.0, 0.5, now=1.0)
    assert s.prefill_tps == {"a": DEFAULT_PREFILL_TPS}
    s.prefill_span("a", 1000, 0.2, 0.45, now=1.0)  # the span it would have covered is still free: counted
    assert s.prefill_tps["a"] == pytest.approx(2000 / (0.25 + 1000 / 4000))


def test_spans_merged_at_their_first_bytes_give_each_request_its_own_prefill_time() -> None:
    # A head of 2400 tokens sent at 0, two twins that find it cached (13 tokens each) sent at 0.1 and 0.2 to
    # a serial engine at 4000 tok/s: first bytes at 0.6, 0.60325, 0.6065. The twins' answers end first.
    sends = _serial_engine([(0.0, 2400), (0.1, 13), (0.2, 13)], 4000.0)
    at_first_byte = SpeedEstimator({"a": 1.0, "b": 1.0}, half_life_s=15.0)
    busy = [at_first_byte.busy("a", sent, first) for _tokens, sent, first in sends]
    assert busy == pytest.approx([0.6, 0.00325, 0.00325])
    for i in (2, 1):  # the twins' samples come first: each with its own time
        at_first_byte.prefill_busy("a", sends[i][0], busy[i], now=1.0)
    assert at_first_byte.prefill_tps["a"] == pytest.approx(4000.0)
    at_first_byte.prefill_busy("a", 2400, busy[0], now=1.5)
    assert at_first_byte.prefill_tps["a"] == pytest.approx(4000.0)
    # Merged as the samples came, the first twin took the head's prefill time for its 13 tokens.
    at_finish = SpeedEstimator({"a": 1.0, "b": 1.0}, half_life_s=15.0)
    for tokens, sent, first in (sends[2], sends[1]):
        at_finish.prefill_span("a", tokens, sent, first, now=1.0)
    assert at_finish.prefill_tps["a"] < 100.0
    assert at_first_byte.busy("zz", 0.0, 1.0) == 0.0  # an unknown backend
    at_first_byte.prefill_busy("a", 0, 0.5, now=2.0)  # a request that prefilled nothing: no sample
    assert at_first_byte.prefill_tps["a"] == pytest.approx(4000.0)
