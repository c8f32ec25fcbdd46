"""Learned cache retention per backend: of the prefix the gateway expected an engine to hold, what it held.

A follow-up sent to its home (the pinned backend, or the twin hint) is expected to find all but its tail
cached there; the engine's reported cached tokens say how much it found. Under cache pressure (more active
conversations than its KV cache holds) the engine evicts, and the share falls. Decayed sums, the same way
as the learned speeds (``routing.speed``), with a prior of ``prior_tokens`` held in full:

    retention = (held + prior_tokens) / (expected + prior_tokens)

so a backend without evidence is taken to keep what it is sent, and an old eviction fades within a few
half-lives. A follow-up that found at least ``FULL_SHARE`` of what was expected counts as found in full: the
expectation is an estimate (characters over a learned ratio, block rounding), and a systematic shortfall of a
few percent on every engine is not eviction; it would only tilt every cost alike.
``refresh(now)`` decays every value (called when the speeds are recomputed); a sample updates
its own backend's value. Pure: ``now`` is passed in.
"""

from __future__ import annotations

import math

from routing.speed import DecayedSums

#: A hold of at least this share of the expected prefix counts as all of it (estimate noise, not eviction).
FULL_SHARE = 0.8


class RetentionEstimator:
    def __init__(self, half_life_s: float = 15.0, prior_tokens: float = 4000.0) -> None:
        if half_life_s <= 0 or prior_tokens <= 0:
            raise ValueError("half_life_s and prior_tokens must be > 0")
        self.half_life_s = half_life_s
        self.prior_tokens = prior_tokens
        self._sums: dict[str, DecayedSums] = {}
        self.retention: dict[str, float] = {}  # backend -> current estimate (read when publishing)

    def sample(self, backend: str, expected: float, held: float, now: float) -> None:
        """A follow-up sent home to ``backend`` expected ``expected`` cached tokens; it found ``held``."""
        if expected < 1:
            return
        s = self._sums.get(backend)
        if s is None:
            s = self._sums[backend] = DecayedSums()
        # The sums' two fields hold (held, expected) here.
        held = expected if held >= FULL_SHARE * expected else max(0.0, held)
        s.add(held, expected, now, self.half_life_s)
        self.retention[backend] = self._value(s.tokens, s.seconds)

    def refresh(self, now: float) -> None:
        for backend, s in self._sums.items():
            keep = math.exp2(-max(0.0, now - s.at) / self.half_life_s)
            self.retention[backend] = self._value(s.tokens * keep, s.seconds * keep)

    def _value(self, held: float, expected: float) -> float:
        prior = self.prior_tokens
        return (held + prior) / (expected + prior)
