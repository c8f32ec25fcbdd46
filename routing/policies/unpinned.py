"""A policy's choice without its pin: for requests that should go where their conversation is (a token count)
but are no turn of it, so they never create or move the conversation's pin."""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from routing.types import Candidates, Decision, PinAction, RouteRequest


class _Policy(Protocol):
    uses_affinity: bool

    def select(self, candidates: Candidates, request: RouteRequest, now: float) -> Decision: ...


class UnpinnedPolicy:
    """``inner``'s decision with ``pin`` NONE: a pinned, healthy backend is still chosen."""

    def __init__(self, inner: _Policy) -> None:
        self.inner = inner
        self.uses_affinity = inner.uses_affinity

    def select(self, candidates: Candidates, request: RouteRequest, now: float) -> Decision:
        decision = self.inner.select(candidates, request, now)
        return decision if decision.pin is PinAction.NONE else replace(decision, pin=PinAction.NONE)
