"""How the gateway is served: uvicorn, plus bounds on what one client can do to the server.

uvicorn's httptools protocol waits forever for a request head, accepts a head of any size (64 MiB of header
cost 4.7 s of CPU, the event loop frozen meanwhile), waits forever for a body that stops short, and accepts
sockets until the process runs out of file descriptors. ``GatewayHttpProtocol`` adds, per connection:

- a head deadline: from accept (or from the first byte of a keep-alive connection's next request) until
  the request head is complete. A socket that sent nothing is closed; one that sent part of a head gets 408.
  Idle keep-alive connections stay uvicorn's business (``timeout_keep_alive``).
- a head size limit (request line included) and a header-count limit: 431 as soon as one is crossed.
- a body-silence deadline: the longest pause while the client sends a body; then 408.
- a cap on open connections: the one over it gets 503 at once and is closed, so idle sockets cannot
  exhaust the process's descriptors and /healthz keeps answering.

Cost on the hot path: one timer per connection (the first head's); later heads and bodies get one only
if a chunk leaves them incomplete; a few comparisons per received chunk. Errors are OpenAI-shaped; each
logs one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import resource
import socket
import time
from dataclasses import dataclass
from typing import Any

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.supervisors import Multiprocess

from config.settings import Settings
from gateway.errors import BadRequest, GatewayError, RequestHeaderTooLarge, RequestTimeout, ServerBusy

log = logging.getLogger("warmroute.server")

#: After a 431 the client is usually still sending its head. Closing a socket with unread data makes the
#: kernel answer with a reset, which can destroy the 431 before the client reads it; so we stop writing,
#: keep reading and discard for this long (or until the client closes), as nginx's lingering close does.
LINGER_S = 2.0
#: At most one "refused: over the connection cap" line per this many seconds (a flood must not log a flood).
BUSY_LOG_EVERY_S = 10.0
STARTUP_FAILURE = 3
#: Descriptors besides client and upstream sockets: the interpreter, the event loop, listeners, Redis, logs.
FD_RESERVE = 64


@dataclass(frozen=True, slots=True)
class InboundLimits:
    header_timeout_s: float = 10.0
    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    max_connections: int = 2048
    body_read_timeout_s: float = 30.0

    @classmethod
    def from_settings(cls, settings: Settings) -> InboundLimits:
        s = settings.server
        return cls(
            header_timeout_s=s.header_timeout_s,
            max_header_bytes=s.max_header_bytes,
            max_headers=s.max_headers,
            max_connections=s.max_connections,
            body_read_timeout_s=settings.limits.body_read_timeout_s,
        )


class _Throttle:
    """Say how many events happened since the last line, at most once per ``every_s``."""

    def __init__(self, every_s: float) -> None:
        self.every_s = every_s
        self.next_at = 0.0
        self.count = 0

    def due(self) -> int:
        """Count one event; the number to report now (0: stay quiet)."""
        self.count += 1
        now = time.monotonic()
        if now < self.next_at:
            return 0
        self.next_at = now + self.every_s
        count, self.count = self.count, 0
        return count


class GatewayConfig(uvicorn.Config):
    """uvicorn's Config plus our inbound limits. Pickled to each worker like any uvicorn Config."""

    def __init__(
        self,
        app: Any,
        *,
        limits: InboundLimits,
        needed_fds: int = 0,
        admin_listen: tuple[str, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, http=GatewayHttpProtocol, **kwargs)
        self.admin_listen = admin_listen  # a second listener for /admin only (``admin.port``)
        self.inbound_limits = limits
        self.needed_fds = needed_fds  # client cap + upstream pools + a reserve: what ``run`` asks the OS for
        self.busy_log = _Throttle(BUSY_LOG_EVERY_S)


def uvicorn_config(app: Any, settings: Settings, **overrides: Any) -> GatewayConfig:
    """The Config ``warmroute serve`` runs with; tests pass host/port/log options as ``overrides``."""
    server = settings.server
    options: dict[str, Any] = {
        "host": server.host,
        "port": server.port,
        "workers": server.workers,
        "log_level": server.log_level,
        "server_header": False,
        "access_log": False,
        "proxy_headers": False,
        # On SIGTERM uvicorn stops accepting, then waits this long for requests in flight (then cancels them).
        "timeout_graceful_shutdown": server.shutdown_grace_s,
    }
    options.update(overrides)
    limits = InboundLimits.from_settings(settings)
    upstream = settings.limits.max_connections * max(1, len(settings.backends))  # the pool is per origin
    needed = limits.max_connections + upstream + FD_RESERVE
    admin = settings.admin
    listen = None if admin.port is None else (admin.host or str(options["host"]), admin.port)
    return GatewayConfig(app, limits=limits, needed_fds=needed, admin_listen=listen, **options)


def run(config: GatewayConfig) -> int:
    """Serve until told to stop (what ``uvicorn.run`` does, for a Config we built). Exit status."""
    ensure_fd_limit(config.needed_fds)
    server = uvicorn.Server(config)
    if config.workers > 1 or config.admin_listen is not None:
        sockets = [config.bind_socket(), *_admin_socket(config)]
        if config.workers == 1:
            server.run(sockets=sockets)
            return 0 if server.started else STARTUP_FAILURE
        if "target" in inspect.signature(Multiprocess).parameters:  # uvicorn < 0.36 wants the target
            Multiprocess(config, target=server.run, sockets=sockets).run()  # type: ignore[call-arg]
        else:
            Multiprocess(config, sockets=sockets).run()
        return 0
    server.run()
    return 0 if server.started else STARTUP_FAILURE


def _admin_socket(config: GatewayConfig) -> list[socket.socket]:
    """The admin listener, bound like uvicorn binds its own (inheritable, for the workers)."""
    if config.admin_listen is None:
        return []
    host, port = config.admin_listen
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    log.info("admin API listening on %s:%d", host, port)
    return [sock]


def ensure_fd_limit(needed: int) -> None:
    """Raise the soft open-file limit towards ``needed`` (up to the hard limit), as Go's runtime does; warn
    if it stays short: then accept() can fail with EMFILE before the connection cap refuses anyone."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    if soft < needed:
        log.warning(
            "open-file limit is %d, below the %d that server.max_connections, limits.max_connections and "
            "the backends may need: raise `ulimit -n` or lower server.max_connections",
            soft,
            needed,
        )


class _Refused(Exception):
    """Raised inside a parser callback to stop parsing; the error to answer is on the protocol."""


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with head/body deadlines, head limits and a connection cap.

    State: ``_in_head`` from accept, and again from the end of each request, until its head is complete;
    ``_in_body`` from then until the request's last body byte. ``_discarding`` once we answered an error.
    """

    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if isinstance(config, GatewayConfig):
            self.limits = config.inbound_limits
            self.busy_log = config.busy_log
        else:
            self.limits = InboundLimits()
            self.busy_log = _Throttle(BUSY_LOG_EVERY_S)
        self._in_head = True
        self._in_body = False
        self._discarding = False
        self._head_bytes = 0
        self._heads = 0  # complete heads so far
        self._header_count = 0
        self._body_at = 0.0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._refusal: GatewayError | None = None

    # -- connection ---------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport
            self._discarding = True
            cap = self.limits.max_connections
            self._write_error(
                ServerBusy(f"the gateway holds {cap} client connections, its limit; retry later")
            )
            transport.close()
            if count := self.busy_log.due():
                log.warning("refused %d connection(s): over the cap of %d open connections", count, cap)
            return
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        if self._in_body:
            self._body_at = self.loop.time()
        elif self._in_head:
            room = self.limits.max_header_bytes - self._head_bytes
            if len(data) > room:
                data = self._feed_head_limited(data, room)
            else:
                self._head_bytes += len(data)
        if data:
            self._feed(data)
        # Timers only for what is still incomplete after this chunk: a head or body that arrives whole
        # (the common case) costs none. The first head's timer runs from connection_made.
        if self._discarding:
            return
        if self._in_head and self._head_bytes and self._head_timer is None:
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)
        elif self._in_body and self._body_timer is None:
            self._body_at = self.loop.time()
            self._body_timer = self.loop.call_later(self.limits.body_read_timeout_s, self._body_timed_out)

    def _feed_head_limited(self, data: bytes, room: int) -> bytes:
        """Feed what may still belong to the head; 431 unless the head ended there. Returns the rest."""
        heads = self._heads
        self._feed(data[:room])
        if self._discarding:
            return b""
        if self._heads == heads:
            limit = self.limits.max_header_bytes
            self._refuse(RequestHeaderTooLarge(f"request head is over {limit} bytes (request line included)"))
            return b""
        return data[room:]

    def _feed(self, data: bytes) -> None:
        """uvicorn's ``data_received``, except that our limits answer their own status, JSON-shaped."""
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
        except httptools.HttpParserError as exc:
            self._refuse(self._refusal or BadRequest(f"invalid HTTP request: {exc}"))

    # -- parser callbacks ---------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._header_count = 0
        super().on_message_begin()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.limits.max_headers:
            self._refusal = RequestHeaderTooLarge(f"request has more than {self.limits.max_headers} headers")
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._in_body = True
        self._heads += 1
        self._head_bytes = 0
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._in_body = False
        self._in_head = True
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    # -- deadlines ----------------------------------------------------------------------------------------

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self._discarding or self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # The next (pipelined) request started while this one is still answered: not late yet.
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)
            return
        if self._head_bytes == 0:
            self._discarding = True
            self.transport.close()  # nothing was asked: nobody to answer
            return
        timeout = self.limits.header_timeout_s
        self._refuse(RequestTimeout(f"request head not complete within {timeout:g} s"), linger=False)

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self._in_body or self._discarding or self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is None or self.transport.get_protocol() is not self:  # upgraded: not ours any more
            return
        now = self.loop.time()
        if self.flow.read_paused or cycle.waiting_for_100_continue:
            self._body_at = now  # we are not reading (the app is behind), so the client may not send
        if cycle.response_complete:  # answered without reading it all; the rest of the body is moot
            self._discarding = True
            self.transport.close()
            return
        silent = now - self._body_at
        timeout = self.limits.body_read_timeout_s
        if silent < timeout:
            self._body_timer = self.loop.call_later(timeout - silent, self._body_timed_out)
            return
        self._refuse(
            RequestTimeout(f"request body stalled: nothing received for {timeout:g} s"), linger=False
        )

    # -- answering ----------------------------------------------------------------------------------------

    def _refuse(self, err: GatewayError, *, linger: bool = True) -> None:
        """Answer ``err`` (unless a response is already under way), then close; one log line."""
        if self._discarding or self.transport.is_closing():
            return
        self._discarding = True
        cycle = self.cycle
        answering = cycle is not None and cycle.response_started and not cycle.response_complete
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() now says http.disconnect; its sends go nowhere
            cycle.message_event.set()
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "client"
        log.info("%s: %d %s: %s", client, err.status, err.code, err.message)
        if answering:
            self.transport.close()
            return
        self._write_error(err)
        if linger and self.transport.can_write_eof():
            self.transport.write_eof()
            self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _write_error(self, err: GatewayError) -> None:
        body = err.body()
        head = [STATUS_LINE[err.status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head.append(b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
        head.append(b"connection: close\r\n\r\n")
        self.transport.write(b"".join(head) + body)
