"""Affinity (default): keep a conversation where its prefix cache is, unless that hurts.

- pinned, routable, not overloaded      -> stay                       (affinity_hit, touch)
- pinned but overloaded                 -> least loaded other         (spill_overload; pin moves if set)
- pinned backend down/draining          -> least loaded, re-pin       (repin_unhealthy)
- pinned backend no longer configured   -> least loaded, re-pin       (repin_removed)
- not pinned                            -> least loaded, claim        (new_least_loaded)
- retry after a failure                 -> least loaded of the rest   (retry_next; the pin moves with it
                                                                       when the pinned backend failed)

Overloaded: in-flight per weight above ``spill_factor`` x the mean of the other routable backends, and at
least ``spill_min_in_flight`` requests in flight (so one long request on an idle cluster never spills).
"""

from __future__ import annotations

from routing.load import find, in_flight_per_weight, least_loaded, routable
from routing.params import RoutingParams
from routing.types import NO_BACKEND, Candidate, Candidates, Decision, PinAction, Reason, RouteRequest

# The decisions of the two common cases, made once: on Python 3.11 every ``Reason.X`` / ``PinAction.X`` is a
# class attribute load through ``EnumType.__getattr__``'s slow hook (~0.25 us each).
_HIT, _TOUCH = Reason.AFFINITY_HIT, PinAction.TOUCH
_NEW, _CLAIM = Reason.NEW_LEAST_LOADED, PinAction.CLAIM


class AffinityPolicy:
    uses_affinity = True

    def __init__(self, cfg: RoutingParams) -> None:
        self.spill_factor = cfg.spill_factor
        self.spill_min_in_flight = cfg.spill_min_in_flight
        self.spill_pin = PinAction.MOVE if cfg.repin_on_spill else PinAction.NONE

    def select(self, candidates: Candidates, request: RouteRequest, now: float) -> Decision:
        ready = routable(candidates, request.exclude)
        if request.exclude:
            best = least_loaded(ready, request.key)
            if best is None:
                return NO_BACKEND
            # The retry re-reads the whole prompt on ``best``, so its cache now holds the conversation: move
            # the pin there, or every later turn pays the pinned backend's failure first.
            moved = request.pinned is not None and request.pinned in request.exclude
            return Decision(best.id, Reason.RETRY_NEXT, PinAction.MOVE if moved else PinAction.NONE)
        pinned = find(candidates, request.pinned)
        if pinned is not None and pinned.routable:
            others = [c for c in ready if c.id != pinned.id]
            if not self._overloaded(pinned, others):
                return Decision(pinned.id, _HIT, _TOUCH)
            best = least_loaded(others, request.key)
            assert best is not None  # overloaded implies others exist
            return Decision(best.id, Reason.SPILL_OVERLOAD, self.spill_pin)
        best = least_loaded(ready, request.key)
        if best is None:
            return NO_BACKEND
        if request.pinned is None:
            return Decision(best.id, _NEW, _CLAIM)
        reason = Reason.REPIN_REMOVED if pinned is None else Reason.REPIN_UNHEALTHY
        return Decision(best.id, reason, PinAction.MOVE)

    def _overloaded(self, pinned: Candidate, others: list[Candidate]) -> bool:
        if not others or pinned.in_flight < self.spill_min_in_flight:
            return False
        mean = sum(in_flight_per_weight(c) for c in others) / len(others)
        return in_flight_per_weight(pinned) > self.spill_factor * mean
