"""The unpinned wrapper (a token count): the inner policy's choice and reason, never a pin."""

from __future__ import annotations

from routing.params import RoutingParams
from routing.policies.affinity import AffinityPolicy
from routing.policies.unpinned import UnpinnedPolicy
from routing.types import BackendState, Candidate, PinAction, Reason, RouteRequest

NOW = 1000.0
CANDIDATES = [Candidate("a", BackendState.READY, 3, 1, 1.0), Candidate("b", BackendState.READY, 0, 0, 1.0)]


def policy() -> UnpinnedPolicy:
    params = RoutingParams(policy="affinity", spill_factor=2.0, spill_min_in_flight=8, repin_on_spill=True)
    return UnpinnedPolicy(AffinityPolicy(params))


def test_a_pinned_conversation_is_followed_without_touching_its_pin() -> None:
    d = policy().select(CANDIDATES, RouteRequest("k", pinned="a"), NOW)
    assert (d.backend, d.reason, d.pin) == ("a", Reason.AFFINITY_HIT, PinAction.NONE)


def test_a_new_conversation_is_placed_but_claims_nothing() -> None:
    d = policy().select(CANDIDATES, RouteRequest("k"), NOW)
    assert (d.backend, d.reason, d.pin) == ("b", Reason.NEW_LEAST_LOADED, PinAction.NONE)


def test_a_retry_moves_no_pin_and_the_wrapper_reads_the_store_as_its_inner_policy_does() -> None:
    p = policy()
    d = p.select(CANDIDATES, RouteRequest("k", pinned="a", exclude=frozenset({"a"})), NOW)
    assert (d.backend, d.reason, d.pin) == ("b", Reason.RETRY_NEXT, PinAction.NONE)
    assert p.uses_affinity is True
