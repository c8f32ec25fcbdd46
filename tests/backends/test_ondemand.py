"""The on-demand scheduler as plain functions: every rule in ``backends.ondemand``'s docstring."""

from __future__ import annotations

from collections.abc import Mapping

from backends.ondemand import (
    Action,
    Admit,
    Arrive,
    Event,
    EvictionRefused,
    Failed,
    GroupSpec,
    Hold,
    Leave,
    Phase,
    Ready,
    Reject,
    RejectWhy,
    Release,
    Schedule,
    SchedulerPolicy,
    Start,
    Stop,
    Stopped,
    StopWhy,
    Tick,
    Unhold,
    decide,
    next_deadline,
)
from backends.ondemand import EngineSpec as E

P = Phase


class Driver:
    """Feeds events at given times and keeps every action; ``busy`` stands for the registry's leases."""

    def __init__(self, policy: SchedulerPolicy) -> None:
        self.p = policy
        self.s = Schedule.initial(policy)
        self.busy: dict[str, int] = {}
        self.log: list[Action] = []

    def __call__(self, event: Event, now: float, busy: Mapping[str, int] | None = None) -> list[Action]:
        self.s, actions = decide(self.s, event, now, self.p, self.busy if busy is None else busy)
        self.log += actions
        return actions

    def phase(self, engine: str) -> Phase:
        return self.s.engines[engine].phase

    def up(self, engine: str, now: float) -> None:
        """Drive a started engine to READY."""
        self(Ready(engine), now)

    def swap_done(self, old: str, new: str, now: float) -> list[Action]:
        out = self(Stopped(old), now)
        assert Start(new) in out
        return out + self(Ready(new), now)


def one(ttl: float | None = None, **kw: float) -> SchedulerPolicy:
    return SchedulerPolicy((E("a", ("ma",), idle_ttl_s=ttl),), **kw)  # type: ignore[arg-type]


def pair(max_running: int = 1, residency: float = 0.0, ttl: float | None = None) -> SchedulerPolicy:
    return SchedulerPolicy(
        (E("a", ("ma",), "gpu", ttl), E("b", ("mb",), "gpu", ttl)),
        {"gpu": GroupSpec(max_running, residency)},
    )


# -- start on first request ----------------------------------------------------------------------------------


def test_the_first_request_starts_the_engine_and_is_admitted_when_it_is_ready() -> None:
    d = Driver(one())
    assert d(Arrive(1, "ma"), 0.0) == [Start("a")]
    assert d.phase("a") is P.STARTING and d.s.waiting("ma") == 1
    assert d(Ready("a"), 5.0) == [Admit(1, "a")]
    assert d.s.engines["a"].claims == 1 and d.s.queue == ()


def test_twenty_concurrent_first_requests_start_it_once_and_are_all_admitted_in_order() -> None:
    d = Driver(one())
    for t in range(20):
        d(Arrive(t, "ma"), 0.1 * t)
    assert [a for a in d.log if isinstance(a, Start)] == [Start("a")]
    assert d(Ready("a"), 3.0) == [Admit(t, "a") for t in range(20)]
    assert d.s.engines["a"].claims == 20


def test_a_request_for_a_ready_engine_is_admitted_at_once_and_release_returns_the_claim() -> None:
    d = Driver(one())
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 1.0)
    assert d(Arrive(2, "ma"), 2.0) == [Admit(2, "a")]
    d(Release("a"), 3.0)
    d(Release("a"), 3.0)
    d(Release("a"), 3.0)  # one too many: floors at zero
    assert d.s.engines["a"].claims == 0 and d.s.engines["a"].last_used == 3.0


def test_unknown_engines_and_tickets_change_nothing() -> None:
    d = Driver(one())
    before = d.s
    for ev in (Ready("x"), Failed("x", "?"), Stopped("x"), Release("x"), Hold("x", 9, ""), Leave(7), Tick()):
        assert d(ev, 1.0) == []
    assert d.s == before


# -- failed starts -------------------------------------------------------------------------------------------


