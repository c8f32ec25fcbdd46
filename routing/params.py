"""Routing's own parameters: frozen values built by the gateway from its settings.

``routing/`` never imports ``config`` (pydantic, YAML): the composition root (``gateway.app``) copies the
fields it needs into these, so every rule stays a plain function of plain values.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Prefill rate assumed for a backend of weight 1 before anything was measured (tokens/s).
DEFAULT_PREFILL_TPS = 4000.0
#: Uncached tokens one turn of a conversation is expected to add (a tool result and the reply before it).
DEFAULT_TURN_TOKENS = 600  # the same default as RouteRequest.turn_tokens


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
    # -- ttft policy ----------------------------------------------------------------------------------
    #: A conversation counts as load while it sent a request within this many seconds (idle pins do not).
    active_window_s: float = 10.0
    #: Half-life of the learned engine speeds (``routing.speed``).
    speed_half_life_s: float = 15.0
    #: Each active conversation is expected to bring this share of one turn's prefill soon.
    load_share: float = 2.0
    #: Leave the pin only when another backend is cheaper by this fraction of staying (and 20 ms): hysteresis.
    stay_margin: float = 0.6
