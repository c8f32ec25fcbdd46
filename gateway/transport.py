"""The upstream transport seam: two Protocols and the one error hierarchy every transport raises.

A leaf module (imports nothing from the package). ``gateway.upstream.UpstreamPool`` is the real transport;
``tests/transports.py`` holds an in-memory fake for unit tests of the proxy.

Each error class says, as ``may_have_been_processed``, whether the engine may have acted on the request: a
caller may retry one that says False anywhere; one that says True only if the method is idempotent or running
the request twice is acceptable.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import ClassVar, Protocol

# RFC 9112 §9.3.1 / RFC 9110 §9.2.2: requests a client may resend on its own when a connection fails.
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})


class UpstreamTransportError(Exception):
    """Base of every error a transport raises for a failed exchange."""

    may_have_been_processed: ClassVar[bool] = True


class UpstreamConnectError(UpstreamTransportError):
    """Connect refused, timed out, TLS handshake or DNS failed: nothing was sent, so nothing was processed."""

    may_have_been_processed = False


class UpstreamPoolTimeout(UpstreamTransportError):
    """Every connection to the origin stayed busy past the pool timeout: nothing was sent or processed."""

    may_have_been_processed = False


class UpstreamProtocolError(UpstreamTransportError):
    """The connection broke, or the server sent garbage (a status outside 100-599 included), before the
    response head was complete.

    The request was sent: the server may have processed it (a non-streamed generation can run for minutes
    before its first byte).
    """


class UpstreamStaleConnection(UpstreamProtocolError):
    """A reused keep-alive connection closed before any response byte, and the method is not idempotent.

    Usually the server's idle close crossed the request and the server never read it; but a server that
    crashed or dropped the connection while working on it looks exactly the same, so it may have been
    processed. The pool resends idempotent requests once on a fresh connection and raises this for the rest.
    """


class UpstreamResponseHeadTooLarge(UpstreamProtocolError):
    """The response head passed the byte or header-count limit; the connection was aborted at that point.

    The server processed the request (it was answering).
    """


class UpstreamReadError(UpstreamTransportError):
    """The connection broke, or the body framing was invalid, after the response head: it was processed."""


class TransportResponse(Protocol):
    """A response whose head has arrived. Read the body with ``aiter_raw()``; always ``aclose()``."""

    @property
    def status(self) -> int: ...

    @property
    def headers(self) -> Sequence[tuple[bytes, bytes]]:
        """Names lower-cased, in the order received; no Content-Length on a response that has no body
        (to HEAD, 204, 304): it frames nothing there, and relayed it would promise the client one."""
        ...

    def header(self, name: bytes) -> bytes | None:
        """The first value of header ``name`` (lower-case), or None."""
        ...

    def aiter_raw(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive, transfer coding removed; raises ``UpstreamReadError`` if it breaks."""
        ...

    async def aclose(self) -> None:
        """Release the connection; an unfinished body aborts it (that is how the engine learns to stop)."""
        ...


class UpstreamTransport(Protocol):
    """Sends one request and returns once the response head is parsed."""

    async def request(
        self, method: str, origin: str, path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes
    ) -> TransportResponse:
        """Raises only ``UpstreamTransportError`` subclasses for failed exchanges (and ``ValueError`` for a
        malformed origin or target, ``RuntimeError`` once closed)."""
        ...

    async def aclose(self) -> None: ...
