"""The quota window arithmetic, on a clock the test moves (plain functions, no I/O)."""

from __future__ import annotations

import pytest

from gateway.quota_windows import (
    Exhausted,
    Limits,
    MemoryQuotas,
    RateLimitStyle,
    Verdict,
    reset_instant,
    reset_text,
)


def test_the_nth_request_of_a_window_is_admitted_and_the_next_refused_until_it_closes() -> None:
    q, limits = MemoryQuotas(), Limits(requests=3, window_s=60)
    seen = [q.admit("alice", limits, now) for now in (100.0, 110.0, 120.0)]
    assert [(v.refused, v.requests, v.reset_s) for v in seen] == [(None, 1, 60), (None, 2, 50), (None, 3, 40)]
    for k in range(3):
        q.finish("alice", limits, 0, 121.0 + k)
    over = q.admit("alice", limits, 130.0)
    assert (over.refused, over.requests, over.reset_s, over.retry_after_s()) == (
        Exhausted.REQUESTS,
        3,
        30,
        30,
    )
    assert q.admit("alice", limits, 159.999).refused is Exhausted.REQUESTS  # a refusal counts nothing
    fresh = q.admit("alice", limits, 160.0)  # the window opened at 100 closed at 160: a new one opens
    assert (fresh.refused, fresh.requests, fresh.reset_s) == (None, 1, 60)


def test_keys_have_their_own_windows() -> None:
    q, limits = MemoryQuotas(), Limits(requests=1)
    assert q.admit("alice", limits, 0.0).refused is None
    assert q.admit("bob", limits, 1.0).refused is None
    assert q.admit("alice", limits, 2.0).refused is Exhausted.REQUESTS


def test_tokens_are_charged_when_a_request_finishes_and_refuse_the_next_once_spent() -> None:
    q, limits = MemoryQuotas(), Limits(tokens=1000, window_s=60)
    first, second = q.admit("a", limits, 0.0), q.admit("a", limits, 1.0)
    assert (first.refused, second.refused, second.tokens) == (None, None, 0)  # nothing known yet
    q.finish("a", limits, 600, 2.0)
    third = q.admit("a", limits, 3.0)
    assert (third.refused, third.tokens) == (None, 600)  # 600 < 1000: admitted (its own are unknown)
    q.finish("a", limits, 500, 4.0)
    q.finish("a", limits, 10, 5.0)
    over = q.admit("a", limits, 6.0)
    assert (over.refused, over.tokens, over.reset_s) == (Exhausted.TOKENS, 1110, 54)
    assert q.admit("a", limits, 60.0).refused is None  # the window closed: tokens start from zero


def test_tokens_charged_after_the_window_closed_open_the_next_one() -> None:
    q, limits = MemoryQuotas(), Limits(tokens=100, window_s=10)
    q.admit("a", limits, 0.0)
    q.finish("a", limits, 150, 12.0)  # its window (0..10) is gone: the charge opens 12..22
    state = q.state("a", limits, 13.0)
    assert (state.tokens, state.requests, state.reset_s) == (150, 0, 9)
    assert q.admit("a", limits, 21.0).refused is Exhausted.TOKENS
    assert q.admit("a", limits, 22.0).refused is None


def test_the_concurrent_limit_counts_requests_in_flight_not_the_window() -> None:
    q, limits = MemoryQuotas(), Limits(concurrent=2)
    assert [q.admit("a", limits, t).refused for t in (0.0, 0.0, 0.0)] == [None, None, Exhausted.CONCURRENT]
    refused = q.admit("a", limits, 1.0)
    assert (refused.in_flight, refused.retry_after_s()) == (2, 1)
    q.finish("a", limits, 0, 2.0)
    assert q.admit("a", limits, 2.0).refused is None
    assert q.in_flight == {"a": 2}


def test_the_first_limit_reached_is_named() -> None:
    q, limits = MemoryQuotas(), Limits(requests=1, tokens=10, concurrent=1)
    q.admit("a", limits, 0.0)
    assert q.admit("a", limits, 0.0).refused is Exhausted.REQUESTS  # requests are checked first


def test_state_reads_without_counting() -> None:
    q, limits = MemoryQuotas(), Limits(requests=2, window_s=60)
    q.admit("a", limits, 0.0)
    assert [q.state("a", limits, 5.0).requests for _ in range(3)] == [1, 1, 1]
    assert q.state("a", limits, 60.0) == Verdict(limits, None, 0, 0, 60, 1)  # closed window reads empty
    assert q.state("nobody", limits, 0.0).requests == 0


def test_headers_are_openais_trios_for_the_limits_set() -> None:
    both = Verdict(Limits(requests=60, tokens=1000), None, 1, 250, 59.5)
    assert both.headers() == [
        (b"x-ratelimit-limit-requests", b"60"),
        (b"x-ratelimit-remaining-requests", b"59"),
        (b"x-ratelimit-reset-requests", b"59.5s"),
        (b"x-ratelimit-limit-tokens", b"1000"),
        (b"x-ratelimit-remaining-tokens", b"750"),
        (b"x-ratelimit-reset-tokens", b"59.5s"),
    ]
    overspent = Verdict(Limits(tokens=100), Exhausted.TOKENS, 3, 180, 0.02)
    assert overspent.headers() == [
        (b"x-ratelimit-limit-tokens", b"100"),
        (b"x-ratelimit-remaining-tokens", b"0"),
        (b"x-ratelimit-reset-tokens", b"20ms"),
    ]
    assert overspent.retry_after_s() == 1
    assert Verdict(Limits(concurrent=1), None, 1, 0, 60).headers() == []


def test_anthropic_headers_name_each_limit_first_and_date_the_reset() -> None:
    both = Verdict(Limits(requests=60, tokens=1000), None, 1, 250, 59.5)
    assert both.headers(RateLimitStyle.ANTHROPIC, 1_796_198_400.0) == [  # 2026-12-02T08:00:00Z
        (b"anthropic-ratelimit-requests-limit", b"60"),
        (b"anthropic-ratelimit-requests-remaining", b"59"),
        (b"anthropic-ratelimit-requests-reset", b"2026-12-02T08:01:00Z"),  # 59.5 s later, rounded up
        (b"anthropic-ratelimit-tokens-limit", b"1000"),
        (b"anthropic-ratelimit-tokens-remaining", b"750"),
        (b"anthropic-ratelimit-tokens-reset", b"2026-12-02T08:01:00Z"),
    ]
    assert Verdict(Limits(concurrent=1), None, 1, 0, 60).headers(RateLimitStyle.ANTHROPIC, 0.0) == []


@pytest.mark.parametrize(
    ("unix_s", "text"),
    [
        (0.0, "1970-01-01T00:00:00Z"),
        (1_796_198_400.0, "2026-12-02T08:00:00Z"),
        (1_796_198_400.0004, "2026-12-02T08:00:00Z"),  # under a millisecond is not a second later
        (1_796_198_400.2, "2026-12-02T08:00:01Z"),
    ],
)
def test_reset_instants_are_rfc3339_utc_whole_seconds_rounded_up(unix_s: float, text: str) -> None:
    assert reset_instant(unix_s) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "0ms"),
        (0.0123, "13ms"),
        (1.0, "1s"),
        (1.5, "1.5s"),
        (59.9994, "1m0s"),
        (60.0, "1m0s"),
        (360.0, "6m0s"),
        (61.25, "1m1.25s"),
        (3723.0, "1h2m3s"),
        (-1.0, "0ms"),
    ],
)
def test_reset_values_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert reset_text(seconds) == text
