"""The admission scheduler's pausing rules (a preemptible class's running tickets give their slot to a
waiting higher class), one test each: plain functions, time passed in."""

from __future__ import annotations

import itertools

from backends.admission import AdmissionScheduler, ClassSpec, Outcome, Ticket

CLASSES = (
    ClassSpec("interactive", 0, max_queued=4, timeout_s=10.0, retry_after_s=1.0),
    ClassSpec("standard", 1, max_queued=100, timeout_s=60.0, retry_after_s=5.0),
    ClassSpec("batch", 2, max_queued=100, timeout_s=60.0, retry_after_s=5.0, preemptible=True),
)
_ids = itertools.count(1)


def ticket(
    client: str, klass: str = "batch", *, cost: int = 100, at: float = 0.0, resumable: bool = True
) -> Ticket:
    return Ticket(next(_ids), "b1", client, klass, cost, at, resumable)


def ids(tickets: tuple[Ticket, ...]) -> list[int]:
    return [t.id for t in tickets]


def full(s: AdmissionScheduler, n: int, **kw: object) -> list[Ticket]:
    """``n`` batch tickets of client A, admitted in order."""
    running = [ticket("A", **kw) for _ in range(n)]  # type: ignore[arg-type]
    for t in running:
        assert ids(s.arrive(t, 0).admitted) == [t.id]
    return running


def test_a_turn_on_a_full_backend_is_seated_at_once_and_the_newest_batch_ticket_asked_to_pause() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=2)
    old, new = full(s, 2)
    s.arrive(queued := ticket("A"), 0)
    turn = ticket("B", "interactive", cost=10)
    out = s.arrive(turn, 1.0)
    assert (ids(out.admitted), ids(out.pause)) == ([turn.id], [new.id])
    assert (s.running("b1"), s.pausing("b1")) == (3, 1)  # one over, until the pause takes effect
    assert s.paused(new, 2.0) == Outcome()  # its slot was the turn's already: nobody else goes
    assert (s.running("b1"), s.pausing("b1"), s.depth("batch")) == (2, 0, 2)
    assert ids(s.finish(turn, 10).admitted) == [new.id]  # the paused one first among A's, before `queued`
    assert ids(s.finish(old, 100).admitted) == [queued.id]


def test_nothing_is_paused_for_the_same_class_or_for_tickets_that_cannot_resume() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    full(s, 1)
    assert s.arrive(ticket("B"), 0) == Outcome()  # batch for batch: it waits for a slot turnover
    s2 = AdmissionScheduler(CLASSES, default_capacity=1)
    full(s2, 1, resumable=False)
    assert s2.arrive(ticket("B", "interactive"), 0) == Outcome()
    plain = (CLASSES[0], ClassSpec("batch", 2, max_queued=9, timeout_s=9, retry_after_s=1))  # not preemptible
    s3 = AdmissionScheduler(plain, default_capacity=1)
    full(s3, 1)
    assert s3.arrive(ticket("B", "interactive"), 0) == Outcome()


def test_the_lowest_class_is_paused_first_and_one_ticket_per_waiter() -> None:
    classes = (*CLASSES[:1], ClassSpec("standard", 1, 9, 9.0, 1.0, preemptible=True), CLASSES[2])
    s = AdmissionScheduler(classes, default_capacity=3)
    std = ticket("S", "standard")
    assert ids(s.arrive(std, 0).admitted) == [std.id]
    a1, a2 = full(s, 2)
    first, second, third = (ticket("B", "interactive") for _ in range(3))
    assert ids(s.arrive(first, 0).pause) == [a2.id]
    assert ids(s.arrive(second, 0).pause) == [a1.id]
    assert ids(s.arrive(third, 0).pause) == [std.id]  # standard only once no batch is left to ask
    assert ids(s.arrive(ticket("B", "interactive"), 0).pause) == []  # nothing left: it waits
    assert (s.running("b1"), s.depth("interactive")) == (6, 1)
    std_waiter = ticket("T", "standard")
    assert s.arrive(std_waiter, 0) == Outcome()  # every pausable ticket is asked already


def test_a_ticket_that_finishes_before_it_pauses_just_finishes() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    (a,) = full(s, 1)
    s.arrive(later := ticket("A"), 0)
    turn = ticket("B", "interactive")
    assert ids(s.arrive(turn, 0).pause) == [a.id]
    assert s.finish(a, 100) == Outcome()  # its slot is the turn's: back at capacity, nobody else admitted
    assert (s.running("b1"), s.pausing("b1")) == (1, 0)
    assert s.paused(a, 1.0) == Outcome()  # too late to pause: it is gone
    assert ids(s.finish(turn, 10).admitted) == [later.id]


def test_a_ticket_the_edge_cannot_pause_is_kept_and_the_next_is_asked() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=2)
    a1, a2 = full(s, 2)
    assert ids(s.arrive(ticket("B", "interactive"), 0).pause) == [a2.id]
    assert ids(s.keep(a2).pause) == [a1.id]
    assert s.keep(a1) == Outcome()  # nobody left to ask: the backend runs one over until one finishes
    assert s.keep(a1) == Outcome()  # and never again
    assert s.arrive(ticket("C", "interactive"), 0) == Outcome()


def test_usage_is_charged_once_over_a_pause_and_its_resumption() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    (a,) = full(s, 1)
    assert s.usage("batch", "A") == 100
    turn = ticket("B", "interactive", cost=10)
    s.arrive(turn, 0)
    s.paused(a, 1.0)
    assert s.usage("batch", "A") == 0  # uncharged while it waits
    (again,) = s.finish(turn, 10).admitted
    assert again.id == a.id and s.usage("batch", "A") == 100
    s.finish(again, 150)
    assert s.usage("batch", "A") == 150 and s.running("b1") == 0


def test_a_paused_tickets_timeout_counts_from_its_pause() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    (a,) = full(s, 1)
    s.arrive(ticket("B", "interactive"), 0)
    s.paused(a, 100.0)  # long after it arrived (at 0): it is not refused at once
    assert s.expire(101.0) == Outcome()
    (refused,) = s.expire(160.0).refused
    assert refused.ticket.id == a.id and s.depth("batch") == 0


def test_swap_moves_the_ask_within_one_class_and_backend() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=3)
    a1, a2, a3 = full(s, 3)
    assert ids(s.arrive(ticket("B", "interactive"), 0).pause) == [a3.id]
    assert s.swap(a3, a1)
    assert not s.swap(a3, a2)  # a3 is no longer asked
    assert not s.swap(a1, a1)  # a1 is asked already
    assert s.paused(a3, 1.0) == Outcome() and s.running("b1") == 4  # not asked: nothing changes
    assert s.paused(a1, 1.0) == Outcome() and s.running("b1") == 3
