"""Value types shared by routing policies: snapshots in, decisions out. Imports nothing of the package."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


class BackendState(StrEnum):
    """Lifecycle of a backend as the gateway sees it. Only READY takes new work."""

    STARTING = "starting"
    CANARY = "canary"
    READY = "ready"
    DRAINING = "draining"
    CORDONED = "cordoned"
    DOWN = "down"


class Reason(StrEnum):
    """Why a backend was chosen. Values are metric labels and log fields: keep them stable."""

    AFFINITY_HIT = "affinity_hit"
    SPILL_OVERLOAD = "spill_overload"
    REPIN_UNHEALTHY = "repin_unhealthy"
    REPIN_REMOVED = "repin_removed"
    NEW_LEAST_LOADED = "new_least_loaded"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"
    RETRY_NEXT = "retry_next"
    NO_BACKEND = "no_backend"


class PinAction(StrEnum):
    """What the caller must do to the affinity entry after the decision."""

    NONE = "none"  # leave the entry as it is (baselines, one-off spills, retries)
    TOUCH = "touch"  # refresh the TTL of an existing pin
    CLAIM = "claim"  # first assignment: set only if absent (another replica may have won)
    MOVE = "move"  # overwrite the pin (re-pin)


class Candidate(NamedTuple):
    """One backend serving the requested model, as seen at decision time.

    A NamedTuple rather than a frozen dataclass: several are built for every request, and a frozen
    dataclass's ``__init__`` costs one ``object.__setattr__`` call per field. Immutable all the same.
    """

    id: str
    state: BackendState
    in_flight: int
    conversations: int
    weight: float = 1.0

    @property
    def routable(self) -> bool:
        return self.state is BackendState.READY

    @property
    def load(self) -> float:
        """Conversations plus requests in flight, per unit of weight: the balancing score."""
        return (self.conversations + self.in_flight) / self.weight


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know about the request (a parameter object, so signatures stay put)."""

    key: str
    pinned: str | None = None
    exclude: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Decision:
    backend: str | None
    reason: Reason
    pin: PinAction = PinAction.NONE


NO_BACKEND = Decision(None, Reason.NO_BACKEND)

Candidates = Sequence[Candidate]
