"""Learned engine speed: smoothed prefill and decode rates per backend, with the weight as the prior.

Each sample is (tokens, seconds) at time ``now``. Both sums decay with a half-life, so an engine that slows
down is seen within a few half-lives; a prior of ``prior_tokens`` at the configured speed (weight x the
fleet's reference rate per unit of weight) keeps a backend with few samples near what it was configured as:

    rate = (tokens + prior_tokens) / (seconds + prior_tokens / prior_rate)

Prefill samples (``prefill_busy``) are a request's uncached prompt tokens, as the engine reported them, over
the engine's *busy time* it adds: the part of the span from sending the request to its first byte that no
other request's span on that backend already covers (``BusyTime``), merged at its first byte (``busy``), so in
the order the engine finished prefilling, whatever order the answers end in (``prefill_span`` merges it when
the sample comes, for a request whose first byte was not seen). The spans' union is the time the engine
had prefill of this gateway's work waiting or running, so the sums are tokens prefilled over time spent
prefilling, whatever the order requests were sent, answered and finished in; nothing in them is an estimate.
(A request's own span, its queue ahead counted as the gateway's estimate, counted a request ahead that was
half prefilled whole and the 4.0 characters-per-token prior's tokens: four identical simulated engines were
learned ~20 % apart, the same ones fast in every round.) Pure: ``now`` is passed in; reading a rate is a
dict lookup. With ``refresh_s`` = 0 rates are recomputed on every sample.
Otherwise samples are only summed, and ``refresh(now)`` recomputes them at most once per ``refresh_s``
(the prefill rates: the decode ones, which no decision reads, are computed when ``decode_tps`` is read):
with a half-life of seconds, the samples of a fraction of a second move no rate that a decision could tell
apart, and recomputing every backend's rate per request was the largest item of the ttft policy's CPU per
request. ``refresh`` says whether it did, so a reader copies the rates only when they changed.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Mapping
from dataclasses import dataclass

from routing.params import DEFAULT_PREFILL_TPS

DEFAULT_DECODE_TPS = 50.0
_MIN_SECONDS = 1e-3
#: Spans kept per backend (``BusyTime``): a span older than the oldest kept counts as covered.
_MAX_SPANS = 256


@dataclass(slots=True)
class DecayedSums:
    """Two sums that halve every ``half_life_s`` (``at``: when they were last brought up to date)."""

    tokens: float = 0.0
    seconds: float = 0.0
    at: float = 0.0

    def add(self, tokens: float, seconds: float, now: float, half_life_s: float) -> None:
        if self.tokens or self.seconds:
            elapsed = now - self.at  # (``max(0.0, ...)`` as a comparison: a builtin's call per sample)
            keep = math.exp2(-elapsed / half_life_s) if elapsed > 0 else 1.0
            self.tokens *= keep
            self.seconds *= keep
        self.tokens += tokens
        self.seconds += seconds
        self.at = now


class BusyTime:
    """The union of one backend's spans (send to first byte), merged, so that each new span yields the time
    it adds to the union: the time that engine had this gateway's prefill waiting or running and no other
    request accounts for. Spans arrive in the order requests finish, not the order they were sent."""

    __slots__ = ("ends", "floor", "starts")

    def __init__(self) -> None:
        self.starts: list[float] = []  # disjoint spans, sorted
        self.ends: list[float] = []
        self.floor = -math.inf  # before this, time counts as covered (spans dropped to bound memory)

    def add(self, start: float, end: float) -> float:
        """Merge ``[start, end]`` in; the seconds it added to the union."""
        if start < self.floor:
            start = self.floor
        if end <= start:
            return 0.0
        starts, ends = self.starts, self.ends
        if not starts or start > ends[-1]:  # after every span: an engine that was idle in between
            starts.append(start)
            ends.append(end)
            if len(starts) > _MAX_SPANS:
                self._drop_oldest()
            return end - start
        # The spans it overlaps or touches: from the last one starting at or before ``start`` (when it
        # reaches ``start``) to the last one starting at or before ``end``.
        i = bisect_right(starts, start) - 1
        if i < 0 or ends[i] < start:
            i += 1
        j = bisect_right(starts, end)
        added = end - start
        for k in range(i, j):
            overlap = min(ends[k], end) - max(starts[k], start)
            if overlap > 0:
                added -= overlap
        if i < j:
            start, end = min(start, starts[i]), max(end, ends[j - 1])
        starts[i:j] = [start]
        ends[i:j] = [end]
        if len(starts) > _MAX_SPANS:
            self._drop_oldest()
        return added if added > 0 else 0.0

    def _drop_oldest(self) -> None:
        self.floor = self.ends[0]
        del self.starts[0], self.ends[0]

    def __len__(self) -> int:
        return len(self.starts)


class SpeedEstimator:
    def __init__(
        self,
        weights: Mapping[str, float],
        half_life_s: float = 15.0,
        prior_tokens: float = 2000.0,
        refresh_s: float = 0.0,
    ) -> None:
        if half_life_s <= 0 or prior_tokens <= 0 or refresh_s < 0:
            raise ValueError("half_life_s and prior_tokens must be > 0, refresh_s >= 0")
        self.half_life_s = half_life_s
        self.prior_tokens = prior_tokens
        self.refresh_s = refresh_s
        self._computed_at = -math.inf
        self.dirty = False  # samples came since the last recomputation (``refresh`` has work to do)
        self.weights = dict(weights)
        self._prefill: dict[str, DecayedSums] = {}
        self._decode: dict[str, DecayedSums] = {}
        self._busy: dict[str, BusyTime] = {}  # backend -> the union of its requests' spans
        self.prefill_tps: dict[str, float] = {}  # backend -> current estimate (read on the hot path)
        self._recompute()

    def set_weight(self, backend: str, weight: float) -> None:
        """A backend added (or re-weighted) at runtime."""
        self.weights[backend] = weight
        self._recompute()

    def prefill(self, backend: str, tokens: float, seconds: float, now: float) -> None:
        """A sample of ``tokens`` prefilled in ``seconds`` (both > 0)."""
        if tokens >= 1 and seconds >= _MIN_SECONDS and backend in self.weights:
            self._add_prefill(backend, tokens, seconds, now)

    def prefill_span(self, backend: str, tokens: float, start: float, end: float, now: float) -> None:
        """A request of ``tokens`` uncached prompt tokens, sent at ``start``, first byte at ``end``: its
        sample is the busy time its span adds to the backend's (``BusyTime``); none when it adds none (the
        tokens count: a request that waited behind another was prefilled in the time that one's span
        already holds). A request that prefilled nothing takes no span (its time, mostly the engine's fixed
        overhead, would make the engines given more cached requests look slower)."""
        if tokens < 1 or backend not in self.weights:
            return
        self._add_prefill(backend, tokens, self.busy(backend, start, end), now)

    def busy(self, backend: str, start: float, end: float) -> float:
        """Merge a request's span (sent at ``start``, first byte at ``end``) into the backend's busy time
        now, at its first byte; the seconds it added, for ``prefill_busy`` once its tokens are known."""
        if backend not in self.weights:
            return 0.0
        busy = self._busy.get(backend)
        if busy is None:
            busy = self._busy[backend] = BusyTime()
        return busy.add(start, end)

    def prefill_busy(self, backend: str, tokens: float, seconds: float, now: float) -> None:
        """A request of ``tokens`` uncached prompt tokens whose span added ``seconds`` (``busy``) at its
        first byte: spans merged in the order first bytes came, which is the order the engine finished
        their prefill. (Merged when each request finishes instead, a cached twin that waited behind its
        head's prefill and finished its answer first took that prefill's time for its dozen tokens: in the
        first second of a run, four identical engines were learned 1.1k to 2.5k tok/s, the true 4k.)"""
        if tokens >= 1 and backend in self.weights:
            self._add_prefill(backend, tokens, seconds, now)

    def _add_prefill(self, backend: str, tokens: float, seconds: float, now: float) -> None:
        _sums(self._prefill, backend).add(tokens, seconds, now, self.half_life_s)
        self.dirty = True  # ``_maybe_recompute`` inline: twice per request
        if not self.refresh_s:
            self.refresh(now)

    def decode(self, backend: str, tokens: float, seconds: float, now: float) -> None:
        if tokens >= 1 and seconds >= _MIN_SECONDS and backend in self.weights:
            _sums(self._decode, backend).add(tokens, seconds, now, self.half_life_s)  # read by ``decode_tps``

    def refresh(self, now: float) -> bool:
        """Recompute the rates if samples came since the last time and ``refresh_s`` has passed."""
        if self.dirty and now - self._computed_at >= self.refresh_s:
            self._computed_at = now
            self._recompute()
            return True
        return False

    @property
    def decode_tps(self) -> dict[str, float]:
        """Backend -> current decode estimate, computed when read (no decision reads it: the refresh
        recomputes only the prefill rates)."""
        out: dict[str, float] = {}
        self._rates(self._decode, out, DEFAULT_DECODE_TPS)
        return out

    def _recompute(self) -> None:
        self.dirty = False
        self._rates(self._prefill, self.prefill_tps, DEFAULT_PREFILL_TPS)

    def _rates(self, sums: Mapping[str, DecayedSums], out: dict[str, float], default: float) -> None:
        reference = self._reference(sums, default)
        for backend, weight in self.weights.items():
            prior_rate = reference * weight
            s = sums.get(backend)
            tokens, seconds = (s.tokens, s.seconds) if s is not None else (0.0, 0.0)
            out[backend] = (tokens + self.prior_tokens) / (seconds + self.prior_tokens / prior_rate)

    def _reference(self, sums: Mapping[str, DecayedSums], default: float) -> float:
        """Rate per unit of weight over what was measured (the default before any sample)."""
        tokens = sum(s.tokens for b, s in sums.items() if b in self.weights)
        weighted_seconds = sum(s.seconds * self.weights[b] for b, s in sums.items() if b in self.weights)
        return tokens / weighted_seconds if weighted_seconds > 0 else default


def _sums(table: dict[str, DecayedSums], backend: str) -> DecayedSums:
    """``backend``'s sums, created on its first sample (``setdefault`` would build one per sample)."""
    s = table.get(backend)
    if s is None:
        s = table[backend] = DecayedSums()
    return s


class Ewma:
    """An exponentially weighted mean over samples (not time): for fleet-wide shapes such as a turn's size."""

    __slots__ = ("alpha", "value")

    def __init__(self, initial: float, alpha: float = 0.05) -> None:
        self.value = initial
        self.alpha = alpha

    def add(self, sample: float) -> None:
        self.value += self.alpha * (sample - self.value)
