"""Baseline: routable backends in turn, no pinning. The turn counter is the policy's only state."""

from __future__ import annotations

from routing.load import routable
from routing.types import NO_BACKEND, Candidates, Decision, Reason, RouteRequest


class RoundRobinPolicy:
    uses_affinity = False

    def __init__(self) -> None:
        self._turn = 0

    def select(self, candidates: Candidates, request: RouteRequest, now: float) -> Decision:
        ready = sorted(routable(candidates, request.exclude), key=lambda c: c.id)
        if not ready:
            return NO_BACKEND
        choice = ready[self._turn % len(ready)]
        self._turn += 1
        reason = Reason.RETRY_NEXT if request.exclude else Reason.ROUND_ROBIN
        return Decision(choice.id, reason)
