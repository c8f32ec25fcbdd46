"""Routing policies, one per module, behind one small Protocol. The table below is the only registry."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from config.settings import PolicyName, RoutingConfig
from routing.policies.affinity import AffinityPolicy
from routing.policies.least_loaded import LeastLoadedPolicy
from routing.policies.round_robin import RoundRobinPolicy
from routing.types import Candidates, Decision, RouteRequest


class Policy(Protocol):
    #: Whether the caller must look up the pinned backend before calling ``select``.
    uses_affinity: bool

    def select(self, candidates: Candidates, request: RouteRequest) -> Decision: ...


POLICIES: dict[PolicyName, Callable[[RoutingConfig], Policy]] = {
    PolicyName.AFFINITY: AffinityPolicy,
    PolicyName.LEAST_LOADED: lambda _cfg: LeastLoadedPolicy(),
    PolicyName.ROUND_ROBIN: lambda _cfg: RoundRobinPolicy(),
}


def make_policy(cfg: RoutingConfig) -> Policy:
    return POLICIES[cfg.policy](cfg)
