"""Baseline: every request to the least loaded backend, no pinning."""

from __future__ import annotations

from routing.load import least_loaded, routable
from routing.types import NO_BACKEND, Candidates, Decision, Reason, RouteRequest


class LeastLoadedPolicy:
    uses_affinity = False

    def select(self, candidates: Candidates, request: RouteRequest, now: float) -> Decision:
        best = least_loaded(routable(candidates, request.exclude), request.key)
        if best is None:
            return NO_BACKEND
        reason = Reason.RETRY_NEXT if request.exclude else Reason.LEAST_LOADED
        return Decision(best.id, reason)
