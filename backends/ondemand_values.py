"""The on-demand scheduler's vocabulary: values, events in, actions out (``backends.ondemand`` maps one to
the other). Plain frozen values, no behaviour beyond lookups."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

# -- values -------------------------------------------------------------------------------------------


class Phase(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"


class StopWhy(StrEnum):
    """Why an engine is stopped; the values are metric labels."""

    IDLE = "idle"
    SWAP = "swap"
    FAILED = "failed"


class RejectWhy(StrEnum):
    """Why a waiting request is answered without an engine; the values are metric labels."""

    QUEUE_FULL = "queue_full"
    HELD = "held"
    START_FAILED = "start_failed"
    TIMEOUT = "wait_timeout"


HOLDING = frozenset({Phase.STARTING, Phase.READY, Phase.STOPPING})  # what takes a group's slot


@dataclass(frozen=True, slots=True)
class EngineSpec:
    id: str
    models: tuple[str, ...]
    group: str | None = None
    idle_ttl_s: float | None = None  # None: stays up once started (until a swap)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    max_running: int = 1
    min_residency_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SchedulerPolicy:
    engines: tuple[EngineSpec, ...]  # in configuration order: a model's first engine is started first
    groups: Mapping[str, GroupSpec] = field(default_factory=dict)
    max_waiting: int = 64  # per model
    wait_timeout_s: float = 900.0
    retry_after_s: float = 5.0  # told to a client refused because the queue is full

    def spec(self, engine: str) -> EngineSpec:
        return next(e for e in self.engines if e.id == engine)

    def serving(self, model: str) -> tuple[EngineSpec, ...]:
        return tuple(e for e in self.engines if model in e.models)

    def members(self, group: str) -> tuple[EngineSpec, ...]:
        return tuple(e for e in self.engines if e.group == group)

    def group(self, name: str | None) -> GroupSpec:
        return self.groups.get(name, GroupSpec()) if name is not None else GroupSpec()


@dataclass(frozen=True, slots=True)
class Engine:
    phase: Phase = Phase.STOPPED
    since: float = 0.0  # when the phase was entered
    ready_at: float | None = None
    last_used: float = 0.0  # last admission, claim end, or tick seen busy
    claims: int = 0  # admitted requests not finished yet
    hold_until: float | None = None
    hold_reason: str = ""
    last_error: str | None = None

    def held(self, now: float) -> bool:
        return self.hold_until is not None and now < self.hold_until


@dataclass(frozen=True, slots=True)
class Waiter:
    ticket: int
    model: str
    arrived: float
    refused: bool = False  # an eviction was refused for it already (counted once)


@dataclass(frozen=True, slots=True)
class Schedule:
    engines: Mapping[str, Engine]  # never mutated: every change is a new mapping
    queue: tuple[Waiter, ...] = ()

    @classmethod
    def initial(cls, policy: SchedulerPolicy) -> Schedule:
        return cls({e.id: Engine() for e in policy.engines})

    def waiting(self, model: str) -> int:
        return sum(1 for w in self.queue if w.model == model)


# -- events -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrive:
    ticket: int
    model: str


@dataclass(frozen=True, slots=True)
class Leave:
    """A waiter gave up (its client left)."""

    ticket: int


@dataclass(frozen=True, slots=True)
class Release:
    """An admitted request finished."""

    engine: str


@dataclass(frozen=True, slots=True)
class Ready:
    engine: str


@dataclass(frozen=True, slots=True)
class Failed:
    engine: str
    cause: str


@dataclass(frozen=True, slots=True)
class Stopped:
    engine: str


@dataclass(frozen=True, slots=True)
class Hold:
    engine: str
    until: float
    reason: str


@dataclass(frozen=True, slots=True)
class Unhold:
    engine: str


@dataclass(frozen=True, slots=True)
class Tick:
    pass


Event = Arrive | Leave | Release | Ready | Failed | Stopped | Hold | Unhold | Tick


# -- actions ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    engine: str


@dataclass(frozen=True, slots=True)
class Stop:
    engine: str
    why: StopWhy
    detail: str


@dataclass(frozen=True, slots=True)
class Admit:
    ticket: int
    engine: str


@dataclass(frozen=True, slots=True)
class Reject:
    ticket: int
    why: RejectWhy
    message: str
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class EvictionRefused:
    """A swap was wanted and the running engine had requests in flight (a metric, once per waiter)."""

    engine: str


Action = Start | Stop | Admit | Reject | EvictionRefused
Result = tuple[Schedule, list[Action]]
