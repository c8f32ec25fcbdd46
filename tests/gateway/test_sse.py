"""The SSE splitter: WHATWG line ends (LF, CRLF, lone CR), any cut into reads, a bounded hold."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.sse import Event, EventSplitter, Overflow, Piece

CR, LF = 0x0D, 0x0A


def reference(stream: bytes) -> list[list[bytes]]:
    """The lines of each event of ``stream``, parsed byte by byte as the standard describes it."""
    events: list[list[bytes]] = []
    lines: list[bytes] = []
    line = bytearray()
    i = 0
    while i < len(stream):
        byte = stream[i]
        i += 1
        if byte not in (CR, LF):
            line.append(byte)
            continue
        if byte == CR and stream[i : i + 1] == b"\n":
            i += 1
        if line:
            lines.append(bytes(line))
            line.clear()
        elif lines:
            events.append(lines)
            lines = []
    return events


def split(reads: list[bytes], max_event: int = 1 << 20) -> tuple[list[Piece], bytes, EventSplitter]:
    splitter = EventSplitter(max_event)
    pieces: list[Piece] = []
    for read in reads:
        pieces += splitter.feed(read)
        assert splitter.buffered <= max_event
    return pieces, splitter.close(), splitter


def event_lines(pieces: list[Piece]) -> list[list[bytes]]:
    return [lines for p in pieces if isinstance(p, Event) and (lines := p.lines())]


def cut(stream: bytes, at: list[int]) -> list[bytes]:
    points = sorted({0, len(stream), *(min(a, len(stream)) for a in at)})
    return [stream[a:b] for a, b in itertools.pairwise(points)]


TOKENS = [
    b"data: x",
    b"data:{}",
    b"event: e",
    b": comment",
    b"id",
    b"\r",
    b"\n",
    b"\r\n",
    "\u2028".encode(),  # LINE SEPARATOR: no line end in SSE
    "\u0085".encode(),  # NEXT LINE: neither
    b"\x0b\x0c\x1c",  # what str.splitlines() would also split on
]
STREAMS = st.lists(st.sampled_from(TOKENS), max_size=60).map(b"".join)


@settings(max_examples=300, deadline=None)
@given(STREAMS, st.lists(st.integers(0, 400), max_size=30))
def test_any_cut_into_reads_gives_the_same_events_and_every_byte_once(stream: bytes, at: list[int]) -> None:
    pieces, rest, _ = split(cut(stream, at))
    assert b"".join(p.raw for p in pieces) + rest == stream
    assert event_lines(pieces) == reference(stream)
    assert not any(isinstance(p, Overflow) for p in pieces)


@settings(max_examples=300, deadline=None)
@given(STREAMS, st.lists(st.integers(0, 400), max_size=30), st.integers(8, 40))
def test_a_small_bound_holds_no_more_and_passes_oversized_events_through(
    stream: bytes, at: list[int], bound: int
) -> None:
    pieces, rest, _ = split(cut(stream, at), bound)
    assert b"".join(p.raw for p in pieces) + rest == stream
    kept = event_lines(pieces)
    small = [e for e in reference(stream) if len(b"\r\n".join(e)) + 4 < bound]  # surely within the bound
    assert all(e in kept for e in small)
    assert all(len(p.raw) <= bound for p in pieces if isinstance(p, Event))


def test_each_line_end_and_their_mixtures() -> None:
    for framing in (b"\n", b"\r\n", b"\r"):
        stream = b"data: a" + framing + b"data: b" + framing + framing + b"data: c" + framing + framing
        pieces, rest, _ = split([stream])
        assert [p.raw for p in pieces] == [
            b"data: a" + framing + b"data: b" + framing + framing,
            b"data: c" + framing + framing,
        ]
        assert rest == b""
    mixed = b"data: a\r\ndata: b\rdata: c\n\r\n"
    (event,), _, _ = split([mixed])
    assert isinstance(event, Event) and event.lines() == [b"data: a", b"data: b", b"data: c"]
    assert event.data() == b"a\nb\nc"


def test_a_crlf_cut_between_its_cr_and_lf_is_one_line_end() -> None:
    pieces, _, _ = split([b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"])
    assert event_lines(pieces) == [[b"data: a", b"data: b"]]
    # A CR that ended the event in the previous read: its LF is handed on as bytes between events.
    pieces, _, _ = split([b"data: a\r\r", b"\ndata: b\r\r"])
    assert [p.raw for p in pieces] == [b"data: a\r\r", b"\n", b"data: b\r\r"]
    assert event_lines(pieces) == [[b"data: a"], [b"data: b"]]


def test_an_event_is_handed_on_as_soon_as_its_blank_line_arrives() -> None:
    splitter = EventSplitter()
    assert splitter.feed(b"data: a\r") == []
    assert splitter.feed(b"\r") == [Event(b"data: a\r\r")]  # a lone CR ends the line at once
    assert splitter.feed(b"data: b\r\n\r\ndata: c") == [Event(b"data: b\r\n\r\n")]
    assert splitter.buffered == len(b"data: c")


def test_payloads_with_unicode_line_separators_are_not_split() -> None:
    payload = '{"content":"a\u2028b\u0085c\x0bd"}'.encode()
    (event,), _, _ = split([b"data: " + payload + b"\n\n"])
    assert isinstance(event, Event) and event.data() == payload


def test_data_field_parsing() -> None:
    event = Event(b": keep-alive\nevent: delta\ndata:no-space\ndata:  two\ndata\nid: 7\n\n")
    assert event.data() == b"no-space\n two\n"
    assert Event(b"event: ping\n\n").data() is None
    assert Event(b"data: x\r\n\r\n").newline() == b"\r\n"
    assert Event(b"data: x\r\r").newline() == b"\r"


def test_an_unterminated_oversized_event_is_passed_through_read_by_read_never_held_whole() -> None:
    bound, read = 64 * 1024, b"x" * 16 * 1024
    splitter = EventSplitter(bound)
    assert splitter.feed(b"data: " + read) == []
    passed = 0
    for _ in range(256):  # 4 MiB of one event that never ends
        was_passing = passed > 0
        pieces = splitter.feed(read)
        assert splitter.buffered <= bound
        passed += sum(len(p.raw) for p in pieces)
        if was_passing:  # past the bound: each read goes on by itself, nothing is re-joined or re-scanned
            assert pieces == [Overflow(read)] and splitter.buffered == 0
    assert passed == 6 + 257 * len(read)  # every byte once, none held at the end
    assert splitter.feed(b"\n\ndata: next\n\n") == [Overflow(b"\n\n"), Event(b"data: next\n\n")]
    assert splitter.close() == b""


def test_held_bytes_stay_under_the_bound_while_an_event_grows_towards_it() -> None:
    splitter = EventSplitter(100)
    sizes = []
    for _ in range(10):
        splitter.feed(b"y" * 15)
        sizes.append(splitter.buffered)
    assert sizes == [15, 30, 45, 60, 75, 90, 0, 0, 0, 0]  # 105 > 100: the event went on as an overflow


def test_a_complete_event_over_the_bound_in_one_read_is_an_overflow() -> None:
    splitter = EventSplitter(16)
    assert splitter.feed(b"data: " + b"z" * 20 + b"\n\ndata: ok\n\n") == [
        Overflow(b"data: " + b"z" * 20 + b"\n\n"),
        Event(b"data: ok\n\n"),
    ]
    assert splitter.feed(b"data: " + b"z" * 20 + b"\n\n") == [Overflow(b"data: " + b"z" * 20 + b"\n\n")]


def test_close_hands_back_the_unterminated_rest_and_resets() -> None:
    splitter = EventSplitter()
    splitter.feed(b"data: a\r")
    assert splitter.close() == b"data: a\r"
    assert splitter.buffered == 0
    assert splitter.feed(b"\ndata: b\n\n") == [Event(b"\n"), Event(b"data: b\n\n")]  # no CR pending now


@settings(max_examples=200, deadline=None)
@given(st.lists(STREAMS.map(lambda s: s.replace(b"\r", b"") + b"\n\n"), max_size=12))
def test_one_lf_framed_event_per_read_is_split_as_the_stream_would_be(events: list[bytes]) -> None:
    stream = b"".join(events)
    pieces, rest, _ = split(events)  # reads that are often exactly one event: the quick path
    assert b"".join(p.raw for p in pieces) + rest == stream
    assert event_lines(pieces) == reference(stream) == event_lines(split([stream])[0])


@settings(max_examples=300, deadline=None)
@given(STREAMS, st.lists(st.integers(0, 400), max_size=30))
def test_reads_taken_whole_leave_the_splitter_where_feeding_them_would(stream: bytes, at: list[int]) -> None:
    splitter, seen = EventSplitter(), []
    for read in cut(stream, at):
        if splitter.whole(read):
            seen += reference(read)  # whole events: they parse alone as they do in the stream
        else:
            seen += event_lines(splitter.feed(read))
    splitter.close()
    assert seen == reference(stream)


def test_whole_takes_only_reads_that_start_and_end_at_an_event_boundary() -> None:
    splitter = EventSplitter()
    assert splitter.whole(b"data: a\n\ndata: b\n\n") and splitter.whole(b"data: c\r\n\r\n")
    assert splitter.feed(b"data: d") == []
    assert not splitter.whole(b"\n\n")  # it ends the held event: that one must be split
    assert splitter.feed(b"\n\n") == [Event(b"data: d\n\n")]
    assert not splitter.whole(b"data: e\r\r")  # CR framing: split
