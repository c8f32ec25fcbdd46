"""Request framing beside llhttp's parse: which heads to refuse before a request is dispatched, and where a
head or a body ends in the byte stream.

llhttp (through httptools) gives no byte offsets, so the server cuts what it receives at the places this
module finds and feeds the parser one head, or one body, at a time: every head is then counted against the
size limit from its first byte, wherever it starts in a read. A cut may fall short of the real end (the
server feeds the rest next), never past it; the parser, not these helpers, decides what a message is.

Refused heads (RFC 9112 and 9110; what a strict parser such as h11 refuses too):

- any protocol upgrade (``Upgrade``, ``CONNECT``): the gateway serves none, and httptools ends an upgrade
  request at its head, so a declared body would be read as the next request (request smuggling);
- no ``Host`` in HTTP/1.1, or more than one (§3.2);
- a transfer coding besides one final ``chunked`` (§6.1: 501 for a coding we cannot decode, 400 when
  chunked is not last), and ``Transfer-Encoding`` in HTTP/1.0 (§6.1: its framing is faulty);
- HTTP/0.9 (no version in the request line) and versions other than 1.0 and 1.1.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gateway.errors import BadRequest, GatewayError, HttpVersionNotSupported, UnsupportedTransferCoding

HEAD_END = b"\r\n\r\n"
_QUOTE_AT_MOST = 40  # of a header value the client chose, in an error message and its log line


def head_refusal(method: bytes, version: str, headers: Sequence[tuple[bytes, bytes]]) -> GatewayError | None:
    """Why this head (lower-case header names) must not be dispatched, or None."""
    if version == "0.9":
        return BadRequest("request line without an HTTP version (HTTP/0.9) is not supported")
    if version not in ("1.0", "1.1"):
        return HttpVersionNotSupported(f"HTTP/{version} is not supported; use HTTP/1.1")
    hosts, upgrade, te = 0, None, []
    for name, value in headers:  # one pass: this runs for every request
        if name == b"host":
            hosts += 1
        elif name == b"upgrade":
            upgrade = value if upgrade is None else upgrade
        elif name == b"transfer-encoding":
            te.append(value)
    if hosts > 1:
        return BadRequest(f"request has {hosts} Host header fields; exactly one is allowed")
    if hosts == 0 and version == "1.1":
        return BadRequest("HTTP/1.1 request without a Host header field")
    if upgrade is not None or method == b"CONNECT":
        what = f"Upgrade: {_quote(upgrade)}" if upgrade is not None else "CONNECT"
        return BadRequest(f"protocol upgrade is not supported ({what})")
    if not te:
        return None
    codings = [coding.strip().lower() for value in te for coding in value.split(b",")]
    if version == "1.0":
        return BadRequest("Transfer-Encoding in an HTTP/1.0 request")
    if codings[-1] != b"chunked" or codings.count(b"chunked") > 1:
        return BadRequest("chunked must be the final transfer coding, applied once")
    if len(codings) > 1:
        return UnsupportedTransferCoding(
            f"transfer coding {_quote(codings[0])} is not supported; only chunked is"
        )
    return None


def _quote(value: bytes) -> str:
    text = value[:_QUOTE_AT_MOST].decode("latin-1")
    return repr(text + ("..." if len(value) > _QUOTE_AT_MOST else ""))


def head_end(tail: bytes, data: bytes, start: int) -> int:
    """Where to stop feeding ``data`` (from ``start``) while a head is in progress: at its earliest possible
    end (the first blank line; ``tail`` is the last bytes of it already fed, at most 3), else at the end."""
    if tail:  # a blank line that straddles two reads ends within the first 3 bytes of this one
        at = (tail + data[start : start + 3]).find(HEAD_END)
        if at >= 0:
            return start + at + len(HEAD_END) - len(tail)
    at = data.find(HEAD_END, start)
    return len(data) if at < 0 else at + len(HEAD_END)


class BodyFrame(Protocol):
    def end(self, data: bytes, start: int) -> int:
        """Where the body's bytes in ``data`` from ``start`` stop (``len(data)`` unless the body ends
        inside); they will all be fed."""
        ...

    @property
    def done(self) -> bool:
        """The body's last byte went by."""
        ...


class FixedLength:
    """A ``Content-Length`` body."""

    def __init__(self, length: int) -> None:
        self.left = length

    @property
    def done(self) -> bool:
        return self.left == 0

    def end(self, data: bytes, start: int) -> int:
        if self.left == 0:  # the parser disagrees about the end: let it have the rest
            return len(data)
        n = min(self.left, len(data) - start)
        self.left -= n
        return start + n


_SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)
_LINE_KEPT = 64  # of a chunk-size line: the size and the start of its extensions


class ChunkedEnd:
    """A chunked body (RFC 9112 §7.1): chunk-size lines, data, then the last chunk and trailer fields.

    llhttp rejects what this does not follow (bare LF, junk in a size), so the two agree wherever the
    request is valid; one step per chunk or line, with ``find``, never per byte."""

    def __init__(self) -> None:
        self.state = _SIZE
        self.left = 0  # data bytes of the current chunk (then its CRLF) still to come
        self.line = b""  # the start of a size or trailer line that a read cut in two

    @property
    def done(self) -> bool:
        return self.state == _DONE

    def end(self, data: bytes, start: int) -> int:
        pos, end = start, len(data)
        while pos < end:
            if self.state == _DONE:
                return end
            if self.state in (_DATA, _DATA_END):
                step = min(self.left, end - pos)
                pos, self.left = pos + step, self.left - step
                if self.left == 0:
                    self.state, self.left = (_DATA_END, 2) if self.state == _DATA else (_SIZE, 0)
                continue
            newline = data.find(b"\n", pos)
            if newline < 0:
                self.line = _kept(self.line + data[pos:])
                return end
            line, self.line = _kept(self.line + data[pos:newline]), b""
            pos = newline + 1
            self._end_of_line(line.rstrip(b"\r"))
            if self.state == _DONE:
                return pos
        return end

    def _end_of_line(self, line: bytes) -> None:
        if self.state == _TRAILER:
            if not line:
                self.state = _DONE
            return
        try:
            size = int(line.split(b";", 1)[0], 16)
        except ValueError:  # llhttp refuses this line; feed everything and let it
            self.state = _DONE
            return
        self.state, self.left = (_DATA, size) if size else (_TRAILER, 0)


def _kept(line: bytes) -> bytes:
    """The start of a line, leading zeros folded (llhttp takes any number of them in a size)."""
    if line.startswith(b"00"):
        line = b"0" + line.lstrip(b"0")
    return line[:_LINE_KEPT]
