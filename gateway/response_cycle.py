"""uvicorn's request-response cycle, with the response head written together with the first body message.

uvicorn writes the head on ``http.response.start`` and each body message on its own: an answer read whole is
two ``send()`` calls, and the client is woken twice. ``HeldHeadCycle`` keeps the head (as uvicorn framed it)
until the first body message, then writes both in one ``send()``. A head with no body message in the same
turn of the loop goes on the loop's next turn (an SSE stream whose first event is not there yet), so no
head waits on the engine; a close (a response's end, the app's failure) writes it first. The bytes on the
wire are uvicorn's, in its order.

The head is caught by standing in for the transport while uvicorn writes it (``write``, ``close``,
``is_closing``: all the cycle asks of one); uvicorn's framing, checks and completion are its own code.
"""

from __future__ import annotations

import asyncio

from uvicorn._types import ASGISendEvent
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

#: Bodies up to this size are joined to the head (one copy); larger ones go beside it in one ``writelines``
#: (a writev: no copy of the body).
_JOIN_BYTES = 16384


class HeldHeadCycle(RequestResponseCycle):
    """A uvicorn cycle whose response head waits for the first body message (see the module).

    ``GatewayHttpProtocol`` turns each cycle it makes into one (``adopt``), before its task first runs.
    While a head is held, ``transport`` is this cycle itself and ``_real`` the connection's transport.
    """

    loop: asyncio.AbstractEventLoop
    _real: asyncio.Transport
    _head: bytes | None  # b"": uvicorn is writing the head now; bytes: the head held

    @classmethod
    def adopt(cls, cycle: RequestResponseCycle, loop: asyncio.AbstractEventLoop) -> None:
        cycle.__class__ = cls  # uvicorn builds the cycle; only its ``send`` changes
        assert isinstance(cycle, cls)
        cycle.loop = loop
        cycle._real = cycle.transport
        cycle._head = None

    async def send(self, message: ASGISendEvent) -> None:
        if self.response_started or self.disconnected or message["type"] != "http.response.start":
            await super().send(message)  # a held head goes with this message's write (``write``)
            if self._head and self.response_complete:  # no write of its own (HEAD): the head goes now
                self._flush()
            return
        self._head = b""
        self.transport = self  # type: ignore[assignment]  # uvicorn's write of the head comes to ``write``
        try:
            await super().send(message)
        finally:
            if not self._head:  # refused before its write (an invalid header): nothing held
                self._release()
        if self._head:
            self.loop.call_soon(self._flush)  # no body message this turn: the head goes on its own

    # -- the transport, while a head is held ----------------------------------------------------------------

    def write(self, data: bytes) -> None:
        head = self._head
        if head == b"":
            self._head = data  # the head itself: held
            return
        self._release()
        if head is None:
            self._real.write(data)
        elif len(data) <= _JOIN_BYTES:
            self._real.write(head + data)
        else:
            self._real.writelines((head, data))

    def close(self) -> None:
        self._flush()
        self._real.close()

    def is_closing(self) -> bool:
        return self._real.is_closing()

    def _flush(self) -> None:
        """Write a head still held (called on the loop's next turn, and before a close)."""
        head = self._head
        if head is None:
            return
        self._release()
        if head and not self.disconnected and not self._real.is_closing():
            self._real.write(head)

    def _release(self) -> None:
        self._head = None
        self.transport = self._real