def test_a_failed_start_stops_the_engine_and_answers_every_waiter_with_the_cause() -> None:
    d = Driver(one())
    d(Arrive(1, "ma"), 0.0)
    d(Arrive(2, "ma"), 0.5)
    out = d(Failed("a", "engine process exited with code 3; last output: boom"), 1.0)
    msg = "backend a failed to start: engine process exited with code 3; last output: boom"
    assert out == [
        Stop("a", StopWhy.FAILED, "engine process exited with code 3; last output: boom"),
        Reject(1, RejectWhy.START_FAILED, msg),
        Reject(2, RejectWhy.START_FAILED, msg),
    ]
    assert d.phase("a") is P.STOPPING and d.s.engines["a"].last_error is not None
    d(Stopped("a"), 2.0)
    assert d(Arrive(3, "ma"), 3.0) == [Start("a")]  # the next request tries again


def test_a_request_arriving_while_the_engine_stops_starts_it_again_once_stopped() -> None:
    d = Driver(one(ttl=10))
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 1.0)
    d(Release("a"), 2.0)
    assert d(Tick(), 12.0) == [Stop("a", StopWhy.IDLE, "idle for 10 s (idle_ttl_s 10)")]
    assert d(Arrive(2, "ma"), 12.5) == []  # stopping: it waits
    assert d(Stopped("a"), 13.0) == [Start("a")]
    assert d(Ready("a"), 14.0) == [Admit(2, "a")]


def test_a_ready_engine_that_fails_is_left_to_its_lifecycle_and_a_failed_recovery_stops_it() -> None:
    d = Driver(one())
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 1.0)
    assert d(Failed("a", "health probe failed: timed out"), 2.0) == []  # no stop: request 1 is in flight
    assert (d.phase("a"), d.s.engines["a"].claims) == (P.STARTING, 1)
    assert d(Arrive(2, "ma"), 2.5) == []  # waits for the recovery
    assert d(Ready("a"), 3.0) == [Admit(2, "a")]  # it came back
    d(Failed("a", "engine process was killed by signal 9"), 4.0)
    assert d(Arrive(3, "ma"), 4.5) == []
    assert d(Failed("a", "engine process exited with code 1"), 5.0) == [  # the restart failed too
        Stop("a", StopWhy.FAILED, "engine process exited with code 1"),
        Reject(3, RejectWhy.START_FAILED, "backend a failed to start: engine process exited with code 1"),
    ]
    assert d(Failed("a", "again"), 5.1) == []  # stopping already
    d(Stopped("a"), 6.0)
    assert d(Arrive(4, "ma"), 7.0) == [Start("a")]


# -- idle TTL ------------------------------------------------------------------------------------------------


def test_idle_ttl_stops_an_engine_only_when_nothing_is_in_flight() -> None:
    d = Driver(one(ttl=30))
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 1.0)
    assert d(Tick(), 40.0) == []  # its claim is still held
    d(Release("a"), 41.0)
    assert d(Tick(), 70.0) == []  # 29 s idle
    assert d(Tick(), 72.0, busy={"a": 1}) == []  # a lease without a claim counts as use
    assert d(Tick(), 101.0) == []
    assert d(Tick(), 102.0) == [Stop("a", StopWhy.IDLE, "idle for 30 s (idle_ttl_s 30)")]
    assert d.phase("a") is P.STOPPING
    d(Stopped("a"), 103.0)
    assert d.phase("a") is P.STOPPED


def test_next_deadline_names_the_idle_ttl_the_residency_the_hold_and_the_waiters_timeout() -> None:
    d = Driver(pair(residency=20, ttl=60))
    assert next_deadline(d.s, 0.0, d.p) is None
    d(Arrive(1, "ma"), 0.0)
    assert next_deadline(d.s, 0.0, d.p) == 900.0  # the waiter's timeout
    d.up("a", 2.0)
    assert next_deadline(d.s, 2.0, d.p) == 22.0  # residency ends
    assert next_deadline(d.s, 22.0, d.p) == 62.0  # last use + ttl
    d(Hold("a", 50.0, "bench"), 23.0)
    assert next_deadline(d.s, 23.0, d.p) == 50.0


def test_no_ttl_means_the_engine_stays_up() -> None:
    d = Driver(one())
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 1.0)
    d(Release("a"), 1.0)
    assert d(Tick(), 1e6) == []


# -- exclusive groups ----------------------------------------------------------------------------------------


def test_a_group_of_two_swaps_when_the_running_member_is_idle() -> None:
    d = Driver(pair())
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 1.0)
    d(Release("a"), 2.0)
    assert d(Arrive(2, "mb"), 3.0) == [Stop("a", StopWhy.SWAP, "swapped out for b")]
    assert d.phase("a") is P.STOPPING and d.phase("b") is P.STOPPED
    assert d(Stopped("a"), 4.0) == [Start("b")]  # only once a's slot is free
    assert d(Ready("b"), 5.0) == [Admit(2, "b")]


