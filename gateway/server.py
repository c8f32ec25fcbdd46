"""How the gateway is served: uvicorn with our HTTP protocol (``gateway.server_protocol``: the bounds on what
one client can do to the server), an optional admin listener, and an open-file limit that fits the caps.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import resource
import socket
from typing import Any

import uvicorn
from uvicorn.supervisors import Multiprocess

from config.settings import Settings
from gateway.server_protocol import InboundConfig, InboundLimits

log = logging.getLogger("warmroute.server")

STARTUP_FAILURE = 3
#: Descriptors besides client and upstream sockets: the interpreter, the event loop, listeners, Redis, logs.
FD_RESERVE = 64
#: How often an idle server's main loop wakes (uvicorn's: 0.1 s): the Date header is refreshed each time.
TICK_S = 1.0


class GatewayConfig(InboundConfig):
    """uvicorn's Config with our protocol and inbound limits, plus how ``run`` serves it. Pickled to each
    worker like any uvicorn Config."""

    def __init__(
        self,
        app: Any,
        *,
        limits: InboundLimits,
        needed_fds: int = 0,
        admin_listen: tuple[str, int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, limits=limits, **kwargs)
        self.admin_listen = admin_listen  # a second listener for /admin only (``admin.port``)
        self.needed_fds = needed_fds  # client cap + upstream pools + a reserve: what ``run`` asks the OS for


class GatewayServer(uvicorn.Server):
    """uvicorn's Server, its main loop woken once a second (the Date header's refresh, which uvicorn does on
    every tenth of its 0.1 s ticks) or at once when told to stop, instead of ten times a second: an idle
    gateway's loop has nothing else to wake it for. Every write of ``should_exit`` (the signal handler's
    included) wakes the loop; each tick is uvicorn's own ``on_tick``."""

    def __init__(self, config: uvicorn.Config) -> None:
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._exit = False
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit = value
        if value and self._wake is not None and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)  # safe from a signal handler, and wakes the loop

    async def main_loop(self) -> None:
        self._loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + 10) % 864000  # a multiple of 10: each tick is uvicorn's once-a-second one
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(TICK_S):
                    await self._wake.wait()
            should_exit = await self.on_tick(counter)


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
        "ws": "none",  # no route serves WebSockets; every upgrade is refused (gateway.framing)
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
    server = GatewayServer(config)
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
