"""Circuit breaker for one backend, fed by the outcome of real requests. Pure: no I/O, time passed in.

CLOSED: every request may go; ``failure_threshold`` consecutive failures open it.
OPEN: nothing goes for the open period (``open_s``, doubled by every failed trial up to ``open_max_s``).
HALF_OPEN: the period is over; ``begin`` lets ONE trial request through. Its success closes the breaker
(and the period returns to ``open_s``), its failure opens it again for twice as long. A trial that never
reports back frees its slot after one open period, so a lost result cannot wedge the breaker half-open.

What counts as a failure is the caller's call: connect errors, 5xx and timeouts, not 4xx (the engine
answered). Results that arrive while OPEN came from requests sent before it opened: they decide nothing.

Blame: a failure only the engine can explain (``record(False, now)``: connect error, timeout, broken
answer, or a 5xx for a request another engine then answered) counts as it is. A failure the request's own
input could explain as well (``record(False, now, client=...)``: an HTTP 5xx no other engine was asked to
confirm) counts toward ``failure_threshold`` too, but a streak made only of those opens the breaker only
once ``ANSWER_CLIENTS_TO_OPEN`` distinct clients had one: one client alone cannot open it, however many
requests it sends. A failure that is the request's own (another engine answered it with a 5xx as well)
is no outcome at all: ``abstain`` (it frees a half-open trial slot, and counts nothing). A failed
half-open trial reopens the breaker whatever its blame (the breaker opened on the engine's account).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

#: Distinct clients whose HTTP 5xx answers (those no other engine confirmed) it takes to open a breaker on
#: such answers alone.
ANSWER_CLIENTS_TO_OPEN = 2


class CircuitState(StrEnum):
    """Values are metric labels and log fields: keep them stable."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


# The states as module constants for the methods below, which run twice per request (``begin`` when it is
# routed, ``record`` when its engine answers): on Python 3.11 every ``CircuitState.X`` is a class attribute
# load through ``EnumType.__getattr__``'s slow hook (~0.25 us each; ~9 per request here).
_CLOSED, _OPEN, _HALF_OPEN = CircuitState.CLOSED, CircuitState.OPEN, CircuitState.HALF_OPEN


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    failure_threshold: int = 5
    open_s: float = 10.0
    open_max_s: float = 300.0

    def __post_init__(self) -> None:
        if self.failure_threshold < 1 or self.open_s <= 0 or self.open_max_s < self.open_s:
            raise ValueError("need failure_threshold >= 1 and 0 < open_s <= open_max_s")


class CircuitBreaker:
    __slots__ = ("_clients", "_engine_failed", "_failures", "_open_for", "_opened_at", "_trial_at", "policy")

    def __init__(self, policy: BreakerPolicy | None = None) -> None:
        self.policy = policy or BreakerPolicy()
        self.reset()

    def reset(self) -> None:
        """Closed, no failures counted, the open period back to ``open_s``."""
        self._failures = 0
        self._engine_failed = False  # the current streak has a failure only the engine explains
        self._clients: set[str] = set()  # clients with a 5xx answer in it (at most ANSWER_CLIENTS_TO_OPEN)
        self._opened_at: float | None = None
        self._open_for = self.policy.open_s
        self._trial_at: float | None = None

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    @property
    def open_for_s(self) -> float:
        """Length of the current (or next) open period."""
        return self._open_for

    def retry_at(self) -> float | None:
        """When the current open period ends (HALF_OPEN from then on); None while closed."""
        return None if self._opened_at is None else self._opened_at + self._open_for

    def state(self, now: float) -> CircuitState:
        if self._opened_at is None:
            return _CLOSED
        if now < self._opened_at + self._open_for:
            return _OPEN
        return _HALF_OPEN

    def allows(self, now: float) -> bool:
        """May a request be sent now? A query: it takes nothing (see ``begin``)."""
        state = self.state(now)
        if state is _CLOSED:
            return True
        if state is _OPEN:
            return False
        return self._trial_at is None or now >= self._trial_at + self._open_for

    def begin(self, now: float) -> bool:
        """``allows``, and when half-open take the single trial slot. Call right before sending."""
        if self._opened_at is None:  # closed: the common case, once per request (-3 calls)
            return True
        if not self.allows(now):
            return False
        if self.state(now) is _HALF_OPEN:
            self._trial_at = now
        return True

    def record(self, success: bool, now: float, client: str | None = None) -> CircuitState:
        """One request's outcome; returns the state after it (compare with ``state(now)`` before).

        ``client``: for a failure the request's input could explain too (an HTTP 5xx no other engine was
        asked to confirm), who sent the request; None for a failure only the engine explains.
        """
        if success and self._opened_at is None:  # closed: the common case, once per request (-3 calls)
            if self._failures:
                self.reset()
            return _CLOSED  # with no failures counted a closed breaker is as ``reset`` leaves it
        state = self.state(now)
        if state is _OPEN:
            return state
        if success:
            self.reset()
        elif state is _HALF_OPEN:
            self._open(now, min(self._open_for * 2, self.policy.open_max_s))
        else:
            self._failures += 1
            if client is None:
                self._engine_failed = True
            elif len(self._clients) < ANSWER_CLIENTS_TO_OPEN:
                self._clients.add(client)
            if self._failures >= self.policy.failure_threshold and self._blames_the_engine():
                self._open(now, self.policy.open_s)
        return self.state(now)

    def abstain(self, now: float) -> None:
        """A request that decided nothing about the engine (its failure was its own): a half-open trial slot
        it held is free again; nothing is counted, and a streak of failures goes on."""
        if self.state(now) is _HALF_OPEN:
            self._trial_at = None

    def _blames_the_engine(self) -> bool:
        return self._engine_failed or len(self._clients) >= ANSWER_CLIENTS_TO_OPEN

    def _open(self, now: float, period: float) -> None:
        self._opened_at = now
        self._open_for = period
        self._trial_at = None
        self._engine_failed = False
        self._clients = set()
