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


# For ``Candidate.routable`` (twice per request): on Python 3.11 every ``BackendState.X`` is a class
# attribute load through ``EnumType.__getattr__``'s slow hook (~0.25 us each).
_READY = BackendState.READY


class Reason(StrEnum):
    """Why a backend was chosen. Values are metric labels and log fields: keep them stable."""

    AFFINITY_HIT = "affinity_hit"
    SPILL_OVERLOAD = "spill_overload"
    REPIN_UNHEALTHY = "repin_unhealthy"
    REPIN_REMOVED = "repin_removed"
    NEW_LEAST_LOADED = "new_least_loaded"
    NEW_CHEAPEST = (
        "new_cheapest"  # ttft policy: a new conversation to the lowest expected time to first token
    )
    MOVE_CHEAPER = "move_cheaper"  # ttft policy: the pin moves, one re-prefill is cheaper than staying
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"
    RETRY_NEXT = "retry_next"
    RESPONSE_OWNER = "response_owner"  # /v1/responses: the engine holding the state a request names
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
    conversations: int  # pinned conversations (affinity), or active ones (ttft: those seen lately)
    weight: float = 1.0
    #: Estimated uncached prompt tokens of this gateway's requests on it that have not had a first byte yet.
    prefilling: int = 0
    #: Prefill rate in tokens/s (learned, with the weight as a prior); 0: unknown.
    prefill_tps: float = 0.0
    #: Requests the engine reports waiting in its queue (its ``/metrics``); -1: unknown or stale.
    waiting: int = -1
    #: Share of the prefix the gateway expected it to hold that it did hold lately (learned from reported
    #: cached tokens; 1: no sign of eviction). Below 1 its cache is under pressure: it evicts conversations.
    retention: float = 1.0
    #: KV cache size in tokens its engine reports (vLLM's ``cache_config_info``); 0: unknown (no limit seen).
    kv_capacity: int = 0
    #: When (monotonic seconds) it was last given a new conversation; -inf: never. Among backends whose
    #: costs are within a small margin, a new conversation goes to the one given one least recently.
    placed_at: float = float("-inf")
    #: Conversations that still compete for its KV cache: active ones whose last turn ended lately (within a
    #: few of the typical pauses between turns; a finished one no longer does); -1: unknown
    #: (``conversations`` stands).
    competing: int = -1

    @property
    def routable(self) -> bool:
        return self.state is _READY

    @property
    def load(self) -> float:
        """Conversations plus requests in flight, per unit of weight: the balancing score."""
        return (self.conversations + self.in_flight) / self.weight


# Not frozen (nor ``Decision``): one of each is built per routed request, and a frozen dataclass's
# ``__init__`` costs one ``object.__setattr__`` call per field (~1.2k instructions each: this one's 11
# fields cost more than the rest of the affinity policy's decision). Policies and the gateway treat both as
# read-only values (``dataclasses.replace`` makes a changed copy).
@dataclass(slots=True)
class RouteRequest:
    """What a policy may know about the request (a parameter object, so signatures stay put)."""

    key: str
    pinned: str | None = None
    exclude: frozenset[str] = frozenset()
    # -- what the ttft policy also reads (estimates in tokens; 0 when unknown) ----------------------------
    prompt_tokens: int = 0
    head_tokens: int = 0  # the shared head: system/developer messages and the first user message
    tail_tokens: int = 0  # appended since the last assistant message: what a warm follow-up still reads
    turn_tokens: int = 600  # uncached tokens a turn adds, on average (learned by the gateway)
    #: Backends that recently prefilled this head (for any conversation with it): they read only the rest.
    holders: frozenset[str] = frozenset()
    #: The backend that produced this conversation's first reply (a twin of an identical head): it holds the
    #: whole history, like a pin does.
    hint: str | None = None
    #: What the engines themselves say they hold: ``(backend, prompt tokens it holds)`` from their KV cache
    #: events (``routing.kvindex``), sorted by backend. A backend listed here is taken at its word (0: it
    #: evicted this conversation: cold), one absent is inferred as above. Empty when no engine publishes
    #: events or none is known for this conversation. The one place routing learns an engine's own word.
    kv_held: tuple[tuple[str, int], ...] = ()
    #: Fill ``Decision.costs`` (the admin "why" dry run); the hot path leaves it off.
    explain: bool = False


class Cost(NamedTuple):
    """Expected time to first token of one request on one candidate, and what it is made of."""

    backend: str
    uncached_tokens: int  # prompt tokens this backend would have to prefill
    queue_s: float  # prefill work queued ahead of it
    prefill_s: float  # its own uncached tokens / the backend's prefill rate
    load_s: float  # the active conversations' next turns, which will compete with it
    total_s: float

    def line(self) -> str:
        return (
            f"{self.backend}: {self.total_s * 1000:.0f} ms = queue {self.queue_s * 1000:.0f} + prefill "
            f"{self.prefill_s * 1000:.0f} ({self.uncached_tokens} uncached tokens) + load "
            f"{self.load_s * 1000:.0f}"
        )


@dataclass(slots=True)  # not frozen: see ``RouteRequest``
class Decision:
    backend: str | None
    reason: Reason
    pin: PinAction = PinAction.NONE
    uncached_tokens: int = 0  # the estimate for the chosen backend (ttft policy; the gateway's queue ledger)
    costs: tuple[Cost, ...] = ()  # every candidate's cost, cheapest first, when the request asked to explain

    def explain(self) -> list[str]:
        """Human-readable costs compared (empty unless the request asked for them)."""
        head = [f"-> {self.backend} ({self.reason.value}, pin {self.pin.value})"]
        return head + [c.line() for c in self.costs] if self.costs else head


NO_BACKEND = Decision(None, Reason.NO_BACKEND)

Candidates = Sequence[Candidate]
