"""A real redis-server for tests, on a free 127.0.0.1 port, without persistence (a restart loses everything).

Missing binary: tests that need it skip with a message, unless ``WARMROUTE_REQUIRE_REDIS=1``, then they fail.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any

import pytest
import redis
from redis.asyncio import Connection

REQUIRE_ENV = "WARMROUTE_REQUIRE_REDIS"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def redis_binary() -> str:
    """The redis-server path, or skip (fail when $WARMROUTE_REQUIRE_REDIS=1) if it is not installed."""
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.path.exists("/usr/bin/redis-server") else None
    )
    if found is None:
        message = (
            "redis-server not found on PATH: install redis (apt-get install redis-server) to run these tests"
        )
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message} ({REQUIRE_ENV}=1)")
        pytest.skip(message)
    return found


class RedisServer:
    """``start()``/``kill()`` can be repeated; the port stays the same, so clients can reconnect."""

    def __init__(self, binary: str, port: int | None = None) -> None:
        self.binary = binary
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="warmroute-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True, socket_timeout=5)

    def start(self, timeout: float = 10.0) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ]
        args += ["--dir", self.dir, "--daemonize", "no", "--loglevel", "warning"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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
            self.proc.wait(10)
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
