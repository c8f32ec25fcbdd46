"""``gateway.framing``: where heads and bodies end, whatever the reads, and which heads are refused."""

from __future__ import annotations

import pytest

from gateway.errors import HttpVersionNotSupported, UnsupportedTransferCoding
from gateway.framing import ChunkedEnd, FixedLength, head_end, head_refusal

HEAD = b"POST / HTTP/1.1\r\nhost: x\r\n\r\n"
NEXT = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


def _cuts(frame: ChunkedEnd | FixedLength, data: bytes, size: int) -> int:
    """Feed ``data`` in reads of ``size`` bytes; where the frame says the body ended."""
    for at in range(0, len(data), size):
        read = b"junk" + data[at : at + size]  # a read that starts where an earlier message ended
        end = frame.end(read, 4)
        if frame.done:
            return at + end - 4
        assert end == len(read)
    return len(data)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_a_head_ends_at_its_blank_line_however_it_is_read(size: int) -> None:
    data = HEAD + NEXT
    fed, tail = 0, b""
    while True:
        read = b"x\r\n\r" + data[fed : fed + size]  # bytes before ``start`` are not the head's
        n = head_end(tail, read, 4) - 4
        assert 1 <= n <= len(read) - 4
        tail = (tail + read[4 : 4 + n])[-3:]
        fed += n
        if data[:fed].endswith(b"\r\n\r\n"):
            break
    assert fed == len(HEAD)


@pytest.mark.parametrize(
    "body",
    [
        b"5\r\nhello\r\n0\r\n\r\n",
        b"5;ext=1\r\nh\r\n\r\n\r\n0;last\r\n\r\n",  # a blank line inside the data is data
        b"0000000000000000000000000000000000000000000000000000000000000000000005\r\nhello\r\n0\r\n\r\n",
        b"1\r\nx\r\n0\r\ntrailer: v\r\nother: w\r\n\r\n",
        b"0\r\n\r\n",
    ],
    ids=["plain", "extensions", "zero-padded-size", "trailers", "empty"],
)
@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_a_chunked_body_ends_where_its_last_chunk_and_trailers_end(body: bytes, size: int) -> None:
    assert _cuts(ChunkedEnd(), body + NEXT, size) == len(body)


def test_a_bad_chunk_size_ends_the_cut_there_for_the_parser_to_refuse() -> None:
    frame = ChunkedEnd()
    assert frame.end(b"zz\r\nhello\r\n0\r\n\r\n", 0) == 4 and frame.done
    assert frame.end(b"more", 0) == 4


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_a_content_length_body_ends_after_its_length(size: int) -> None:
    assert _cuts(FixedLength(5), b"hello" + NEXT, size) == 5


@pytest.mark.parametrize(
    ("method", "version", "headers", "status", "says"),
    [
        (b"GET", "0.9", [], 400, "HTTP/0.9"),
        (b"GET", "2.0", [(b"host", b"x")], 505, "HTTP/2.0 is not supported"),
        (b"GET", "1.1", [], 400, "without a Host"),
        (b"GET", "1.1", [(b"host", b"x"), (b"host", b"y")], 400, "2 Host header fields"),
        (b"GET", "1.1", [(b"host", b"x"), (b"upgrade", b"websocket")], 400, "Upgrade: 'websocket'"),
        (b"GET", "1.1", [(b"host", b"x"), (b"upgrade", b"a" * 100)], 400, "'" + "a" * 40 + "...'"),
        (b"CONNECT", "1.1", [(b"host", b"x")], 400, "(CONNECT)"),
        (b"POST", "1.1", [(b"host", b"x"), (b"transfer-encoding", b"gzip, chunked")], 501, "'gzip'"),
        (b"POST", "1.1", [(b"host", b"x"), (b"transfer-encoding", b"chunked, gzip")], 400, "final"),
        (b"POST", "1.0", [(b"transfer-encoding", b"chunked")], 400, "HTTP/1.0"),
    ],
)
def test_refused_heads(
    method: bytes, version: str, headers: list[tuple[bytes, bytes]], status: int, says: str
) -> None:
    err = head_refusal(method, version, headers)
    assert err is not None and err.status == status and says in err.message, err
    if status == 501:
        assert isinstance(err, UnsupportedTransferCoding) and err.code == "unsupported_transfer_coding"
    if status == 505:
        assert isinstance(err, HttpVersionNotSupported)


@pytest.mark.parametrize(
    ("version", "headers"),
    [
        ("1.1", [(b"host", b"x")]),
        ("1.1", [(b"host", b""), (b"transfer-encoding", b" Chunked ")]),
        ("1.1", [(b"host", b"x"), (b"connection", b"upgrade")]),
        ("1.0", []),
    ],
)
def test_accepted_heads(version: str, headers: list[tuple[bytes, bytes]]) -> None:
    assert head_refusal(b"POST", version, headers) is None
