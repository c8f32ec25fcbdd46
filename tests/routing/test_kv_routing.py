"""Engine KV cache events in routing: ``RouteRequest.kv_held`` in the cost model and the ttft policy."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.cost import cached_tokens, lost_history, uncached_tokens
from routing.kvindex import KvIndex, Stored
from routing.params import RoutingParams
from routing.policies.ttft import TtftPolicy
from routing.types import BackendState, Candidate, PinAction, Reason, RouteRequest

READY = BackendState.READY
POLICY = TtftPolicy(RoutingParams("ttft", 2.0, 8, False))


def cand(id: str, conversations: int = 0) -> Candidate:
    return Candidate(id, READY, 0, conversations, prefill_tps=1000.0)


def req(**kw: object) -> RouteRequest:
    base: dict[str, object] = dict(
        key="c", pinned="a", prompt_tokens=10_000, head_tokens=2000, tail_tokens=500, turn_tokens=500
    )
    base.update(kw)
    return RouteRequest(**base)  # type: ignore[arg-type]


def test_without_events_the_inference_stands() -> None:
    r = req(holders=frozenset({"b"}))
    assert [cached_tokens(cand(x), r) for x in "abc"] == [9500, 2000, 0]


def test_an_engine_with_events_is_taken_at_its_word_the_rest_inferred() -> None:
    r = req(holders=frozenset({"b"}), kv_held=(("a", 0), ("c", 6000)))
    assert [uncached_tokens(cand(x), r) for x in "abc"] == [10_000, 8000, 4000]
    assert lost_history(cand("a"), r) and not lost_history(cand("c"), r) and not lost_history(cand("b"), r)
    assert cached_tokens(cand("c"), req(kv_held=(("c", 50_000),))) == 10_000  # never more than the prompt


def test_a_pin_its_engine_evicted_is_cold_and_moves_to_the_engine_holding_the_longest_prefix() -> None:
    cands = [cand("a"), cand("b"), cand("c")]
    d = POLICY.select(cands, req(kv_held=(("a", 0), ("b", 2000), ("c", 6000))), 0.0)
    assert (d.backend, d.reason, d.pin, d.uncached_tokens) == ("c", Reason.MOVE_CHEAPER, PinAction.MOVE, 4000)


def test_a_warm_pin_stays_and_without_events_an_idle_home_only_spills() -> None:
    cands = [cand("a"), cand("b")]
    d = POLICY.select(cands, req(kv_held=(("a", 9500), ("b", 9500))), 0.0)
    assert (d.backend, d.reason, d.pin) == ("a", Reason.AFFINITY_HIT, PinAction.TOUCH)
    # Home cold by events, but no busier than b: the history is gone, so the pin moves instead of spilling.
    d = POLICY.select(cands, req(kv_held=(("a", 0), ("b", 9500))), 0.0)
    assert (d.backend, d.reason, d.pin) == ("b", Reason.MOVE_CHEAPER, PinAction.MOVE)


def test_a_new_conversation_goes_where_its_head_is_still_held() -> None:
    cands = [cand("a"), cand("b"), cand("c")]
    d = POLICY.select(cands, req(pinned=None, kv_held=(("a", 0), ("b", 0), ("c", 1984))), 0.0)
    assert (d.backend, d.reason, d.uncached_tokens) == ("c", Reason.NEW_CHEAPEST, 8016)


def test_replicas_share_the_blocks_and_keep_their_own_records() -> None:
    # Both read the same event stream: equal blocks. Only replica A finished the conversation's turn there.
    events = [Stored(tuple(bytes([i]) for i in range(8)), None, 16)]
    a, b = KvIndex(), KvIndex()
    mark = a.mark("e1")
    for kv in (a, b):
        kv.engine("e1").apply(0, list(events))
    assert a.record(("c",), "e1", mark, 130)
    assert list(a.engine("e1")._blocks.items()) == list(b.engine("e1")._blocks.items())
    assert a.snapshot("c") == (("e1", 128, True),) and b.snapshot("c") == ()  # B: unknown, it infers instead
    cands = [cand("e1"), cand("e2")]
    r = req(pinned="e1", prompt_tokens=130, head_tokens=40, tail_tokens=10)
    da = POLICY.select(cands, replace(r, kv_held=held(a)), 0.0)
    db = POLICY.select(cands, replace(r, kv_held=held(b)), 0.0)
    assert da.backend == db.backend == "e1" and (da.uncached_tokens, db.uncached_tokens) == (2, 10)


def held(kv: KvIndex) -> tuple[tuple[str, int], ...]:
    return tuple((backend, tokens) for backend, tokens, _whole in kv.snapshot("c"))


IDS = ["a", "b", "c", "d"]
CANDS = st.lists(
    st.builds(
        Candidate,
        id=st.sampled_from(IDS),
        state=st.sampled_from(list(BackendState)),
        in_flight=st.integers(0, 20),
        conversations=st.integers(0, 50),
        prefill_tps=st.floats(100.0, 1e4),
        retention=st.floats(0.0, 1.0),  # a share (the gateway's retention estimate)
    ),
    max_size=4,
    unique_by=lambda c: c.id,
)
HELD = st.lists(
    st.tuples(st.sampled_from(IDS), st.integers(0, 50_000)), max_size=4, unique_by=lambda t: t[0]
).map(lambda xs: tuple(sorted(xs)))


@settings(max_examples=300, deadline=None)
@given(CANDS, HELD, st.one_of(st.none(), st.sampled_from(IDS)), st.integers(0, 50_000))
def test_equal_snapshots_give_equal_decisions_and_only_routable_backends(
    cands: list[Candidate], held: tuple[tuple[str, int], ...], pinned: str | None, prompt: int
) -> None:
    r = req(pinned=pinned, prompt_tokens=prompt, kv_held=held)
    one = TtftPolicy(RoutingParams("ttft", 2.0, 8, False)).select(cands, r, 0.0)
    two = TtftPolicy(RoutingParams("ttft", 2.0, 8, False)).select(list(cands), r, 0.0)
    assert one == two
    ok = {c.id for c in cands if c.routable}
    assert one.backend in ok if ok else one.backend is None
