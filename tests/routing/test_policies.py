"""Every routing rule as a plain function of a snapshot."""

from __future__ import annotations

from collections import Counter

from routing.affinity import AffinityTable
from routing.load import find
from routing.params import RoutingParams
from routing.policies import make_policy
from routing.policies.affinity import AffinityPolicy
from routing.policies.least_loaded import LeastLoadedPolicy
from routing.policies.round_robin import RoundRobinPolicy
from routing.types import BackendState, Candidate, PinAction, Reason, RouteRequest

READY = BackendState.READY


def cand(
    id_: str, in_flight: int = 0, conversations: int = 0, weight: float = 1.0, state: BackendState = READY
) -> Candidate:
    return Candidate(id_, state, in_flight, conversations, weight)


NOW = 1000.0


def params(**overrides: object) -> RoutingParams:
    fields: dict[str, object] = {
        "policy": "affinity",
        "spill_factor": 2.0,
        "spill_min_in_flight": 8,
        "repin_on_spill": False,
    }
    fields.update(overrides)
    return RoutingParams(**fields)  # type: ignore[arg-type]


def affinity(**cfg: object) -> AffinityPolicy:
    return AffinityPolicy(params(**cfg))


def test_pinned_healthy_not_overloaded_stays() -> None:
    d = affinity().select([cand("a", 3), cand("b", 0)], RouteRequest("k", pinned="a"), NOW)
    assert (d.backend, d.reason, d.pin) == ("a", Reason.AFFINITY_HIT, PinAction.TOUCH)


def test_hot_key_spills_when_pinned_is_overloaded() -> None:
    p = affinity(spill_factor=2.0, spill_min_in_flight=4)
    cands = [cand("a", in_flight=10), cand("b", in_flight=2), cand("c", in_flight=1, conversations=5)]
    d = p.select(cands, RouteRequest("k", pinned="a"), NOW)
    assert (d.backend, d.reason, d.pin) == ("b", Reason.SPILL_OVERLOAD, PinAction.NONE)


def test_spill_can_move_the_pin_when_configured() -> None:
    d = affinity(repin_on_spill=True).select(
        [cand("a", 10), cand("b", 0)], RouteRequest("k", pinned="a"), NOW
    )
    assert (d.backend, d.pin) == ("b", PinAction.MOVE)


def test_no_spill_below_the_floor_or_the_factor() -> None:
    p = affinity(spill_factor=2.0, spill_min_in_flight=4)
    assert (
        p.select([cand("a", 3), cand("b", 0)], RouteRequest("k", "a"), NOW).backend == "a"
    )  # under the floor
    assert p.select([cand("a", 8), cand("b", 4)], RouteRequest("k", "a"), NOW).backend == "a"  # exactly 2x
    assert p.select([cand("a", 9), cand("b", 4)], RouteRequest("k", "a"), NOW).backend == "b"  # over 2x


def test_overload_is_per_unit_of_weight() -> None:
    p = affinity(spill_factor=2.0, spill_min_in_flight=4)
    big = cand("a", in_flight=10, weight=4.0)  # 2.5 per unit
    assert p.select([big, cand("b", 2)], RouteRequest("k", "a"), NOW).backend == "a"


def test_single_backend_never_spills() -> None:
    assert affinity().select([cand("a", 100)], RouteRequest("k", "a"), NOW).reason is Reason.AFFINITY_HIT


def test_pinned_down_or_draining_repins_to_least_loaded_not_first() -> None:
    for state in (BackendState.DOWN, BackendState.DRAINING, BackendState.CORDONED):
        cands = [cand("a", state=state), cand("b", 5), cand("c", 1), cand("d", 3)]
        d = affinity().select(cands, RouteRequest("k", pinned="a"), NOW)
        assert (d.backend, d.reason, d.pin) == ("c", Reason.REPIN_UNHEALTHY, PinAction.MOVE)


def test_pinned_backend_removed_from_config_repins() -> None:
    d = affinity().select([cand("b", 1), cand("c", 0)], RouteRequest("k", pinned="gone"), NOW)
    assert (d.backend, d.reason, d.pin) == ("c", Reason.REPIN_REMOVED, PinAction.MOVE)