def test_never_evict_an_engine_with_requests_in_flight() -> None:
    d = Driver(pair())
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 1.0)  # request 1 holds a claim
    assert d(Arrive(2, "mb"), 2.0) == [EvictionRefused("a")]
    assert d(Tick(), 3.0) == []  # refused once per waiter
    # the claim is gone, but a lease (a request routed to a without a claim) still holds it
    assert d(Release("a"), 4.0, busy={"a": 1}) == []
    assert d(Tick(), 5.0, busy={"a": 1}) == []
    assert d(Tick(), 6.0) == [Stop("a", StopWhy.SWAP, "swapped out for b")]


def test_minimum_residency_delays_the_swap_and_no_alternation_thrashes_below_it() -> None:
    d = Driver(pair(residency=30))
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 0.0)
    d(Release("a"), 1.0)
    assert d(Arrive(2, "mb"), 2.0) == []  # a is idle but resident until t=30
    assert d(Arrive(3, "ma"), 3.0) == [Admit(3, "a")]  # during residency a serves its own model
    d(Release("a"), 4.0)
    assert d(Tick(), 29.9) == []
    assert d(Tick(), 30.0) == [Stop("a", StopWhy.SWAP, "swapped out for b")]
    d.swap_done("a", "b", 31.0)
    # Alternating traffic: a's request waits for b's residency (b ready at 31 -> no swap before 61).
    d(Release("b"), 31.5)
    assert d(Arrive(4, "ma"), 32.0) == []
    assert d(Tick(), 60.9) == []
    assert d(Tick(), 61.0) == [Stop("b", StopWhy.SWAP, "swapped out for a")]
    swaps = [a for a in d.log if isinstance(a, Stop) and a.why is StopWhy.SWAP]
    assert len(swaps) == 2  # two swaps in 61 s with residency 30, however the requests alternate


def test_arrival_order_a_running_engine_past_its_residency_drains_for_an_older_waiter() -> None:
    d = Driver(pair(residency=10))
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 0.0)
    d(Arrive(2, "mb"), 11.0)  # older waiter for b; a busy (ticket 1) and past residency
    assert d(Arrive(3, "ma"), 12.0) == []  # queues behind ticket 2: a drains
    assert [w.ticket for w in d.s.queue] == [2, 3]
    assert d(Release("a"), 13.0) == [Stop("a", StopWhy.SWAP, "swapped out for b")]
    d(Stopped("a"), 14.0)
    assert d(Ready("b"), 15.0) == [Admit(2, "b")]  # 3 waits: b is resident until 25
    assert d(Arrive(4, "mb"), 16.0) == [Admit(4, "b")]  # b serves its own during residency
    d(Release("b"), 17.0)
    d(Release("b"), 18.0)
    assert d(Tick(), 25.0) == [Stop("b", StopWhy.SWAP, "swapped out for a")]
    d(Stopped("b"), 26.0)
    assert d(Ready("a"), 27.0) == [Admit(3, "a")]


def test_groups_do_not_wait_on_each_other_and_ungrouped_engines_start_at_once() -> None:
    p = SchedulerPolicy(
        (E("a", ("ma",), "g1"), E("b", ("mb",), "g1"), E("c", ("mc",), "g2"), E("d", ("md",))),
        {"g1": GroupSpec(1), "g2": GroupSpec(1)},
    )
    d = Driver(p)
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 0.0)
    assert d(Arrive(2, "mb"), 1.0) == [EvictionRefused("a")]
    assert d(Arrive(3, "mc"), 1.0) == [Start("c")]
    assert d(Arrive(4, "md"), 1.0) == [Start("d")]


def test_max_running_two_starts_a_second_member_without_a_swap() -> None:
    p = SchedulerPolicy(
        (E("a", ("ma",), "g"), E("b", ("mb",), "g"), E("c", ("mc",), "g")), {"g": GroupSpec(2)}
    )
    d = Driver(p)
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 0.0)
    d(Release("a"), 0.5)
    assert d(Arrive(2, "mb"), 1.0) == [Start("b")]
    d.up("b", 2.0)
    d(Release("b"), 3.0)
    # c evicts the least recently used idle member: a (used at 0.5) rather than b (3.0)
    assert d(Arrive(3, "mc"), 4.0) == [Stop("a", StopWhy.SWAP, "swapped out for c")]


