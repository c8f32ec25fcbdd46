"""Routing policies, one per module, behind one small Protocol. The table below is the only registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from routing.params import RoutingParams
from routing.policies.affinity import AffinityPolicy
from routing.policies.least_loaded import LeastLoadedPolicy
from routing.policies.round_robin import RoundRobinPolicy
from routing.policies.ttft import TtftPolicy
from routing.types import Candidates, Decision, RouteRequest


class Policy(Protocol):
    #: Whether the caller must look up the pinned backend before calling ``select``.
    uses_affinity: bool

    def select(self, candidates: Candidates, request: RouteRequest, now: float) -> Decision:
        """Choose for ``request`` among ``candidates`` at time ``now`` (monotonic seconds). No I/O."""
        ...


#: Policy name (the values of ``config.settings.PolicyName``) -> constructor.
POLICIES: dict[str, Callable[[RoutingParams], Policy]] = {
    "affinity": AffinityPolicy,
    "least_loaded": lambda _params: LeastLoadedPolicy(),
    "round_robin": lambda _params: RoundRobinPolicy(),
    "ttft": TtftPolicy,
}


def make_policy(params: RoutingParams) -> Policy:
    try:
        factory = POLICIES[params.policy]
    except KeyError:
        raise ValueError(f"unknown routing policy {params.policy!r}; known: {sorted(POLICIES)}") from None
    return factory(params)
