"""Output-health guard: ``finish_reason`` counts and degenerate repetition in proxied streams.

An engine can collapse into one token ("duct duct duct…") until the length limit while every health check
passes; the symptoms are a rising share of ``finish_reason: length`` and a stream of identical deltas.

Cheap by construction (it runs once per streamed chunk, before the chunk is sent): no JSON parsing. The
chunk bytes are searched for the content key (``"content":`` for chat, ``"text":`` for completions) and
``"finish_reason":``; the string values are compared as the raw, still-escaped bytes. The repetition check
is rolling: for each period p <= ``max_period`` it counts how many deltas in a row equal the delta p
before; a unit of p deltas repeated ``repeat_count`` times trips it. Whitespace around a delta is ignored
(" duct" and "duct" are one token), empty deltas (the role chunk) are skipped.

Only complete SSE events are looked at (``gateway.sse``: any line ends; an event's start waits for its end),
so an event split across reads is neither missed nor counted twice; one larger than 64 KiB is not looked
at. A non-streamed body is scanned only for ``finish_reason``, chunk by chunk (a key split across two reads
is missed: rare, and only a count).
"""

from __future__ import annotations

from config.settings import GuardConfig
from gateway.sse import Event, EventSplitter

_FINISH = b'"finish_reason":'
_MAX_EVENT = 64 * 1024  # an event larger than this is not inspected (none of ours comes near it)
_BACKSLASH = 0x5C
_QUOTE = 0x22
#: A finish_reason that is a string, in either spelling (anywhere in the read: events may be packed).
_FINISH_STRING = (b'"finish_reason":"', b'"finish_reason": "')
#: finish_reason values kept as metric labels; anything else an engine sends counts as "other".
FINISH_REASONS = frozenset({"stop", "length", "tool_calls", "content_filter", "function_call", "abort"})


class StreamGuard:
    """One response's guard. ``feed`` every chunk; ``tripped`` once it is degenerate."""

    __slots__ = ("_events", "_history", "_key", "_max_period", "_needed", "_runs", "finish", "sse", "tripped")

    def __init__(self, cfg: GuardConfig, *, completions: bool, sse: bool) -> None:
        self._key = b'"text":' if completions else b'"content":'
        self._max_period = cfg.max_period
        self._needed = [p * (cfg.repeat_count - 1) for p in range(cfg.max_period + 1)]
        self._runs = [0] * (cfg.max_period + 1)
        self._history: list[bytes] = []
        self._events = EventSplitter(_MAX_EVENT)
        self.sse = sse
        self.finish: list[str] = []  # finish_reason values seen (bounded labels)
        self.tripped: bytes | None = None  # the repeated unit, once tripped

    def feed(self, chunk: bytes) -> bool:
        """Inspect one chunk; True when this chunk made the stream trip (once per stream)."""
        if not self.sse:
            self._finish_reasons(chunk, len(chunk))
            return False
        events = [piece.raw for piece in self._events.feed(chunk) if isinstance(piece, Event)]
        if not events:
            return False
        data = events[0] if len(events) == 1 else b"".join(events)
        end = len(data)
        if self.tripped is None and self._pieces(data, end):
            return True
        if _FINISH_STRING[0] in data or _FINISH_STRING[1] in data:  # most events carry ``null`` there
            self._finish_reasons(data, end)
        return False

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
        pos = 0
        while True:
            pos = data.find(_FINISH, pos, end)
            if pos < 0:
                return
            value = _string_at(data, pos + len(_FINISH), end)
            pos += len(_FINISH)
            if value is not None:
                reason = data[value[0] : value[1]].decode("ascii", "replace")
                self.finish.append(reason if reason in FINISH_REASONS else "other")


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
