"""A one-off spill pays the re-read of its turn at home: identical heads do not spill for a short queue.

Twins (one head, replies told apart) have every engine as a holder of their head, so a follow-up elsewhere
reads only its reply and tail: a few hundred tokens more than at home. A spill leaves that turn out of home's
cache, and the next turn, back home, reads it again; the spill is worth it only when home's queue alone is
longer than the whole turn elsewhere (and the margin).
"""

from __future__ import annotations

from routing.params import RoutingParams
from routing.policies.ttft import TtftPolicy
from routing.types import BackendState, Candidate, PinAction, Reason, RouteRequest

NOW = 1000.0
TPS = 4000.0
HEAD, REPLY, TAIL = 2500, 32, 600


def cand(id_: str, *, active: int = 4, in_flight: int = 2, prefilling: int = 0) -> Candidate:
    return Candidate(id_, BackendState.READY, in_flight, active, 1.0, prefilling, TPS)


def twin_turn_2(**kw: object) -> RouteRequest:
    """Turn 2 of a twin whose first reply came from "home"; every engine prefilled the head."""
    fields: dict[str, object] = {
        "key": "reply-key",
        "prompt_tokens": HEAD + REPLY + TAIL,
        "head_tokens": HEAD,
        "tail_tokens": TAIL,
        "hint": "home",
        "holders": frozenset({"home", "other", "third"}),
    }
    fields.update(kw)
    return RouteRequest(**fields)  # type: ignore[arg-type]


def ttft() -> TtftPolicy:
    return TtftPolicy(RoutingParams("ttft", 2.0, 8, False))


def test_a_twin_stays_home_behind_a_short_queue_though_a_head_holder_is_idle() -> None:
    # Measured (identical-2x16): home had ~1250 tokens queued, another holder none; the turn elsewhere
    # reads reply + tail (632 tokens) against 600 at home, and it spilled, cold, then came back cold.
    cands = [cand("home", prefilling=1250), cand("other"), cand("third", prefilling=900)]
    d = ttft().select(cands, twin_turn_2(), NOW)
    assert (d.backend, d.reason, d.pin) == ("home", Reason.AFFINITY_HIT, PinAction.CLAIM)
    assert d.uncached_tokens == TAIL


def test_a_pinned_follow_up_stays_behind_a_queue_shorter_than_the_turn_elsewhere_and_the_margin() -> None:
    # Elsewhere 632 tokens + margin 0.6 x (queue + 600) >= queue: stay, up to a queue of about 2500 tokens.
    for queue in (600, 1500, 2400):
        cands = [cand("home", prefilling=queue), cand("other")]
        d = ttft().select(cands, twin_turn_2(pinned="home", hint=None), NOW)
        assert (d.backend, d.reason, d.pin) == ("home", Reason.AFFINITY_HIT, PinAction.TOUCH), queue


def test_a_long_queue_at_home_still_spills_one_turn_and_keeps_the_pin() -> None:
    cands = [cand("home", prefilling=6000), cand("other")]
    d = ttft().select(cands, twin_turn_2(pinned="home", hint=None), NOW)
    assert (d.backend, d.reason, d.pin) == ("other", Reason.SPILL_OVERLOAD, PinAction.NONE)
    assert d.uncached_tokens == REPLY + TAIL


def test_a_long_tail_is_not_spilled_to_be_read_twice() -> None:
    # A 3000-token later turn: elsewhere it reads 3032, home 3000 after its queue; spilling reads it twice.
    # (Without the re-read, a queue over ~4600 tokens spilled it; now one over ~12000 does.)
    cands = [cand("home", prefilling=8000), cand("other")]
    d = ttft().select(cands, twin_turn_2(pinned="home", hint=None, tail_tokens=3000,
                                         prompt_tokens=HEAD + REPLY + 3000), NOW)  # fmt: skip
    assert (d.backend, d.reason) == ("home", Reason.AFFINITY_HIT)


def test_home_busier_for_good_still_moves_the_pin_without_paying_the_re_read() -> None:
    # The re-read is a spill's cost only: a moved pin's next turn is read where it moved.
    cands = [cand("home", active=20, prefilling=2000), cand("other", active=2)]
    d = ttft().select(cands, twin_turn_2(pinned="home", hint=None), NOW)
    assert (d.backend, d.reason, d.pin) == ("other", Reason.MOVE_CHEAPER, PinAction.MOVE)


def test_a_home_busier_by_one_conversation_moves_the_pin_rather_than_spilling() -> None:
    # Busier for good has no margin on the load term: a move pays one re-prefill, where a spill is cold
    # now and cold again back home. (A margin there, from this turn's own time, turned heterogeneous
    # engines' moves into spills and the identical-head rows gained nothing: measured, 4-5 rounds.)
    cands = [cand("home", active=6, prefilling=2000), cand("other", active=4)]
    d = ttft().select(cands, twin_turn_2(pinned="home", hint=None), NOW)
    assert (d.backend, d.reason, d.pin) == ("other", Reason.MOVE_CHEAPER, PinAction.MOVE)


def test_requests_in_flight_behind_a_queue_do_not_make_home_busier_for_good() -> None:
    # Measured (identical-2x16-long, a ~3000-token later turn): home had 8030 tokens queued and four
    # requests in flight, a head holder 1676 and two; both had two conversations between turns. Counted in
    # the load term as well as in the queue, the in-flight ones made home "busier for good" and the twin
    # moved (cold) for a queue that drained. In flight is the queue's: home is no busier, and a spill
    # that re-reads the 2296-token tail at home next turn does not pay: it stays.
    def engine(id_: str, in_flight: int, prefilling: int, waiting: int) -> Candidate:
        return Candidate(id_, BackendState.READY, in_flight, 4, 1.0, prefilling, 3840.0, waiting,
                         kv_capacity=200_000, competing=2)  # fmt: skip

    cands = [engine("home", 4, 8030, 3), engine("other", 2, 1676, 0)]
    request = twin_turn_2(prompt_tokens=5216, head_tokens=2861, tail_tokens=2296, turn_tokens=2833,
                          holders=frozenset({"home", "other"}))  # fmt: skip
    d = ttft().select(cands, request, NOW)
    assert (d.backend, d.reason, d.pin) == ("home", Reason.AFFINITY_HIT, PinAction.CLAIM)
    # The same queue with the extra requests in flight as conversations between turns: busier for good.
    busier = [engine("home", 2, 8030, 3)._replace(competing=4), engine("other", 2, 1676, 0)]
    d = ttft().select(busier, request, NOW)
    assert (d.backend, d.reason, d.pin) == ("other", Reason.MOVE_CHEAPER, PinAction.CLAIM)
