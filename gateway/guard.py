"""Output-health guard: ``finish_reason`` counts and degenerate repetition in proxied streams.

An engine can collapse into one token ("duct duct duct…") until the length limit while every health check
passes; the symptoms are a rising share of ``finish_reason: length`` and a stream of identical deltas.

Cheap by construction (it runs once per streamed chunk, before the chunk is sent): no JSON parsing. The
chunk bytes are searched for the shape's text key (``"content":`` for chat, ``"text":`` for completions and
Anthropic's messages) and its finish key (``"finish_reason":``; Anthropic's ``"stop_reason":``, its values
counted under OpenAI's labels: ``end_turn`` as ``stop``, ``max_tokens`` as ``length``...); the string
values are compared as the raw, still-escaped bytes. The repetition check is rolling: for each period
p <= ``max_period`` it counts how many deltas in a row equal the delta p before; a unit of p deltas
repeated ``repeat_count`` times trips it. Whitespace around a delta is ignored (" duct" and "duct" are one
token), empty deltas (the role chunk) are skipped.

Only complete SSE events are looked at (``gateway.sse``: any line ends; an event's start waits for its end),
so an event split across reads is neither missed nor counted twice; one larger than 64 KiB is not looked
at. A non-streamed body is scanned only for ``finish_reason``, chunk by chunk (a key split across two reads
is missed: rare, and only a count).
"""

from __future__ import annotations

import logging
from functools import lru_cache

from config.settings import GuardAction, GuardConfig
from gateway.context import Attempt, RequestContext
from gateway.errors import UpstreamError
from gateway.metrics import Metrics
from gateway.phases import BodyFilter, BodyFilterBase
from gateway.shapes.base import OPENAI_FINISH, FinishKey
from gateway.sse import Event, EventSplitter, Pieces, Whole

log = logging.getLogger("warmroute.proxy")

_MAX_EVENT = 64 * 1024  # an event larger than this is not inspected (none of ours comes near it)
_BACKSLASH = 0x5C
_QUOTE = 0x22
#: finish_reason values kept as metric labels; anything else an engine sends counts as "other" (a shape
#: with another field, Anthropic's ``stop_reason``, maps its values onto these: ``ApiShape.finish``).
FINISH_REASONS = frozenset(OPENAI_FINISH.labels.values())


class StreamGuard:
    """One response's guard. ``feed`` every chunk; ``tripped`` once it is degenerate."""

    __slots__ = (
        "_events",
        "_finish",
        "_finish_strings",
        "_history",
        "_key",
        "_max_period",
        "_needed",
        "_runs",
        "finish",
        "tripped",
    )

    def __init__(self, cfg: GuardConfig, *, text_key: bytes, finish: FinishKey = OPENAI_FINISH) -> None:
        self._key = text_key  # the API shape's (``ApiShape.text_key``): ``"content":``, ``"text":``...
        self._finish = finish  # the shape's (``ApiShape.finish``): ``"finish_reason":``, ``"stop_reason":``
        self._finish_strings = finish.strings  # the key with a string value (packed events: anywhere)
        self._max_period = cfg.max_period
        self._needed = _needed_runs(cfg.repeat_count, cfg.max_period)
        self._runs = [0] * (cfg.max_period + 1)
        self._history: list[bytes] = []
        self._events: EventSplitter | None = None  # only for ``feed``: the relay hands ``inspect`` events
        self.finish: list[str] = []  # finish_reason values seen (bounded labels)
        self.tripped: bytes | None = None  # the repeated unit, once tripped

    def feed(self, chunk: bytes) -> bool:
        """Inspect one chunk of a stream; True when this chunk made the stream trip (once per stream)."""
        if self._events is None:
            self._events = EventSplitter(_MAX_EVENT)
        return self.inspect(self._events.feed(chunk))

    def inspect(self, pieces: Pieces) -> bool:
        """Inspect the whole events among ``pieces`` (larger ones than 64 KiB are not looked at); True when
        they made the stream trip."""
        if type(pieces) is Whole and len(pieces.raw) <= _MAX_EVENT:  # one read of whole events, as it came
            data = pieces.raw  # (its events never cut)
        else:
            if type(pieces) is Whole:
                pieces = pieces.events()
            if len(pieces) == 1:  # one event
                data = pieces[0].raw
                if not isinstance(pieces[0], Event) or len(data) > _MAX_EVENT:
                    return False
            else:
                events = [p.raw for p in pieces if isinstance(p, Event) and len(p.raw) <= _MAX_EVENT]
                if not events:
                    return False
                data = events[0] if len(events) == 1 else b"".join(events)
        end = len(data)
        tripped = self.tripped is None and self._pieces(data, end)
        # ``find``, not ``in`` (gateway/sse.py says why); most events carry ``null`` there. Looked at in the
        # read that trips too: under load the answer's last events come in that read, and ``record`` sends
        # them on (``end`` drops what it cuts: ``_GuardFilter.events``).
        compact, spaced = self._finish_strings
        if data.find(compact) >= 0 or data.find(spaced) >= 0:
            self._finish_reasons(data, end)
        return tripped

    def unit(self) -> str:
        """The repeated delta, for a log line or an error message (cut short)."""
        return "" if self.tripped is None else self.tripped[:40].decode("utf-8", "replace")

    def _pieces(self, data: bytes, end: int) -> bool:
        key, pos = self._key, 0
        while True:
            pos = data.find(key, pos, end)
            if pos < 0:
                return False
            start = pos + len(key)
            if data[start] != _QUOTE:  # ``null``, or the spaced spelling: the general parser
                value = _string_at(data, start, end)
                if value is None:
                    pos = start
                    continue
                start, stop = value
            else:
                start += 1
                stop = data.find(b'"', start, end)
                if stop < 0:
                    return False
                if data[stop - 1] == _BACKSLASH:  # an escaped quote inside: the general parser
                    value = _string_at(data, start - 1, end)
                    if value is None:
                        return False
                    start, stop = value
            pos = stop + 1
            piece = data[start:stop].strip()
            if piece and self._repeats(piece):
                self.tripped = piece
                return True

    def _repeats(self, piece: bytes) -> bool:
        history, runs, needed = self._history, self._runs, self._needed
        hit = False
        p = 0
        for earlier in reversed(history):  # newest first: the delta 1, 2, … before this one
            p += 1
            if earlier == piece:
                runs[p] += 1
                if runs[p] >= needed[p]:
                    hit = True
            elif runs[p]:
                runs[p] = 0
        history.append(piece)
        if p >= self._max_period:
            del history[0]
        return hit

    def _finish_reasons(self, data: bytes, end: int) -> None:
        finish_reasons(data, end, self._finish, self.finish)


