"""Server-sent events, split into events as the bytes arrive: the one SSE framer of the request path.

Line ends are the event-stream format's (WHATWG HTML, "Server-sent events"): LF, CRLF and a lone CR, mixed
at will. A CR that ends one read and an LF that starts the next are ONE line end. An event ends at a blank
line. Never ``splitlines()``: payloads may hold U+2028 or U+0085 unescaped, which are no line ends here.

Pure and synchronous, on bytes. Each byte is scanned once (``feed`` never re-reads what it held back), and
what is held back is bounded: an event larger than ``max_event`` bytes is handed on as ``Overflow`` pieces,
exactly as it arrived, until it ends (pass-through), and is never held whole.

Invariants: the pieces' ``raw`` bytes, followed by ``close()``, are exactly the bytes fed, in order; at most
``max_event`` bytes are held at any time; the events and their lines do not depend on how the stream was cut
into reads (only where the bytes between events fall can: an LF completing a CRLF read after its CR).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TypeAlias, final

#: Longest event held back whole; a longer one passes through unread. Engines' events are a few hundred
#: bytes (a token, a tool-call fragment, the usage chunk); a megabyte leaves room for a huge one.
MAX_EVENT_BYTES = 1024 * 1024

_EOL = re.compile(rb"\r\n|\r|\n")  # CRLF first: it is one line end, not two
# Per-read substring tests on the request path use ``find``, not ``in``: CPython's ``bytes.__contains__``
# first tries its operand as an integer, raising and clearing a TypeError each time (a thousand instructions).
_CR = 0x0D
_LF = 0x0A


# Not frozen: a frozen dataclass's __init__ costs twice as much, and one is built per event. Read-only.
@dataclass(slots=True)
class Event:
    """One whole event, its closing blank line included, as the engine sent it.

    An event without lines is bytes between events that carry none: a further blank line, or the LF of a
    CRLF whose CR ended the previous event in the previous read.
    """

    raw: bytes

    def lines(self) -> list[bytes]:
        """Its lines, without their line ends (no blank line among them)."""
        return [line for line in _EOL.split(self.raw) if line]

    def data(self) -> bytes | None:
        """Its ``data`` field (the values of its data lines, joined by LF), or None when it has none."""
        values = []
        for line in self.lines():
            name, _, value = line.partition(b":")
            if name == b"data":
                values.append(value[1:] if value[:1] == b" " else value)
        return b"\n".join(values) if values else None

    def newline(self) -> bytes:
        """The line end it uses (its first one): what a rewritten copy of it should use too."""
        found = _EOL.search(self.raw)
        return b"\n" if found is None else found.group()


@dataclass(slots=True)
class Overflow:
    """A part of an event larger than the bound, handed on unread, as it arrived."""

    raw: bytes


@dataclass(slots=True)
class Unended:
    """The bytes of an event the stream never ended (what ``close()`` hands back), as they arrived."""

    raw: bytes


Piece = Event | Overflow | Unended


@final
class Whole:
    """One read that is exactly whole LF-framed events, kept as that read (``raw``): not a list.

    A filter that can take the read as it came reads ``raw``; one that needs the events asks for them with
    ``events()`` (or iterates, which asks too): they are cut on the first ask, once, and cached. A read
    every filter takes as ``raw`` (the guard, an answer without reasoning fields, the tap once it has seen
    the reply) costs no ``Event`` at all. A filter that keeps the read as it is returns this same object;
    one that changes anything returns a new list (never edits this one), so the relay and the tap can send
    ``raw`` instead of joining the events again. Never empty (a read ends with a blank line).

    Only what filters use is here: ``raw``, ``events()``, iteration, ``len`` and ``==`` (a list of the same
    events, or a ``Whole`` of the same bytes). Anything else a list has (indexing, ``append``, ``+``,
    slicing) is an error, never a silently empty list: ``as_list()`` gives a list either way.
    """

    __slots__ = ("_events", "raw")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self._events: list[Piece] | None = None  # not cut yet

    @property
    def cut(self) -> bool:
        """Whether its events were asked for (and built)."""
        return self._events is not None

    def events(self) -> list[Piece]:
        """Its events, cut from ``raw`` on the first call (the same list after; never edit it)."""
        events = self._events
        if events is None:
            events = self._events = _lf_events(self.raw)
        return events

    def __iter__(self) -> Iterator[Piece]:
        return iter(self.events())

    def __len__(self) -> int:
        return len(self.events())

    def __bool__(self) -> bool:
        return True  # without cutting: such a read always holds an event

    def __eq__(self, other: object) -> bool:
        if type(other) is Whole:
            return self.raw == other.raw
        return self.events() == other if isinstance(other, list) else NotImplemented

    __hash__ = None  # type: ignore[assignment]  # compared by value, as a list is

    def __repr__(self) -> str:
        return f"Whole({self.raw!r})"


#: What a body filter is given and returns: one read's pieces, either still whole (``Whole``) or a list.
Pieces: TypeAlias = Whole | list[Piece]


def as_list(read: Pieces) -> list[Piece]:
    """``read`` as a list of pieces (a ``Whole``'s events, cut if they were not yet; never edit it)."""
    return read.events() if type(read) is Whole else read


def _lf_events(chunk: bytes) -> list[Piece]:
    """Whole LF-framed events from a line start, each ending at its first LF LF (a blank line alone is an
    event too), found with one-byte searches. ``chunk`` ends in LF LF, so every search finds one before
    the end."""
    out: list[Piece] = []
    n, start, add = len(chunk), 0, out.append
    while start < n:
        if chunk[start] == _LF:
            end = start + 1  # a further blank line: bytes between events
        else:
            lf = chunk.find(b"\n", start)
            while chunk[lf + 1] != _LF:
                lf = chunk.find(b"\n", lf + 2)
            end = lf + 2
        add(Event(chunk[start:end]))
        start = end
    return out


class EventSplitter:
    """Feed the reads of one stream; get back its events (and the parts of oversized ones) in order."""

    __slots__ = ("_bol", "_cr", "_held", "_passing", "_size", "max_event")

    def __init__(self, max_event: int = MAX_EVENT_BYTES) -> None:
        self.max_event = max_event
        self._held: list[bytes] = []  # the current event's bytes so far (never more than max_event)
        self._size = 0
        self._bol = True  # nothing of the current line seen yet: a line end now is a blank line
        self._cr = False  # the last read ended in CR: an LF opening the next belongs to that line end
        self._passing = False  # inside an oversized event: its bytes go on as they come

    @property
    def buffered(self) -> int:
        """Bytes held back (the start of an event not yet ended)."""
        return self._size

    def whole(self, chunk: bytes) -> bool:
        """Take ``chunk`` unsplit when it is whole events: True when nothing is held before it and it ends
        with a blank line (LF LF, or CRLF CRLF). The caller then hands it on as it is, events unseen."""
        if self._held or self._passing or not chunk.endswith((b"\n\n", b"\r\n\r\n")):
            return False
        self._cr = False  # and _bol stays True: nothing of a next line yet
        return True

    def feed(self, chunk: bytes) -> Pieces:
        n = len(chunk)
        if (
            self._bol
            and not self._held
            and not self._passing
            and not self._cr
            and n <= self.max_event
            and chunk.endswith(b"\n\n")
            and chunk.find(b"\r") < 0  # one-byte searches: memchr (not ``in``: see above)
        ):
            return Whole(chunk)  # the common read: whole events, LF-framed (cut when read)
        out: list[Piece] = []
        if not n:
            return out
        pos = start = 0
        if self._cr and chunk[0] == _LF:
            pos = 1  # already counted with its CR
            if not self._held and not self._passing:  # that CR ended an event: this LF is between events
                out.append(Event(chunk[:1]))
                start = 1
        # The next LF and the next CR, each searched for again only once passed (memchr, and linear: a
        # regex search is a hundred times slower on a long line).
        bol, lf, cr = self._bol, chunk.find(b"\n", pos), chunk.find(b"\r", pos)
        while lf >= 0 or cr >= 0:
            if cr < 0 or 0 <= lf < cr:
                begin = lf
                end = lf + 1
                lf = chunk.find(b"\n", end)
            else:
                begin = cr
                end = cr + 2 if cr + 1 == lf else cr + 1  # CRLF is one line end
                if end > cr + 1:
                    lf = chunk.find(b"\n", end)
                cr = chunk.find(b"\r", end)
            if bol and begin == pos:  # a blank line: the event ends with its line end
                out.append(self._end(chunk[start:end]))
                start = end
            bol = True
            pos = end
        self._bol = bol and pos == n  # bytes after the last line end start a line
        self._cr = chunk[-1] == _CR
        if start < n:
            self._hold(chunk[start:], out)
        return out

    def close(self) -> bytes:
        """The bytes of an event the stream never ended (to be passed on as they are); resets the splitter."""
        rest = b"".join(self._held)
        self._held.clear()
        self._size = 0
        self._bol, self._cr, self._passing = True, False, False
        return rest

    def _end(self, tail: bytes) -> Piece:
        """The current event ends with ``tail`` (its last bytes, from this read)."""
        if self._passing:
            self._passing = False
            return Overflow(tail)
        size = self._size + len(tail)
        raw = b"".join((*self._held, tail)) if self._held else tail
        self._held.clear()
        self._size = 0
        return Event(raw) if size <= self.max_event else Overflow(raw)

    def _hold(self, rest: bytes, out: list[Piece]) -> None:
        """Keep ``rest`` (an event's start) for the next read, or hand it on when the event is oversized."""
        if self._passing:
            out.append(Overflow(rest))
            return
        if self._size + len(rest) > self.max_event:
            out.append(Overflow(b"".join((*self._held, rest))))
            self._held.clear()
            self._size = 0
            self._passing = True
            return
        self._held.append(rest)
        self._size += len(rest)
