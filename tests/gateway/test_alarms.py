"""gateway.relay.Alarms: a loop's deadlines (an attempt's head wait, an engine's silence) on one loop timer.

Each alarm must act at its own time, as it did on a timer of its own: a silent engine is cut at ``read_s``,
one that keeps sending is never cut, an alarm earlier than the armed timer is not held back by it, and an
alarm that left (its response ended) never acts. The timer's schedule is checked on a loop stand-in whose
clock the test moves; the real loop's end to end."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from loop_clock import LoopClock

from gateway.relay import Alarm, Alarms, Deadline, Expiry, SilenceWatch


class _Note(Alarm):
    """An alarm that notes when it acted; ``moves_to``: where it says it is due the first time instead."""

    __slots__ = ("acted", "moves_to")

    def __init__(self, due: float, moves_to: float | None = None) -> None:
        self.due, self.moves_to = due, moves_to
        self.acted: list[float] = []

    def check(self, now: float) -> float | None:
        if self.moves_to is not None:
            due, self.moves_to = self.moves_to, None
            return due
        self.acted.append(now)
        return None


def _alarms(clock: LoopClock) -> Alarms:
    return Alarms(clock)  # type: ignore[arg-type]  # the two methods it uses


def test_alarms_share_one_timer_armed_for_the_earliest_and_each_acts_at_its_time() -> None:
    clock = LoopClock()
    alarms = _alarms(clock)
    first, later, earlier = _Note(10.0), _Note(30.0), _Note(5.0)
    alarms.add(first)
    alarms.add(later)  # later than the armed timer: no timer of its own
    assert clock.armed() == [10.0]
    alarms.add(earlier)  # earlier: the timer is re-armed for it at once
    assert clock.armed() == [5.0]
    clock.run_until(100.0)
    assert (earlier.acted, first.acted, later.acted) == ([5.0], [10.0], [30.0])
    assert clock.armed() == []  # nothing left: nothing armed


def test_an_alarm_that_left_never_acts_and_its_timer_is_not_cancelled() -> None:
    clock = LoopClock()
    alarms = _alarms(clock)
    gone, stays = _Note(5.0), _Note(20.0)
    alarms.add(gone)
    alarms.add(stays)
    alarms.discard(gone)
    assert clock.armed() == [5.0]  # firing with nothing due costs less than a cancel
    clock.run_until(100.0)
    assert (gone.acted, stays.acted) == ([], [20.0])


def test_an_alarm_that_moved_is_checked_again_at_its_new_time() -> None:
    clock = LoopClock()
    alarms = _alarms(clock)
    moved = _Note(5.0, moves_to=12.0)
    alarms.add(moved)
    clock.run_until(11.9)
    assert moved.acted == [] and clock.armed() == [12.0]
    clock.run_until(100.0)
    assert moved.acted == [12.0]


def test_an_alarm_added_after_the_timer_fired_empty_gets_a_timer() -> None:
    clock = LoopClock()
    alarms = _alarms(clock)
    gone = _Note(5.0)
    alarms.add(gone)
    alarms.discard(gone)
    clock.run_until(6.0)  # fired with nothing due
    late = _Note(50.0)
    alarms.add(late)
    assert clock.armed() == [50.0]
    clock.run_until(100.0)
    assert late.acted == [50.0]


# -- the silence watch's rule, on the real loop (its clock read by the test, never slept on) ------------


def _watch_rule(
    steps: Callable[[SilenceWatch, float], None], request_s: float = 1000.0
) -> asyncio.Task[None]:
    """Run ``steps(watch, start)`` with a watch (``read_s`` 10) on a task that waits forever; the task."""

    async def forever() -> None:
        await asyncio.get_running_loop().create_future()

    async def main() -> asyncio.Task[None]:
        task = asyncio.create_task(forever())
        watch = SilenceWatch(task, read_s=10.0, deadline=asyncio.get_running_loop().time() + request_s)
        try:
            steps(watch, watch.last)
        finally:
            watch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task  # the watch's cancel reached it
        return task

    return asyncio.run(main())


def test_a_silent_engine_is_cut_at_read_s_and_not_before() -> None:
    def steps(watch: SilenceWatch, start: float) -> None:
        assert watch.due == start + 10.0
        assert watch.check(start + 9.99) == start + 10.0  # not yet: due again at read_s
        assert watch.fired is None
        assert watch.check(start + 10.0) is None
        assert watch.fired is Expiry.SILENCE

    assert _watch_rule(steps).cancelled()


def test_an_engine_that_keeps_sending_is_not_cut() -> None:
    def steps(watch: SilenceWatch, start: float) -> None:
        for n in range(
            1, 50
        ):  # a chunk every 8 s, the watch checked each time read_s passed since it was due
            watch.last = start + 8.0 * n
            due = watch.check(start + 8.0 * n + 1.0)
            assert due == start + 8.0 * n + 10.0 and watch.fired is None
        assert watch.check(start + 8.0 * 49 + 10.0) is None  # then silence: cut read_s after its last chunk
        assert watch.fired is Expiry.SILENCE

    assert _watch_rule(steps).cancelled()


def test_a_client_slow_to_take_a_chunk_is_not_engine_silence_and_the_deadline_still_holds() -> None:
    def steps(watch: SilenceWatch, start: float) -> None:
        watch.sending = True
        assert watch.check(start + 50.0) == start + 60.0
        assert watch.check(start + 100.0) is None
        assert watch.fired is Expiry.DEADLINE

    assert _watch_rule(steps, request_s=100.0).cancelled()


# -- end to end on the real loop ------------------------------------------------------------------------


def test_a_silent_engine_is_cut_on_the_loop_after_read_s_even_behind_a_later_timer() -> None:
    async def main() -> tuple[float, float, Expiry | None]:
        loop = asyncio.get_running_loop()
        never = loop.create_future()

        async def relay() -> None:
            await never

        async with Deadline(3600.0):  # the loop's timer is armed an hour out first
            task = asyncio.create_task(relay())
            start = loop.time()
            watch = SilenceWatch(task, read_s=0.05, deadline=start + 3600.0)
            with pytest.raises(asyncio.CancelledError):
                await task
            watch.cancel()
        return start, loop.time(), watch.fired

    start, cut, why = asyncio.run(main())
    assert why is Expiry.SILENCE
    assert cut >= start + 0.05


def test_each_loop_keeps_its_own_alarms() -> None:
    async def deadline() -> bool:
        with pytest.raises(TimeoutError):
            async with Deadline(0.01):
                await asyncio.get_running_loop().create_future()
        return True

    assert asyncio.run(deadline()) and asyncio.run(deadline())