def test_repin_after_a_death_spreads_over_survivors() -> None:
    """Re-pinning dozens of orphaned conversations spreads them, because each re-pin counts."""
    table = AffinityTable(ttl_s=100, max_entries=1000)
    p = affinity()
    for i in range(60):
        key = f"k{i}"
        cands = [cand(b, conversations=table.counts().get(b, 0)) for b in ("a", "b", "c")]
        d = p.select(cands, RouteRequest(key), NOW)
        table.claim(key, d.backend or "", now=0)
    assert dict(table.counts()) == {"a": 20, "b": 20, "c": 20}
    # a dies: its 20 conversations come back one by one
    for i in range(60):
        key = f"k{i}"
        pinned = table.get(key, now=1)
        cands = [cand("a", state=BackendState.DOWN)] + [
            cand(b, conversations=table.counts().get(b, 0)) for b in ("b", "c")
        ]
        d = p.select(cands, RouteRequest(key, pinned=pinned), NOW)
        if d.pin is PinAction.MOVE:
            table.move(key, d.backend or "", now=1)
    assert dict(table.counts()) == {"b": 30, "c": 30}


def test_new_conversation_goes_to_fewest_conversations_plus_in_flight_per_weight() -> None:
    cands = [
        cand("a", in_flight=1, conversations=3),
        cand("b", in_flight=3, conversations=0),
        cand("c", in_flight=2, conversations=4, weight=3.0),
    ]
    d = affinity().select(cands, RouteRequest("new"), NOW)
    assert (d.backend, d.reason, d.pin) == ("c", Reason.NEW_LEAST_LOADED, PinAction.CLAIM)


def test_ties_break_deterministically_but_spread_across_keys() -> None:
    cands = [cand("a"), cand("b"), cand("c")]
    p = affinity()
    first = [p.select(cands, RouteRequest(f"k{i}"), NOW).backend for i in range(300)]
    again = [p.select(list(reversed(cands)), RouteRequest(f"k{i}"), NOW).backend for i in range(300)]
    assert first == again  # order of candidates does not matter
    spread = Counter(first)
    assert set(spread) == {"a", "b", "c"} and min(spread.values()) > 60


def test_nothing_routable_gives_no_backend() -> None:
    d = affinity().select([cand("a", state=BackendState.DOWN)], RouteRequest("k", "a"), NOW)
    assert d.backend is None and d.reason is Reason.NO_BACKEND
    assert LeastLoadedPolicy().select([], RouteRequest("k"), NOW).backend is None
    assert (
        RoundRobinPolicy().select([cand("a", state=BackendState.STARTING)], RouteRequest("k"), NOW).backend
        is None
    )


def test_retry_away_from_the_pinned_backend_moves_the_pin() -> None:
    # The retry re-reads the whole prompt on b: b holds the conversation now, and a keeps failing.
    request = RouteRequest("k", pinned="a", exclude=frozenset({"a"}))
    d = affinity().select([cand("a"), cand("b", 9)], request, NOW)
    assert (d.backend, d.reason, d.pin) == ("b", Reason.RETRY_NEXT, PinAction.MOVE)


def test_retry_of_an_unpinned_or_spilled_request_leaves_the_pin() -> None:
    spilled = RouteRequest("k", pinned="c", exclude=frozenset({"a"}))  # a was a spill target, c keeps the pin
    d = affinity().select([cand("a"), cand("b"), cand("c", 50)], spilled, NOW)
    assert (d.backend, d.reason, d.pin) == ("b", Reason.RETRY_NEXT, PinAction.NONE)
    d = affinity().select([cand("a"), cand("b")], RouteRequest("k", exclude=frozenset({"a"})), NOW)
    assert (d.backend, d.pin) == ("b", PinAction.NONE)


def test_every_configured_policy_name_has_a_policy() -> None:
    from config.settings import PolicyName
    from routing.policies import POLICIES

    assert sorted(POLICIES) == sorted(p.value for p in PolicyName)


def test_least_loaded_baseline_never_pins() -> None:
    d = LeastLoadedPolicy().select([cand("a", 2), cand("b", 1)], RouteRequest("k", pinned="a"), NOW)
    assert (d.backend, d.reason, d.pin) == ("b", Reason.LEAST_LOADED, PinAction.NONE)


def test_round_robin_cycles_over_routable_backends() -> None:
    p = RoundRobinPolicy()
    cands = [cand("c"), cand("a"), cand("b", state=BackendState.DOWN)]
    assert [p.select(cands, RouteRequest("k"), NOW).backend for _ in range(4)] == ["a", "c", "a", "c"]


def test_make_policy_uses_the_configured_name() -> None:
    assert isinstance(make_policy(params(policy="round_robin")), RoundRobinPolicy)
    assert isinstance(make_policy(params()), AffinityPolicy)


def test_find_names_the_pinned_candidate_routable_or_not() -> None:
    down = cand("b", state=BackendState.DOWN)
    candidates = (cand("a"), down)
    assert find(candidates, "b") is down  # a policy then sees that its pin is down: repin_unhealthy
    assert find(candidates, "a") is candidates[0]
    assert find(candidates, "gone") is None
    assert find(candidates, None) is None