def test_a_stopping_member_holds_its_slot_until_stopped() -> None:
    d = Driver(pair(ttl=5))
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 0.0)
    d(Release("a"), 0.0)
    d(Tick(), 5.0)
    assert d.phase("a") is P.STOPPING
    assert d(Arrive(2, "mb"), 5.5) == []
    assert d(Stopped("a"), 6.0) == [Start("b")]


# -- holds ---------------------------------------------------------------------------------------------------


def test_a_hold_keeps_the_engine_and_the_other_model_is_rejected_naming_it() -> None:
    d = Driver(pair(ttl=10))
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 0.0)
    d(Release("a"), 1.0)
    d(Hold("a", 100.0, "benchmark run 7"), 2.0)
    out = d(Arrive(2, "mb"), 40.0)
    assert out == [
        Reject(
            2,
            RejectWhy.HELD,
            "backend b cannot start: group 'gpu' is held by backend a (benchmark run 7) for another 60 s",
            60.0,
        )
    ]
    assert d(Tick(), 99.0) == []  # idle far past its TTL, but held
    assert d(Arrive(3, "ma"), 50.0) == [Admit(3, "a")]  # its own model is served


def test_an_ended_hold_lets_the_ttl_run_from_its_end() -> None:
    d = Driver(one(ttl=10))
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 0.0)
    d(Release("a"), 0.0)
    d(Hold("a", 50.0, "job"), 1.0)
    assert d(Tick(), 50.0) == []
    assert d.s.engines["a"].hold_until is None
    assert d(Tick(), 60.0) == [Stop("a", StopWhy.IDLE, "idle for 10 s (idle_ttl_s 10)")]


def test_unhold_releases_the_group() -> None:
    d = Driver(pair())
    d(Arrive(1, "ma"), 0.0)
    d.up("a", 0.0)
    d(Release("a"), 0.0)
    d(Hold("a", 100.0, ""), 1.0)
    assert d(Arrive(2, "mb"), 2.0)[0].why is RejectWhy.HELD  # type: ignore[union-attr]
    d(Unhold("a"), 3.0)
    assert d(Arrive(3, "mb"), 4.0) == [Stop("a", StopWhy.SWAP, "swapped out for b")]


def test_holding_a_stopped_engine_starts_it_and_evicts_an_idle_member() -> None:
    d = Driver(pair())
    d(Arrive(1, "mb"), 0.0)
    d.up("b", 0.0)
    d(Release("b"), 0.0)
    assert d(Hold("a", 100.0, "batch"), 1.0) == [Stop("b", StopWhy.SWAP, "swapped out for a")]
    assert d(Stopped("b"), 2.0) == [Start("a")]
    d.up("a", 3.0)
    assert d(Arrive(2, "mb"), 4.0)[0].why is RejectWhy.HELD  # type: ignore[union-attr]


# -- bounds --------------------------------------------------------------------------------------------------


def test_a_full_queue_rejects_at_once_with_a_retry_after() -> None:
    d = Driver(one(max_waiting=2, retry_after_s=7))
    d(Arrive(1, "ma"), 0.0)
    d(Arrive(2, "ma"), 0.0)
    assert d(Arrive(3, "ma"), 0.0) == [
        Reject(3, RejectWhy.QUEUE_FULL, "2 requests for model 'ma' are waiting already", 7)
    ]
    d.up("a", 1.0)  # both admitted: the queue is free again
    assert d(Arrive(4, "ma"), 1.0) == [Admit(4, "a")]


def test_a_waiter_times_out_and_one_that_leaves_is_forgotten() -> None:
    d = Driver(one(wait_timeout_s=60))
    d(Arrive(1, "ma"), 0.0)
    d(Arrive(2, "ma"), 10.0)
    d(Leave(2), 11.0)
    assert d(Tick(), 60.0) == [
        Reject(1, RejectWhy.TIMEOUT, "waited 60 s for an engine for model 'ma' to start", 5.0)
    ]
    assert d.s.queue == ()


def test_a_model_on_two_engines_uses_the_first_and_admits_to_the_least_claimed() -> None:
    d = Driver(SchedulerPolicy((E("a", ("m",)), E("b", ("m",)))))
    assert d(Arrive(1, "m"), 0.0) == [Start("a")]
    assert d(Arrive(2, "m"), 0.0) == []  # a is starting for it already
    assert d(Ready("a"), 1.0) == [Admit(1, "a"), Admit(2, "a")]
