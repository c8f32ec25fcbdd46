"""Routing's own parameters: frozen values built by the gateway from its settings.

``routing/`` never imports ``config`` (pydantic, YAML): the composition root (``gateway.app``) copies the
fields it needs into these, so every rule stays a plain function of plain values.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RoutingParams:
    #: Name of the policy (a key of ``routing.policies.POLICIES``).
    policy: str
    #: Spill when the pinned backend's in-flight per weight exceeds this times the others' mean.
    spill_factor: float
    #: Never spill a backend with fewer requests in flight than this.
    spill_min_in_flight: int
    #: Move the pin when a turn spills (else the spill is one-off).
    repin_on_spill: bool
