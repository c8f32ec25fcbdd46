"""gateway.throttle: one line per interval, carrying the count of the events it stands for."""

from __future__ import annotations

from gateway.throttle import LogThrottle


def test_the_first_event_is_reported_at_once_and_the_rest_with_the_next_line() -> None:
    throttle = LogThrottle(10.0)
    assert throttle.due(100.0) == 1
    assert [throttle.due(t) for t in (100.0, 101.0, 109.9)] == [0, 0, 0]
    assert throttle.due(110.0) == 4  # this one and the three kept quiet
    assert throttle.due(115.0) == 0
    assert throttle.due(200.0) == 2


def test_a_flood_makes_one_line_per_interval() -> None:
    throttle = LogThrottle(10.0)
    reports = [n for i in range(4904) if (n := throttle.due(i * 0.01))]  # 4,904 events in 49 s
    assert reports == [1, 1000, 1000, 1000, 1000]
    assert throttle.count == 903  # waiting for the next line


def test_an_interval_of_zero_reports_every_event() -> None:
    throttle = LogThrottle(0.0)
    assert [throttle.due(5.0) for _ in range(3)] == [1, 1, 1]
