"""The backend lifecycle's vocabulary: events in, actions out (``backends.lifecycle`` maps one to the other).

Plain frozen values, no behaviour. Events come from probes, canaries, the circuit breaker, the process
supervisor, operators and timers; actions are what the one writer (``backends.managed``) must do.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from backends.breaker import CircuitState


class TimerKind(StrEnum):
    START_TIMEOUT = "start_timeout"
    RESTART = "restart"


class Command(StrEnum):
    """Operator commands (admin API)."""

    DRAIN = "drain"
    UNDRAIN = "undrain"
    CORDON = "cordon"
    UNCORDON = "uncordon"
    # Close the circuit; forget a give-up or a failed canary (a managed engine restarts, any other re-probes)
    RESET = "reset"


# -- events -------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ConfigAdded:
    pass


@dataclass(frozen=True, slots=True)
class ConfigRemoved:
    pass


@dataclass(frozen=True, slots=True)
class ProbeOk:
    pass


@dataclass(frozen=True, slots=True)
class ProbeFailed:
    error: str


@dataclass(frozen=True, slots=True)
class CanaryPassed:
    seq: int


@dataclass(frozen=True, slots=True)
class CanaryFailed:
    seq: int
    reason: str


@dataclass(frozen=True, slots=True)
class CircuitChanged:
    state: CircuitState
    reason: str = ""


@dataclass(frozen=True, slots=True)
class ProcessStarted:
    pid: int


@dataclass(frozen=True, slots=True)
class ProcessExited:
    cause: str  # "exited with code 3", "was killed by signal 9 (SIGKILL)", "could not be started: ..."
    code: int | None = None
    signal: int | None = None
    lines: tuple[str, ...] = ()  # its last output lines
    requested: bool = False  # the gateway asked it to stop
    spawn_failed: bool = False


@dataclass(frozen=True, slots=True)
class Operator:
    command: Command


@dataclass(frozen=True, slots=True)
class Wake:
    """Start a stopped on-demand engine (``backends.ondemand`` decided it is wanted)."""


@dataclass(frozen=True, slots=True)
class Sleep:
    """Stop an on-demand engine on purpose (idle, swapped out, failed start): DOWN, *stopped*, no restart."""

    reason: str


@dataclass(frozen=True, slots=True)
class TimerFired:
    kind: TimerKind
    seq: int
    lines: tuple[str, ...] = ()  # the managed process's last output lines, for the reason


Event = (
    ConfigAdded
    | ConfigRemoved
    | ProbeOk
    | ProbeFailed
    | CanaryPassed
    | CanaryFailed
    | CircuitChanged
    | ProcessStarted
    | ProcessExited
    | Operator
    | TimerFired
    | Wake
    | Sleep
)


# -- actions ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StartProcess:
    pass


@dataclass(frozen=True, slots=True)
class RestartProcess:
    """Stop whatever runs (or run the stop command), then start again."""


@dataclass(frozen=True, slots=True)
class StopProcess:
    pass


@dataclass(frozen=True, slots=True)
class RunCanary:
    seq: int


@dataclass(frozen=True, slots=True)
class ArmTimer:
    kind: TimerKind
    after_s: float
    seq: int


@dataclass(frozen=True, slots=True)
class ResetBreaker:
    pass


@dataclass(frozen=True, slots=True)
class Log:
    level: int
    message: str


@dataclass(frozen=True, slots=True)
class GiveUp:
    reason: str


Action = StartProcess | RestartProcess | StopProcess | RunCanary | ArmTimer | ResetBreaker | Log | GiveUp
