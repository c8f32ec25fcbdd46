"""Quota windows per client key, as values and pure arithmetic (no clock, no I/O: ``now`` is passed in).

A key's window opens with its first request after the previous window closed and lasts ``window_s`` (as
``INCR`` + ``PEXPIRE`` on the first increment does in Redis: gateway/redis_scripts.py ``QUOTA_ADMIT`` has
the same rules). Within a window:

- a request is admitted while fewer than ``requests_per_window`` were admitted and fewer than
  ``tokens_per_window`` tokens were charged (its own tokens are not known yet), and while fewer than
  ``concurrent`` of the key's requests are in flight;
- its tokens (prompt + completion, from the answer's usage) are charged when it finishes, to the window
  open then (a fresh one if the old one closed meanwhile);
- a refusal counts nothing.

``MemoryQuotas`` is the one-process store; ``Verdict`` and ``reset_text`` are shared with the Redis one.

The headers a window is told in follow the route's API (``RateLimitStyle``): OpenAI's
``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` with a relative reset (``6m0s``), or Anthropic's
``anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}`` with the reset as an RFC 3339 instant
(whole seconds, UTC, rounded up: a client waiting until then finds the window closed).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum


class RateLimitStyle(StrEnum):
    """Which API's rate-limit headers a route's answers carry."""

    OPENAI = "openai"
    ANTHROPIC = "anthropic"


#: The header families either style writes: the gateway's own replace an engine's of the same family.
RATELIMIT_PREFIXES = (b"x-ratelimit-", b"anthropic-ratelimit-")


class Exhausted(StrEnum):
    """Which limit refused a request; values are metric labels and the 429 body's ``type``."""

    REQUESTS = "requests"
    TOKENS = "tokens"
    CONCURRENT = "concurrent"


@dataclass(frozen=True, slots=True)
class Limits:
    requests: int | None = None
    tokens: int | None = None
    concurrent: int | None = None
    window_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Verdict:
    """The answer to one admission: ``refused`` None means admitted. ``requests``/``tokens`` are the window's
    counts after it (this request included when admitted), ``reset_s`` the seconds until the window closes."""

    limits: Limits
    refused: Exhausted | None
    requests: int
    tokens: int
    reset_s: float
    in_flight: int = 0  # the key's requests in flight (this one included when admitted)

    def retry_after_s(self) -> int:
        """Whole seconds to wait (Retry-After): until the window closes, or 1 for a concurrency refusal."""
        if self.refused is Exhausted.CONCURRENT:
            return 1
        return max(1, math.ceil(self.reset_s))

    def headers(
        self, style: RateLimitStyle = RateLimitStyle.OPENAI, wall_now: float = 0.0
    ) -> list[tuple[bytes, bytes]]:
        """The (limit, remaining, reset) trio of each limit that applies (``requests``, ``tokens``), named as
        ``style``'s API names them; ``wall_now`` (Unix seconds) dates Anthropic's absolute reset."""
        out: list[tuple[bytes, bytes]] = []
        if style is RateLimitStyle.ANTHROPIC:
            reset = reset_instant(wall_now + self.reset_s).encode()
        else:
            reset = reset_text(self.reset_s).encode()
        for name, limit, used in (
            (b"requests", self.limits.requests, self.requests),
            (b"tokens", self.limits.tokens, self.tokens),
        ):
            if limit is None:
                continue
            trio = ((b"limit", str(limit).encode()), (b"remaining", str(max(0, limit - used)).encode()))
            for field_, value in (*trio, (b"reset", reset)):
                if style is RateLimitStyle.ANTHROPIC:
                    out.append((b"anthropic-ratelimit-" + name + b"-" + field_, value))
                else:
                    out.append((b"x-ratelimit-" + field_ + b"-" + name, value))
        return out


def judge(limits: Limits, requests: int, tokens: int, in_flight: int) -> Exhausted | None:
    """Which limit a new request would break, given the window's counts and the key's requests in flight."""
    if limits.requests is not None and requests >= limits.requests:
        return Exhausted.REQUESTS
    if limits.tokens is not None and tokens >= limits.tokens:
        return Exhausted.TOKENS
    if limits.concurrent is not None and in_flight >= limits.concurrent:
        return Exhausted.CONCURRENT
    return None


def reset_text(seconds: float) -> str:
    """A duration as OpenAI's reset headers write it (Go's duration format): ``20ms``, ``1s``, ``1.5s``,
    ``6m0s``, ``1h2m3s``."""
    ms = max(0, math.ceil(round(seconds * 1000, 6)))  # round first: 0.02 s is 20 ms, not 21
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def reset_instant(unix_s: float) -> str:
    """An instant as Anthropic's reset headers write it (RFC 3339, UTC, whole seconds rounded up):
    ``2026-12-02T07:40:00Z``."""
    return datetime.fromtimestamp(math.ceil(round(unix_s, 3)), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(slots=True)
class Window:
    opened: float
    requests: int = 0
    tokens: int = 0


class MemoryQuotas:
    """Every key's window and in-flight count in this process."""

    __slots__ = ("in_flight", "windows")

    def __init__(self) -> None:
        self.windows: dict[str, Window] = {}
        self.in_flight: dict[str, int] = {}

    def admit(self, key: str, limits: Limits, now: float) -> Verdict:
        window = self._open(key, limits, now)
        in_flight = self.in_flight.get(key, 0)
        refused = judge(limits, window.requests, window.tokens, in_flight)
        if refused is None:
            window.requests += 1
            self.in_flight[key] = in_flight + 1
        reset = window.opened + limits.window_s - now
        in_flight = self.in_flight.get(key, 0)
        return Verdict(limits, refused, window.requests, window.tokens, reset, in_flight)

    def finish(self, key: str, limits: Limits, tokens: int, now: float) -> None:
        """An admitted request ended: it leaves the in-flight count; its tokens go to the window open now."""
        self.in_flight[key] = max(0, self.in_flight.get(key, 0) - 1)
        if tokens > 0:
            self._open(key, limits, now).tokens += tokens

    def state(self, key: str, limits: Limits, now: float) -> Verdict:
        """The window as it stands (read-only: an expired window reads as empty)."""
        window = self.windows.get(key)
        in_flight = self.in_flight.get(key, 0)
        if window is None or now >= window.opened + limits.window_s:
            return Verdict(limits, None, 0, 0, limits.window_s, in_flight)
        reset = window.opened + limits.window_s - now
        return Verdict(limits, None, window.requests, window.tokens, reset, in_flight)

    def _open(self, key: str, limits: Limits, now: float) -> Window:
        window = self.windows.get(key)
        if window is None or now >= window.opened + limits.window_s:
            window = self.windows[key] = Window(now)
        return window
