"""A log line that a flood of identical events cannot turn into a flood of lines. A leaf module."""

from __future__ import annotations


class LogThrottle:
    """At most one line per ``every_s``, saying how many events it stands for.

    ``due(now)`` counts one event and returns how many to report now (this one and those kept quiet since
    the last line), or 0 to stay quiet. The first event is reported at once. ``now`` is any monotonic clock
    (the event loop's time): the throttle reads none itself.
    """

    __slots__ = ("count", "every_s", "next_at")

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.next_at = float("-inf")
        self.count = 0

    def due(self, now: float) -> int:
        self.count += 1
        if now < self.next_at:
            return 0
        self.next_at = now + self.every_s
        count, self.count = self.count, 0
        return count
