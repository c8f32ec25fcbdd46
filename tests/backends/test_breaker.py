"""backends.breaker: the circuit breaker's states and periods, with time passed in (no clock, no sockets)."""

from __future__ import annotations

import pytest

from backends.breaker import BreakerPolicy, CircuitBreaker, CircuitState

CLOSED, OPEN, HALF_OPEN = CircuitState.CLOSED, CircuitState.OPEN, CircuitState.HALF_OPEN


def opened(
    threshold: int = 3, open_s: float = 10.0, open_max_s: float = 40.0, at: float = 0.0
) -> CircuitBreaker:
    breaker = CircuitBreaker(BreakerPolicy(threshold, open_s, open_max_s))
    for _ in range(threshold):
        breaker.record(False, at)
    assert breaker.state(at) is OPEN
    return breaker


def test_consecutive_failures_open_it_and_a_success_in_between_resets_the_count() -> None:
    breaker = CircuitBreaker(BreakerPolicy(failure_threshold=3))
    assert [breaker.record(False, 0.0), breaker.record(False, 0.0)] == [CLOSED, CLOSED]
    assert breaker.record(True, 0.0) is CLOSED
    assert breaker.consecutive_failures == 0
    assert [breaker.record(False, 1.0) for _ in range(3)] == [CLOSED, CLOSED, OPEN]
    assert (breaker.allows(1.0), breaker.retry_at()) == (False, 11.0)


def test_open_until_the_period_ends_then_exactly_one_trial() -> None:
    breaker = opened(open_s=10.0)
    assert (breaker.state(9.999), breaker.allows(9.999), breaker.begin(9.999)) == (OPEN, False, False)
    assert breaker.state(10.0) is HALF_OPEN
    assert breaker.allows(10.0) is True
    assert breaker.begin(10.0) is True  # the trial
    assert (breaker.allows(10.5), breaker.begin(10.5)) == (False, False)  # only one at a time


def test_allows_is_a_query_and_takes_no_trial() -> None:
    breaker = opened()
    assert [breaker.allows(10.0) for _ in range(3)] == [True, True, True]
    assert breaker.begin(10.0) is True
    assert breaker.allows(10.0) is False


def test_trial_success_closes_and_the_period_returns_to_open_s() -> None:
    breaker = opened(open_s=10.0, open_max_s=40.0)
    breaker.begin(10.0)
    assert breaker.record(False, 10.0) is OPEN  # failed trial: 20 s
    breaker.begin(30.0)
    assert breaker.record(True, 30.0) is CLOSED
    assert (breaker.allows(30.0), breaker.retry_at(), breaker.open_for_s) == (True, None, 10.0)
    for _ in range(3):
        breaker.record(False, 31.0)
    assert breaker.retry_at() == 41.0  # back to the first period


def test_failed_trials_double_the_open_period_up_to_the_cap() -> None:
    breaker = opened(open_s=10.0, open_max_s=40.0)
    now, periods = 10.0, []
    for _ in range(4):
        assert breaker.begin(now)
        assert breaker.record(False, now) is OPEN
        periods.append(breaker.open_for_s)
        retry = breaker.retry_at()
        assert retry is not None and breaker.state(retry - 0.001) is OPEN
        now = retry
    assert periods == [20.0, 40.0, 40.0, 40.0]


def test_results_arriving_while_open_decide_nothing() -> None:
    breaker = opened(open_s=10.0)
    assert breaker.record(True, 5.0) is OPEN  # a request sent before it opened
    assert breaker.record(False, 5.0) is OPEN
    assert breaker.retry_at() == 10.0  # the period was not extended either


def test_a_trial_that_never_reports_frees_its_slot_after_one_period() -> None:
    breaker = opened(open_s=10.0)
    assert breaker.begin(10.0)
    assert breaker.allows(19.999) is False
    assert breaker.begin(20.0) is True  # lost result: a new trial may go


def test_reset_closes_it() -> None:
    breaker = opened()
    breaker.reset()
    assert (breaker.state(0.0), breaker.allows(0.0), breaker.consecutive_failures) == (CLOSED, True, 0)


def test_one_clients_5xx_answers_never_open_it_however_many() -> None:
    breaker = CircuitBreaker(BreakerPolicy(failure_threshold=1))
    assert {breaker.record(False, float(t), client="key:mallory") for t in range(100)} == {CLOSED}
    assert breaker.consecutive_failures == 100  # counted, but one client explains them all


def test_5xx_answers_from_two_clients_open_it_at_the_threshold() -> None:
    breaker = CircuitBreaker(BreakerPolicy(failure_threshold=3))
    got = [breaker.record(False, 1.0, client=c) for c in ("peer:a", "peer:a", "peer:a", "peer:b")]
    assert got == [CLOSED, CLOSED, CLOSED, OPEN]  # three failures, but only the second client's opened it
    assert breaker.retry_at() == 11.0


def test_a_failure_only_the_engine_explains_opens_it_alongside_one_clients_answers() -> None:
    breaker = CircuitBreaker(BreakerPolicy(failure_threshold=3))
    assert [breaker.record(False, 1.0, client="peer:a") for _ in range(2)] == [CLOSED, CLOSED]
    assert breaker.record(False, 1.0) is OPEN  # a connect error, a timeout: the engine's own


def test_a_success_starts_the_client_count_afresh() -> None:
    breaker = CircuitBreaker(BreakerPolicy(failure_threshold=1))
    assert breaker.record(False, 1.0, client="peer:a") is CLOSED
    assert breaker.record(True, 1.0) is CLOSED
    assert breaker.record(False, 1.0, client="peer:b") is CLOSED  # peer:a's failure is forgotten
    assert breaker.record(False, 1.0, client="peer:a") is OPEN


def test_abstain_counts_nothing_and_frees_the_half_open_trial() -> None:
    breaker = CircuitBreaker(BreakerPolicy(failure_threshold=2))
    breaker.record(False, 0.0)
    breaker.abstain(0.0)
    assert (breaker.state(0.0), breaker.consecutive_failures) == (CLOSED, 1)  # the streak goes on
    assert breaker.record(False, 0.0) is OPEN
    assert breaker.begin(10.0) is True  # the trial: a request every engine fails (the request's own)
    assert breaker.allows(10.0) is False
    breaker.abstain(10.0)
    assert (breaker.state(10.0), breaker.begin(10.0)) == (HALF_OPEN, True)  # the next request is the trial


def test_a_failed_trial_reopens_it_whoever_sent_it() -> None:
    breaker = opened(threshold=1, open_s=10.0)
    assert breaker.begin(10.0)
    assert breaker.record(False, 10.0, client="peer:a") is OPEN


def test_state_values_are_stable_metric_labels() -> None:
    assert [s.value for s in CircuitState] == ["closed", "open", "half_open"]


@pytest.mark.parametrize(("threshold", "open_s", "open_max_s"), [(0, 1.0, 1.0), (1, 0.0, 1.0), (1, 2.0, 1.0)])
def test_bad_policies_are_rejected(threshold: int, open_s: float, open_max_s: float) -> None:
    with pytest.raises(ValueError, match="failure_threshold"):
        BreakerPolicy(threshold, open_s, open_max_s)
