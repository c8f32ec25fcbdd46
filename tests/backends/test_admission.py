"""The admission scheduler's rules, one test each: plain functions, time passed in."""

from __future__ import annotations

import itertools

from backends.admission import AdmissionScheduler, ClassSpec, Outcome, Ticket, Why

CLASSES = (
    ClassSpec("interactive", 0, max_queued=4, timeout_s=10.0, retry_after_s=1.0),
    ClassSpec("batch", 1, max_queued=100, timeout_s=60.0, retry_after_s=5.0),
)
_ids = itertools.count(1)


def ticket(
    client: str, klass: str = "batch", *, cost: int = 100, at: float = 0.0, backend: str = "b1"
) -> Ticket:
    return Ticket(next(_ids), backend, client, klass, cost, at)


def ids(outcome: Outcome) -> list[int]:
    return [t.id for t in outcome.admitted]


def test_admits_at_once_while_there_is_room_then_queues() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=2)
    a, b, c = ticket("A"), ticket("A"), ticket("A")
    assert ids(s.arrive(a, 0)) == [a.id]
    assert ids(s.arrive(b, 0)) == [b.id]
    assert s.arrive(c, 0) == Outcome()
    assert (s.running("b1"), s.depth("batch")) == (2, 1)
    assert ids(s.finish(a, None)) == [c.id]
    assert (s.running("b1"), s.depth("batch")) == (2, 0)
    s.finish(b, None)
    s.finish(c, None)
    assert s.running("b1") == 0


def test_capacity_is_per_backend() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1, capacities={"b2": 2})
    assert ids(s.arrive(t1 := ticket("A", backend="b1"), 0)) == [t1.id]
    assert s.arrive(ticket("A", backend="b1"), 0) == Outcome()
    assert ids(s.arrive(t3 := ticket("A", backend="b2"), 0)) == [t3.id]
    assert ids(s.arrive(t4 := ticket("A", backend="b2"), 0)) == [t4.id]
    assert s.arrive(ticket("A", backend="b2"), 0) == Outcome()


def test_a_finish_admits_only_a_waiter_of_the_same_backend() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    first = ticket("A", backend="b1")
    s.arrive(first, 0)
    other = ticket("B", backend="b2")
    assert ids(s.arrive(other, 0)) == [other.id]
    s.arrive(ticket("B", backend="b2"), 0)
    waiting = ticket("A", backend="b1")
    s.arrive(waiting, 0)
    assert ids(s.finish(first, None)) == [waiting.id]
    assert s.depth("batch") == 1  # B's second waits for b2


def test_a_higher_class_goes_first_whatever_the_arrival_order() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    running = ticket("A")
    s.arrive(running, 0)
    flood = [ticket("A", at=1.0) for _ in range(5)]
    for t in flood:
        s.arrive(t, 1.0)
    turn = ticket("B", "interactive", cost=10, at=2.0)
    s.arrive(turn, 2.0)
    assert ids(s.finish(running, None)) == [turn.id]  # one slot turnover, not five
    assert ids(s.finish(turn, 10)) == [flood[0].id]


def test_fair_share_alternates_two_backlogged_clients_of_one_class() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    running = ticket("A")
    s.arrive(running, 0)
    for _ in range(8):
        s.arrive(ticket("A", at=0.5), 0.5)  # A's flood arrives first
    for _ in range(2):
        s.arrive(ticket("B", at=1.0), 1.0)
    order = []
    current = running
    while s.depth("batch"):
        (current,) = s.finish(current, current.cost).admitted
        order.append(current.client)
    assert order[:5] == ["B", "A", "B", "A", "A"]  # B started at the clock: A had one request's lead


def test_fair_share_is_over_tokens_not_requests() -> None:
    """Equal demand in tokens: the client with requests 4x as large gets a quarter of the turns."""
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    first = ticket("big", cost=400)
    s.arrive(first, 0)
    for _ in range(10):
        s.arrive(ticket("big", cost=400), 0)
        s.arrive(ticket("small", cost=100), 0)
        s.arrive(ticket("small", cost=100), 0)
    tokens = {"big": 400.0, "small": 0.0}
    current = first
    for _ in range(12):
        (current,) = s.finish(current, current.cost).admitted
        tokens[current.client] += current.cost
    assert abs(tokens["big"] - tokens["small"]) <= 400


