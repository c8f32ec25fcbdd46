"""Stored Responses state: the one engine that holds it, or nothing (never a silent other engine).

The request's candidates are already narrowed to that engine (the others are ineligible); this policy
never pins (the state, not a conversation, decides) and never retries elsewhere: an exclusion means the
owner itself failed, and no other backend could answer.
"""

from __future__ import annotations

from routing.load import routable
from routing.types import NO_BACKEND, Candidates, Decision, Reason, RouteRequest


class OwnerPolicy:
    uses_affinity = False

    def select(self, candidates: Candidates, request: RouteRequest, now: float) -> Decision:
        if request.exclude:
            return NO_BACKEND
        ready = routable(candidates)
        if len(ready) != 1:
            return NO_BACKEND
        return Decision(ready[0].id, Reason.RESPONSE_OWNER)
