"""Sockets for hostile tests: a raw client that sends exactly the bytes it is given, and a uvicorn runner.

The raw client never fixes up what it sends (no Content-Length, no framing): it is for requests an HTTP
library refuses to make. Every read has a deadline, and a closed connection reads as ``b""``, whether the
peer sent FIN or a reset.
"""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes
    raw_head: bytes = field(repr=False, default=b"")

    def json(self) -> Any:
        return json.loads(self.body)

    def error_code(self) -> str:
        return str(self.json()["error"]["code"])


class PeerClosed(Exception):
    """The connection ended before a whole response arrived."""


class RawClient:
    """One TCP connection to ``port`` on 127.0.0.1."""

    def __init__(self, port: int, timeout: float = 5.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buffer = b""

    @classmethod
    def to(cls, url: str, timeout: float = 5.0) -> RawClient:
        return cls(int(url.rsplit(":", 1)[1]), timeout)

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, timeout: float) -> bytes | None:
        """What arrives within ``timeout``: bytes, ``b""`` if the peer closed, None if nothing came."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(65536)
        except TimeoutError:
            return None
        except (ConnectionResetError, BrokenPipeError):
            return b""

    def silent_for(self, seconds: float) -> bool:
        """True if the peer neither sent anything nor closed during ``seconds``."""
        got = self.recv(seconds)
        if got:
            self.buffer += got
        return got is None

    def wait_closed(self, timeout: float) -> bytes:
        """Everything received until the peer closed; AssertionError if it is still open at ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            got = self.recv(max(left, 0.001)) if left > 0 else None
            if got is None:
                raise AssertionError(
                    f"connection still open after {timeout} s; received {self.buffer[:200]!r}"
                )
            if got == b"":
                data, self.buffer = self.buffer, b""
                return data
            self.buffer += got

    def read_response(self, timeout: float = 5.0) -> RawResponse:
        """One response (Content-Length, chunked, or until close)."""
        deadline = time.monotonic() + timeout
        head = self._read_until(b"\r\n\r\n", deadline)
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}
        if 100 <= status < 200 or status in (204, 304):
            body = b""
        elif "content-length" in headers:
            body = self._read_exactly(int(headers["content-length"]), deadline)
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = self._read_chunked(deadline)
        else:
            body = self.wait_closed(deadline - time.monotonic())
        return RawResponse(status, headers, body, head)

    def request(self, data: bytes, timeout: float = 5.0) -> RawResponse:
        self.send(data)
        return self.read_response(timeout)

    def _fill(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        got = self.recv(left) if left > 0 else None
        if got is None:
            raise TimeoutError(f"no complete response before the deadline; have {self.buffer[:200]!r}")
        if got == b"":
            raise PeerClosed(f"peer closed; have {self.buffer[:200]!r}")
        self.buffer += got

    def _read_until(self, marker: bytes, deadline: float) -> bytes:
        while (end := self.buffer.find(marker)) < 0:
            self._fill(deadline)
        data, self.buffer = self.buffer[:end], self.buffer[end + len(marker) :]
        return data

    def _read_exactly(self, n: int, deadline: float) -> bytes:
        while len(self.buffer) < n:
            self._fill(deadline)
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def _read_chunked(self, deadline: float) -> bytes:
        body = b""
        while size := int(self._read_until(b"\r\n", deadline).split(b";")[0], 16):
            body += self._read_exactly(size, deadline)
            self._read_until(b"\r\n", deadline)
        self._read_until(b"\r\n", deadline)
        return body


def get(port: int, path: str, timeout: float = 5.0) -> RawResponse:
    """A plain GET on a fresh connection."""
    with RawClient(port, timeout) as c:
        return c.request(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode(), timeout)


def post(path: str, body: bytes, *, host: str = "x") -> bytes:
    """Bytes of a POST with a correct Content-Length."""
    head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
    return head.encode() + b"content-length: %d\r\n\r\n" % len(body) + body
