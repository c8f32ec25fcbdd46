"""The transport a request's uvicorn cycle writes to: its response head goes with the first body message.

uvicorn writes the head on ``http.response.start`` and each body message on its own: an answer read whole is
two ``send()`` calls, and the client is woken twice. ``HeldHead`` stands for the connection's transport in
one request's cycle: the cycle's first write (the head, as uvicorn framed it) is held until its next write
(the first body message) and both go in one ``send()``. A head with no write after it in the same turn of the
loop goes on the loop's next turn (an SSE stream whose first event is not there yet), so no head waits on the
engine; a close (the response's end without keep-alive, the app's failure) writes it first. The bytes on the
wire are uvicorn's, in its order; uvicorn's cycle, its framing and checks, are unchanged.
"""

from __future__ import annotations

import asyncio

#: Bodies up to this size are joined to the head (one copy); larger ones go beside it in one ``writelines``
#: (a writev: no copy of the body).
_JOIN_BYTES = 16384


class HeldHead:
    """The ``write``, ``close`` and ``is_closing`` a uvicorn cycle asks of its transport (see the module)."""

    __slots__ = ("_first", "_held", "_loop", "_real")

    def __init__(self, real: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._real = real
        self._loop = loop
        self._held: bytes | None = None
        self._first = True

    def write(self, data: bytes) -> None:
        if self._first:  # the head (or a 100 Continue, which goes the same way)
            self._first = False
            self._held = data
            self._loop.call_soon(self._flush)  # no other write this turn: it goes on its own
            return
        held = self._held
        if held is None:
            self._real.write(data)
            return
        self._held = None
        if len(data) <= _JOIN_BYTES:
            self._real.write(held + data)
        else:
            self._real.writelines((held, data))

    def close(self) -> None:
        self._flush()
        self._real.close()

    def is_closing(self) -> bool:
        return self._real.is_closing()

    def _flush(self) -> None:
        held = self._held
        if held is not None:
            self._held = None
            if not self._real.is_closing():  # the client left meanwhile: nobody to write to
                self._real.write(held)
