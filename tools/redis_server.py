"""A throwaway redis-server on a free 127.0.0.1 port, without persistence (a restart loses everything).

One copy for the tests (``tests/conftest.py`` decides whether a missing binary skips or fails) and for
``tools.bench_redis``. ``CountingConnection`` counts the network round trips a client makes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from types import TracebackType
from typing import Any

import redis
from redis.asyncio import Connection

from tools.procs import LOCALHOST, free_port, spawn

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 10.0


def find_binary() -> str | None:
    """The redis-server path, or None if it is not installed."""
    if found := shutil.which("redis-server"):
        return found
    return "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None


class RedisServer:
    """``start()``/``kill()`` can be repeated; the port stays the same, so clients can reconnect.
    As a context manager: started on entry, killed and its folder removed on exit."""

    def __init__(self, binary: str, port: int | None = None) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="warmroute-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def url(self) -> str:
        return f"redis://{LOCALHOST}:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host=LOCALHOST, port=self.port, decode_responses=True, socket_timeout=5)

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        no_persistence = ["--save", "", "--appendonly", "no", "--dir", self.dir]
        args = [self.binary, "--port", str(self.port), "--bind", LOCALHOST, *no_persistence]
        args += ["--daemonize", "no", "--loglevel", "warning"]
        self.proc = spawn(args)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.client().ping():
                    return
            except redis.ConnectionError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.01)

    def kill(self) -> None:
        """SIGKILL: no goodbye to clients, nothing saved."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(STOP_TIMEOUT_S)
            self.proc = None

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class CountingConnection(Connection):
    """Counts network round trips: redis-py sends each command, pipeline or script call with one
    ``send_packed_command`` and then reads the replies. Use ``fresh()`` for a counter of your own."""

    sent = 0

    @classmethod
    def fresh(cls) -> type[CountingConnection]:
        return type("Counting", (cls,), {"sent": 0})

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).sent += 1
        await super().send_packed_command(command, check_health)
