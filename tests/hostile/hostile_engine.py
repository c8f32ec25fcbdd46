"""A raw-socket engine for hostile tests: each path answers with a script of bytes, pauses and hang-ups.

    engine = HostileEngine({
        "/health": trickle(ok_response(), every_s=0.2),          # a /health that takes seconds
        "/v1/chat/completions": [head_then_silence(), ok_json({"id": "x"})],   # 1st request, then the rest
    })
    with engine.serve() as url:
        ...
    engine.requests  # what the gateway sent, parsed
    engine.received  # every byte of it, as read

A script is ``async (request, conn) -> None``; ``steps(...)`` builds one from bytes to send, seconds to
sleep and the markers HANG / CLOSE / RESET. After a script returns with the connection open, the engine
reads the next request on it (keep-alive), as a real engine would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import struct
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

MAX_HEAD = 1 << 20


@dataclass
class RawRequest:
    method: str
    path: str  # with the query string
    headers: dict[str, str]  # lower-case names; the last value wins
    body: bytes


@dataclass
class Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def until_client_leaves(self) -> None:
        """Discard whatever the client still sends until it closes (or the engine stops)."""
        while await self.reader.read(65536):
            pass


Script = Callable[[RawRequest, Conn], Awaitable[None]]


class Mark(Enum):
    HANG = "hang"  # keep the connection open, send nothing more, until the client leaves
    CLOSE = "close"  # FIN
    RESET = "reset"  # RST (SO_LINGER 0)


HANG, CLOSE, RESET = Mark.HANG, Mark.CLOSE, Mark.RESET
Step = bytes | float | Mark


def steps(*script: Step) -> Script:
    """Send bytes, sleep seconds (a float), or end with HANG / CLOSE / RESET."""

    async def run(_request: RawRequest, conn: Conn) -> None:
        writer = conn.writer
        for step in script:
            if isinstance(step, bytes):
                writer.write(step)
                await writer.drain()
            elif isinstance(step, float | int):
                await asyncio.sleep(step)
            elif step is HANG:
                await conn.until_client_leaves()
                writer.close()
                return
            elif step is CLOSE:
                writer.close()
                return
            else:
                _reset(writer)
                return

    return run


def response(status: int = 200, body: bytes = b"", headers: Mapping[str, str] | None = None) -> bytes:
    """A well-formed response with Content-Length (unless ``headers`` says otherwise)."""
    fields = {"content-length": str(len(body)), **(headers or {})}
    head = f"HTTP/1.1 {status} X\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    return head.encode() + body


def ok_json(body: bytes | str | dict[str, object], status: int = 200) -> Script:
    raw = body if isinstance(body, bytes) else (body if isinstance(body, str) else json.dumps(body)).encode()
    return steps(response(status, raw, {"content-type": "application/json"}))


def head_then_silence(status: int = 200, headers: Mapping[str, str] | None = None) -> Script:
    """Status line and headers promising a body (chunked unless told), then nothing, ever."""
    fields = headers or {"content-type": "text/event-stream", "transfer-encoding": "chunked"}
    head = f"HTTP/1.1 {status} X\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    return steps(head.encode(), HANG)


def silence() -> Script:
    """Read the request, never answer."""
    return steps(HANG)


def trickle(data: bytes, every_s: float, chunk: int = 1, then: Mark | None = None) -> Script:
    """``data`` ``chunk`` bytes at a time, one piece every ``every_s`` seconds."""
    pieces: list[Step] = []
    for i in range(0, len(data), chunk):
        pieces += [data[i : i + chunk], float(every_s)]
    return steps(*pieces, *([then] if then else []))


def huge_headers(size: int, status: int = 200) -> Script:
    """A response whose one header is ``size`` bytes long, then an empty body."""
    head = f"HTTP/1.1 {status} X\r\ncontent-length: 0\r\nx-big: ".encode()
    return steps(head + b"a" * size + b"\r\n\r\n")


def stray_on_reuse(answer: bytes, stray: bytes) -> Script:
    """Send ``answer``; if the client then sends another request on this connection, answer it with ``stray``
    alone (as an engine that gets HEAD wrong sends the body late). That request is not recorded; when the
    client closes the connection instead, the script ends there."""

    async def run(_request: RawRequest, conn: Conn) -> None:
        conn.writer.write(answer)
        await conn.writer.drain()
        if await _read_request(conn.reader) is not None:
            conn.writer.write(stray)
            await conn.writer.drain()

    return run


def garbage(data: bytes = b"\x00\xffnot http at all\r\n\r\n") -> Script:
    return steps(data, CLOSE)


@dataclass
class HostileEngine:
    """An asyncio TCP server in a thread. ``routes`` maps a path (no query) to a script, or to a list used
    one request at a time (the last one repeats). Unknown paths get ``default``."""

    routes: Mapping[str, Script | Sequence[Script]] = field(default_factory=dict)
    default: Script = field(default_factory=lambda: steps(response(404, b"not found")))
    requests: list[RawRequest] = field(default_factory=list)
    received: bytearray = field(default_factory=bytearray)  # every request byte read, all connections
    connections: int = 0  # accepted so far
    open: int = 0  # open now
    _served: dict[str, int] = field(default_factory=dict)

    def script_for(self, path: str) -> Script:
        route = self.routes.get(path.split("?", 1)[0])
        if route is None:
            return self.default
        if callable(route):
            return route
        n = self._served.get(path, 0)
        self._served[path] = n + 1
        return route[min(n, len(route) - 1)]

    @contextlib.contextmanager
    def serve(self) -> Iterator[str]:
        """Run until the block ends; yields the base URL."""
        started = threading.Event()
        port: list[int] = []
        stop: list[Callable[[], None]] = []

        async def main() -> None:
            loop = asyncio.get_running_loop()
            done = asyncio.Event()
            server = await asyncio.start_server(self._connection, "127.0.0.1", 0, limit=MAX_HEAD)
            port.append(server.sockets[0].getsockname()[1])
            stop.append(lambda: loop.call_soon_threadsafe(done.set))
            started.set()
            async with server:
                await done.wait()
                server.close()
                for task in [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]:
                    task.cancel()

        thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        thread.start()
        if not started.wait(10):
            raise RuntimeError("hostile engine did not start")
        try:
            yield f"http://127.0.0.1:{port[0]}"
        finally:
            stop[0]()
            thread.join(10)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        try:
            while not writer.is_closing():
                request = await _read_request(reader, self.received)
                if request is None:
                    return
                self.requests.append(request)
                await self.script_for(request.path)(request, Conn(reader, writer))
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self.open -= 1
            if not writer.is_closing():
                writer.close()


async def _read_request(reader: asyncio.StreamReader, log: bytearray) -> RawRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        log += exc.partial
        return None
    log += head
    lines = head.decode("latin-1").split("\r\n")
    method, path, _version = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = b""
        while size := int(_logged(log, await reader.readuntil(b"\r\n")).split(b";")[0], 16):
            body += _logged(log, await reader.readexactly(size + 2))[:-2]
        _logged(log, await reader.readuntil(b"\r\n"))
    else:
        body = _logged(log, await reader.readexactly(int(headers.get("content-length", "0"))))
    return RawRequest(method, path, headers, body)


def _logged(log: bytearray, data: bytes) -> bytes:
    log += data
    return data


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
