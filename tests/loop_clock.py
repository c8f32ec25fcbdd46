"""A stand-in for the event loop's timer methods, on a clock the test moves: what was armed, when, and firing
every due timer in time order (each once), the clock at its time."""

from __future__ import annotations

from collections.abc import Callable


class Handle:
    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when, self.callback, self.cancelled = when, callback, False

    def cancel(self) -> None:
        self.cancelled = True


class LoopClock:
    """``time``, ``call_at`` and ``call_later`` as a loop has them; ``run_until`` moves the clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.handles: list[Handle] = []

    def time(self) -> float:
        return self.now

    def call_at(self, when: float, callback: Callable[[], None]) -> Handle:
        handle = Handle(when, callback)
        self.handles.append(handle)
        return handle

    def call_later(self, delay: float, callback: Callable[[], None]) -> Handle:
        return self.call_at(self.now + delay, callback)

    def armed(self) -> list[float]:
        return [h.when for h in self.handles if not h.cancelled]

    def run_until(self, t: float) -> None:
        """Fire each armed timer due by ``t``, in time order, the clock at its time."""
        while due := sorted(
            (h for h in self.handles if not h.cancelled and h.when <= t), key=lambda h: h.when
        ):
            handle = due[0]
            handle.cancelled = True  # a timer fires once
            self.now = max(self.now, handle.when)
            handle.callback()
        self.now = t
