"""Properties of the ttft policy over generated snapshots (hypothesis), and of its hot path's shortcuts."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.cost import cost, total_s
from routing.keys import first_reply, reply_text
from routing.params import RoutingParams
from routing.policies.ttft import TtftPolicy
from routing.shape import chat_turns, message_chars, turns_shape
from routing.types import BackendState, Candidate, RouteRequest

IDS = ["a", "b", "c", "d", "e"]

candidates = st.lists(
    st.builds(
        Candidate,
        id=st.sampled_from(IDS),
        state=st.sampled_from(list(BackendState)),
        in_flight=st.integers(0, 50),
        conversations=st.integers(0, 200),
        weight=st.floats(0.1, 8.0),
        prefilling=st.integers(0, 100_000),
        prefill_tps=st.one_of(st.just(0.0), st.floats(10.0, 1e5)),
        waiting=st.integers(-1, 40),
        retention=st.one_of(st.just(1.0), st.floats(0.0, 1.0)),
        placed_at=st.one_of(st.just(float("-inf")), st.floats(0.0, 100.0)),
    ),
    max_size=5,
    unique_by=lambda c: c.id,
)
backend = st.one_of(st.none(), st.sampled_from([*IDS, "gone"]))
requests = st.builds(
    RouteRequest,
    key=st.text(max_size=8),
    pinned=backend,
    exclude=st.frozensets(st.sampled_from(IDS), max_size=3),
    prompt_tokens=st.integers(0, 200_000),
    head_tokens=st.integers(0, 100_000),
    tail_tokens=st.integers(0, 20_000),
    turn_tokens=st.integers(0, 5000),
    holders=st.frozensets(st.sampled_from(IDS), max_size=5),
    hint=backend,
    kv_held=st.dictionaries(st.sampled_from(IDS), st.integers(-10, 300_000), max_size=5).map(
        lambda held: tuple(sorted(held.items()))
    ),
)
POLICY = TtftPolicy(RoutingParams("ttft", 2.0, 8, False))


@settings(max_examples=400, deadline=None)
@given(candidates, requests)
def test_never_picks_a_backend_that_is_not_routable_or_excluded(
    cands: list[Candidate], r: RouteRequest
) -> None:
    d = POLICY.select(cands, r, 0.0)
    ok = {c.id for c in cands if c.state is BackendState.READY and c.id not in r.exclude}
    if ok:
        assert d.backend in ok
    else:
        assert d.backend is None


@settings(max_examples=300, deadline=None)
@given(candidates, requests)
def test_equal_inputs_give_equal_decisions_on_every_replica(cands: list[Candidate], r: RouteRequest) -> None:
    other_replica = TtftPolicy(RoutingParams("ttft", 2.0, 8, False))
    assert POLICY.select(cands, r, 0.0) == other_replica.select(list(cands), r, 5.0)
    assert POLICY.select(cands, r, 0.0) == POLICY.select(cands, r, 0.0)


@settings(max_examples=200, deadline=None)
@given(candidates, requests)
def test_explained_costs_rank_cheapest_first_and_a_new_conversation_goes_to_a_near_cheapest(
    cands: list[Candidate], r: RouteRequest
) -> None:
    """Cheapest first; a retry takes the cheapest, a new conversation one within the spread margin of it
    that no backend within the margin was given a new conversation less recently than."""
    r = RouteRequest(r.key, None, r.exclude, r.prompt_tokens, r.head_tokens, r.tail_tokens, r.turn_tokens,
                     r.holders, None, explain=True)  # fmt: skip
    d = POLICY.select(cands, r, 0.0)
    if d.backend is not None:
        assert [c.total_s for c in d.costs] == sorted(c.total_s for c in d.costs)
        if r.exclude:
            assert d.backend == d.costs[0].backend
            return
        cheapest = d.costs[0].total_s
        limit = cheapest + max(0.02, 0.05 * cheapest)
        near = {c.backend for c in d.costs if c.total_s <= limit}
        assert d.backend in near
        at = {c.id: c.placed_at for c in cands}
        assert at[d.backend] == min(at[b] for b in near)


@settings(max_examples=400, deadline=None)
@given(candidates, requests, st.integers(0, 400_000))
def test_the_hot_path_total_is_the_explained_cost_s_total(
    cands: list[Candidate], r: RouteRequest, capacity: int
) -> None:
    for c in cands:
        c = c._replace(kv_capacity=capacity)
        assert total_s(c, r, 2.0) == cost(c, r, 2.0).total_s  # the same float: the same rank


messages = st.lists(
    st.one_of(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool", 3])},
            optional={
                "content": st.one_of(
                    st.none(), st.text(max_size=12), st.lists(st.fixed_dictionaries({"text": st.text()}))
                ),
                "tool_calls": st.just([{"function": {"arguments": '{"a": 1}'}}]),
            },
        ),
        st.just("not a message"),
    ),
    max_size=8,
)


@settings(max_examples=400, deadline=None)
@given(messages)
def test_one_walk_finds_the_shape_and_the_first_reply(msgs: list[Any]) -> None:
    shape, reply = chat_turns(msgs)
    assert shape == turns_shape(msgs, message_chars)
    assert (None if reply is None else reply_text(reply)) == first_reply(msgs)