def test_actual_usage_corrects_the_estimate() -> None:
    """A request estimated at 1000 tokens that used 10 is charged 10: its client goes first again."""
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    a = ticket("A", cost=1000)
    s.arrive(a, 0)
    s.arrive(ticket("B", cost=100), 0)
    a2 = ticket("A", cost=100)
    s.arrive(a2, 0)
    assert s.usage("batch", "A") == 1000
    s.finish(a, 10)  # B (usage 0) is admitted
    assert s.usage("batch", "A") == 10


def test_an_idle_client_banks_no_credit() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    current = ticket("A")
    s.arrive(current, 0)
    for _ in range(20):
        s.arrive(ticket("A"), 0)
    for _ in range(10):  # A alone runs up its usage (and the class clock)
        (current,) = s.finish(current, current.cost).admitted
    late = [ticket("B", at=5.0) for _ in range(4)]
    for t in late:
        s.arrive(t, 5.0)
    assert s.usage("batch", "B") == s.usage("batch", "A") - 100  # the clock: A's usage at its last admission
    order = []
    for _ in range(6):
        (current,) = s.finish(current, current.cost).admitted
        order.append(current.client)
    assert order == ["B", "A", "B", "A", "B", "A"]  # alternating, not B four times in a row


def test_a_full_class_refuses_at_once_with_its_retry_after() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    s.arrive(ticket("A", "interactive"), 0)
    for _ in range(4):
        assert s.arrive(ticket("A", "interactive"), 0) == Outcome()
    extra = ticket("B", "interactive")
    out = s.arrive(extra, 0)
    assert [(r.ticket.id, r.why, r.retry_after_s) for r in out.refused] == [(extra.id, Why.QUEUE_FULL, 1.0)]
    assert s.depth("interactive") == 4
    assert s.arrive(ticket("B", "batch"), 0) == Outcome()  # another class has its own bound


def test_waiters_expire_after_their_class_timeout() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    running = ticket("A")
    s.arrive(running, 0)
    quick = ticket("B", "interactive", at=1.0)
    slow = ticket("C", "batch", at=1.0)
    s.arrive(quick, 1.0)
    s.arrive(slow, 1.0)
    assert s.next_deadline() == 11.0
    assert s.expire(10.9) == Outcome()
    out = s.expire(11.0)
    assert [(r.ticket.id, r.why) for r in out.refused] == [(quick.id, Why.TIMEOUT)]
    assert (s.depth("interactive"), s.next_deadline()) == (0, 61.0)
    assert ids(s.finish(running, None)) == [slow.id]


def test_a_waiter_that_leaves_is_never_admitted() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    running = ticket("A")
    s.arrive(running, 0)
    gone, stays = ticket("B"), ticket("C")
    s.arrive(gone, 0)
    s.arrive(stays, 0)
    s.leave(gone.id)
    s.leave(gone.id)  # twice: nothing more
    assert ids(s.finish(running, None)) == [stays.id]
    assert s.depth("batch") == 0


def test_finishing_twice_or_a_waiter_frees_nothing() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    running = ticket("A")
    s.arrive(running, 0)
    waiting = ticket("B")
    s.arrive(waiting, 0)
    assert s.finish(waiting, None) == Outcome()  # not admitted: it holds no slot
    assert ids(s.finish(running, None)) == [waiting.id]
    s.finish(waiting, None)
    assert s.finish(waiting, None) == Outcome()
    assert s.running("b1") == 0


def test_raising_capacity_admits_waiters() -> None:
    s = AdmissionScheduler(CLASSES, default_capacity=1)
    s.arrive(ticket("A"), 0)
    w1, w2 = ticket("A"), ticket("B")
    s.arrive(w1, 0)
    s.arrive(w2, 0)
    assert sorted(ids(s.set_capacity("b1", 3))) == sorted([w1.id, w2.id])


def test_headroom_keeps_the_last_slots_for_higher_classes() -> None:
    classes = (
        CLASSES[0],
        ClassSpec("batch", 1, max_queued=100, timeout_s=60.0, retry_after_s=5.0, headroom=1),
    )
    s = AdmissionScheduler(classes, default_capacity=3)
    flood = [ticket("A") for _ in range(4)]
    assert [len(s.arrive(t, 0).admitted) for t in flood] == [1, 1, 0, 0]  # 2 of 3 slots: one kept free
    turn = ticket("B", "interactive")
    assert ids(s.arrive(turn, 0)) == [turn.id]  # at once, no turnover to wait for
    assert s.finish(turn, None) == Outcome()  # the freed slot is headroom again: batch still waits
    assert ids(s.finish(flood[0], None)) == [flood[2].id]
