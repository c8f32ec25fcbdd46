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
from typing import SupportsIndex, overload

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


class Whole(list[Piece]):
    """Pieces that are exactly one read, cut into whole events (``raw``: that read). A filter that keeps them
    as they are returns the same list; one that changes anything returns a new list (never edits this one),
    so the relay and the tap can take ``raw`` instead of joining the events again.

    The events are cut only when first read (counted, iterated, indexed, compared): a read every filter
    takes as ``raw`` (the guard, an answer without reasoning fields, the tap once it has seen the reply)
    costs no ``Event`` at all. Never empty (a read ends with a blank line).
    """

    __slots__ = ("_cut", "raw")

    def __init__(self, raw: bytes) -> None:
        super().__init__()
        self.raw = raw
        self._cut = False

    def _events(self) -> None:
        """Cut ``raw``: whole LF-framed events from a line start, each ending at its first LF LF (a blank
        line alone is an event too), found with one-byte searches. ``raw`` ends in LF LF, so every search
        finds one before the end."""
        self._cut = True
        chunk, n, start, add = self.raw, len(self.raw), 0, super().append
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

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        if not self._cut:
            self._events()
        return super().__len__()

    def __iter__(self) -> Iterator[Piece]:
        if not self._cut:
            self._events()
        return super().__iter__()

    def __reversed__(self) -> Iterator[Piece]:
        if not self._cut:
            self._events()
        return super().__reversed__()

    @overload
    def __getitem__(self, i: SupportsIndex) -> Piece: ...

    @overload
    def __getitem__(self, i: slice) -> list[Piece]: ...

    def __getitem__(self, i: SupportsIndex | slice) -> Piece | list[Piece]:
        if not self._cut:
            self._events()
        return super().__getitem__(i)

    def __contains__(self, item: object) -> bool:
        return item in list(self)

    def __eq__(self, other: object) -> bool:
        return list(self) == other

    def __ne__(self, other: object) -> bool:
        return list(self) != other

    def __add__(self, other: list[Piece]) -> list[Piece]:  # type: ignore[override]
        return [*self, *other]

    def __radd__(self, other: list[Piece]) -> list[Piece]:
        return [*other, *self]

    def __repr__(self) -> str:
        return f"Whole({list(self)!r})"

    def copy(self) -> list[Piece]:
        return list(self)

    def index(self, item: Piece, *args: SupportsIndex) -> int:
        return list(self).index(item, *args)

    def count(self, item: Piece) -> int:
        return list(self).count(item)


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

    def feed(self, chunk: bytes) -> list[Piece]:
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