def finish_reasons(data: bytes, end: int, finish: FinishKey, out: list[str]) -> None:
    """Append to ``out`` the label of each ``finish`` value in ``data[:end]``."""
    key, labels = finish.key, finish.labels
    pos = 0
    while True:
        pos = data.find(key, pos, end)
        if pos < 0:
            return
        value = _string_at(data, pos + len(key), end)
        pos += len(key)
        if value is not None:
            reason = data[value[0] : value[1]].decode("ascii", "replace")
            out.append(labels.get(reason, "other"))


@lru_cache(maxsize=8)
def _needed_runs(repeat_count: int, max_period: int) -> tuple[int, ...]:
    """Per period p, the repeats in a row of a p-delta unit that trip the guard (one tuple per config)."""
    return tuple(p * (repeat_count - 1) for p in range(max_period + 1))


def _string_at(data: bytes, pos: int, end: int) -> tuple[int, int] | None:
    """(start, stop) of the JSON string value at ``pos`` (one optional space first), or None (null, a
    number, or cut off before ``end``)."""
    if pos < end and data[pos] == 0x20:
        pos += 1
    if pos >= end or data[pos] != _QUOTE:
        return None
    start = pos + 1
    stop = data.find(b'"', start, end)
    while stop > 0 and data[stop - 1] == _BACKSLASH:
        backslashes = 1
        while data[stop - 1 - backslashes] == _BACKSLASH:
            backslashes += 1
        if backslashes % 2 == 0:
            break  # ``\\"``: an escaped backslash, then the closing quote
        stop = data.find(b'"', stop + 1, end)
    return None if stop < 0 else (start, stop)


class OutputGuard:
    """The guard as a module: a ``StreamGuard`` per attempt, fed the relay's events; counts finish reasons
    and trips (``guard.action``: end the stream, or only record it)."""

    def __init__(self, cfg: GuardConfig, metrics: Metrics) -> None:
        self.cfg = cfg
        self.metrics = metrics

    def body_filter(self, ctx: RequestContext, attempt: Attempt, status: int, sse: bool) -> BodyFilter:
        if not sse:  # a plain body is only scanned for finish reasons: no repetition state to build
            return _BodyFinish(self.metrics, ctx.shape.finish, attempt.backend.id)
        guard = StreamGuard(self.cfg, text_key=ctx.shape.text_key, finish=ctx.shape.finish)
        return _GuardFilter(self, guard, attempt.backend.id)


class _BodyFinish(BodyFilterBase):
    """A non-streamed answer's guard: its finish reasons, chunk by chunk, counted once the relay is over."""

    __slots__ = ("backend", "finish", "found", "metrics")

    def __init__(self, metrics: Metrics, finish: FinishKey, backend: str) -> None:
        self.metrics, self.finish, self.backend = metrics, finish, backend
        self.found: list[str] = []

    def body(self, data: bytes) -> bytes:
        finish_reasons(data, len(data), self.finish, self.found)
        return data

    def continued(self) -> None:
        self.found.clear()  # as ``_GuardFilter.continued``: the first exchange's "length" was our cut

    def close(self) -> None:
        if self.found:
            self.metrics.finished(self.backend, self.found)


class _GuardFilter(BodyFilterBase):
    __slots__ = ("backend", "guard", "owner")

    def __init__(self, owner: OutputGuard, guard: StreamGuard, backend: str) -> None:
        self.owner, self.guard, self.backend = owner, guard, backend

    def events(self, pieces: Pieces) -> Pieces:
        if self.guard.inspect(pieces) and self._tripped():
            # The tripping event is not sent (nor what came after it in the read: its finish reason is not
            # the answer's); the engine answered, so this is no breaker failure.
            self.guard.finish.clear()
            raise UpstreamError(
                f"backend {self.backend} output degenerated: {self.guard.unit()!r} repeated; stream ended"
            )
        return pieces

    def continued(self) -> None:
        # A follow-up exchange continues the answer: the "length" that ended the first one was the gateway's
        # cut, not the answer's. The repetition history stays: a loop across both is still one loop.
        self.guard.finish.clear()

    def close(self) -> None:
        if self.guard.finish:
            self.owner.metrics.finished(self.backend, self.guard.finish)

    def _tripped(self) -> bool:
        """Count and log a degenerate stream; True when the configured action ends it here."""
        cfg, guard = self.owner.cfg, self.guard
        action = cfg.action  # a stream's (a plain body is not looked at for repetition: ``_BodyFinish``)
        self.owner.metrics.guard_tripped(self.backend, action.value)
        log.warning(
            "backend %s: output guard tripped (%r %d times in a row): %s",
            self.backend,
            guard.unit(),
            cfg.repeat_count,
            action,
        )
        return action is GuardAction.END
