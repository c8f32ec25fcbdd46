"""Local ports and child processes, one copy for the tools and the tests. Everything binds 127.0.0.1.

``free_port`` hands out a port for a child to listen on. It never comes from the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``): that range is where ``bind(port 0)`` and every outgoing
connection get their local port, so a port found there and closed again can be taken by any process before
the child binds it ("Address already in use"). Outside that range only an explicit bind takes a port, and
the explicit binds of our tests and tools draw their ports from one cursor shared by every process of this
user (a file under a lock), so no two of them get the same port until the cursor has gone round the whole
range. A port something already listens on is skipped.

``spawn`` starts a child and ``stop`` ends it (SIGTERM, then SIGKILL); ``child`` does both around a ``with``
block. ``wait_http`` polls a URL until it answers as wanted and fails fast when the process behind it exits
first, so a crashed child is reported at once instead of after the whole timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

import httpx

LOCALHOST = "127.0.0.1"
WAIT_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.1
PROBE_TIMEOUT_S = 2.0
_PR_SET_PDEATHSIG = 1
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
DEFAULT_EPHEMERAL = (49152, 65535)  # IANA's dynamic ports: the BSD and macOS default
FIRST_UNPRIVILEGED = 1024
LISTEN_SPAN = 8192  # ports handed out before the cursor comes round again

#: What ``subprocess.Popen`` accepts for stdout/stderr: a file, DEVNULL/STDOUT, or None (inherit ours).
Output = int | IO[bytes] | None


class NotReady(RuntimeError):
    """A URL did not answer as wanted in time; ``returncode`` is set when its process exited first."""

    def __init__(self, url: str, timeout_s: float, returncode: int | None) -> None:
        why = f"its process exited with code {returncode}" if returncode is not None else "timed out"
        super().__init__(f"{url} not ready after {timeout_s:.0f}s: {why}")
        self.url = url
        self.returncode = returncode


def free_port() -> int:
    """A port to give a child to listen on; nobody else is handed it, and no outgoing connection takes it.
    Also the port to use for "nothing listens here": a client connecting to a closed port in the ephemeral
    range can be given that same port as its own and connect to itself (TCP simultaneous open)."""
    return PortAllocator(listen_ports(ephemeral_ports())).take()


def port_is_free(port: int) -> bool:
    """Nothing holds ``port`` on loopback (no listener, no connection in TIME_WAIT): bindable without
    SO_REUSEADDR."""
    with socket.socket() as s:
        try:
            s.bind((LOCALHOST, port))
        except OSError:
            return False
    return True


def ephemeral_ports() -> range:
    """The kernel's ephemeral port range: local ports of outgoing connections and of ``bind(port 0)``."""
    try:
        low, high = map(int, Path(EPHEMERAL_RANGE_FILE).read_text().split())
    except (OSError, ValueError):
        low, high = DEFAULT_EPHEMERAL  # not Linux
    return range(low, high + 1)


def listen_ports(ephemeral: range, span: int = LISTEN_SPAN) -> range:
    """Up to ``span`` unprivileged ports just below the ephemeral range (or above it, where that has more)."""
    below = range(max(FIRST_UNPRIVILEGED, ephemeral.start - span), ephemeral.start)
    above = range(ephemeral.stop, min(ephemeral.stop + span, 65536))
    ports = below if len(below) >= len(above) else above
    if not ports:
        raise RuntimeError(f"no unprivileged ports outside the ephemeral range {ephemeral}")
    return ports


def _state_dir() -> Path:
    """One folder for every process of the user whatever ``TMPDIR`` each was given (a test or the demo may
    get a temporary folder of its own, which must stay empty and must not split the cursor)."""
    fixed = Path("/tmp")
    return fixed if fixed.is_dir() and os.access(fixed, os.W_OK) else Path(tempfile.gettempdir())


class PortAllocator:
    """Hands out ``ports`` in turn, skipping ports in use; the turn lives in ``state``, a file shared by
    every process that uses it, read and advanced under an exclusive lock."""

    def __init__(self, ports: Sequence[int], state: Path | None = None) -> None:
        self.ports = ports
        self.state = state or _state_dir() / f"warmroute-ports-{os.getuid()}"

    def take(self) -> int:
        with self.state.open("a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
            f.seek(0)
            text = f.read().strip()
            cursor = int(text) if text.isdigit() else random.randrange(len(self.ports))
            for step in range(len(self.ports)):
                index = (cursor + step) % len(self.ports)
                if port_is_free(self.ports[index]):
                    f.seek(0)
                    f.truncate()
                    f.write(str(index + 1))
                    f.flush()
                    return self.ports[index]
        raise OSError(errno.EADDRINUSE, f"every port of {self.ports} is in use")


def answers(response: httpx.Response) -> bool:
    """Anything but a server error: the process is up and serving."""
    return response.status_code < 500


def ok(response: httpx.Response) -> bool:
    return response.status_code == 200


def wait_http(
    url: str,
    ready: Callable[[httpx.Response], bool] = answers,
    *,
    timeout_s: float = WAIT_TIMEOUT_S,
    process: subprocess.Popen[bytes] | None = None,
) -> None:
    """Poll GET ``url`` until ``ready(response)``; ``NotReady`` on timeout or when ``process`` exits."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=PROBE_TIMEOUT_S) as client:
        while True:
            if process is not None and process.poll() is not None:
                raise NotReady(url, timeout_s, process.returncode)
            with contextlib.suppress(httpx.HTTPError):
                if ready(client.get(url)):
                    return
            if time.monotonic() >= deadline:
                raise NotReady(url, timeout_s, None)
            time.sleep(POLL_INTERVAL_S)


def spawn(
    argv: Sequence[str],
    *,
    stdout: Output = subprocess.DEVNULL,
    stderr: Output = subprocess.DEVNULL,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    group: bool = False,
    die_with_parent: bool = False,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` with no stdin. ``group``: in a session of its own, so a Ctrl-C in the terminal does
    not reach it and ``stop(..., group=True)`` reaches its children too. ``die_with_parent`` (Linux): the
    kernel sends it SIGTERM if this process dies without cleaning up, so even a SIGKILL leaves no orphan."""
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        env=env,
        cwd=cwd,
        start_new_session=group,
        preexec_fn=_die_with_parent if die_with_parent and sys.platform == "linux" else None,
    )


def stop(process: subprocess.Popen[bytes], timeout_s: float = STOP_TIMEOUT_S, *, group: bool = False) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; ``group``: the whole process group (see ``spawn``).
    A process that already exited is left alone."""
    if process.poll() is not None:
        return
    _signal(process, signal.SIGTERM, group)
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        _signal(process, signal.SIGKILL, group)
        process.wait(timeout_s)


@contextlib.contextmanager
def child(
    argv: Sequence[str],
    *,
    stdout: Output = subprocess.DEVNULL,
    stderr: Output = subprocess.DEVNULL,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    group: bool = False,
) -> Iterator[subprocess.Popen[bytes]]:
    """``spawn`` for the duration of a ``with`` block; ``stop`` on the way out, whatever happened."""
    process = spawn(argv, stdout=stdout, stderr=stderr, env=env, cwd=cwd, group=group)
    try:
        yield process
    finally:
        stop(process, group=group)


def checkouts(pairs: Sequence[str]) -> dict[str, Path]:
    """``NAME=PATH`` pairs of checkouts to run the gateway of (the benchmarks' ``--tree``/``--trees``), by
    name; ValueError for a pair that is not one, whose path has no ``gateway/cli.py``, or repeats a name."""
    out: dict[str, Path] = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        name, tree = name.strip(), Path(path).resolve()
        if not sep or not name or name in out or not (tree / "gateway" / "cli.py").is_file():
            raise ValueError(f"expects distinct NAME=PATH pairs of checkouts, got {pair!r}")
        out[name] = tree
    return out


def checkout_env(tree: Path) -> dict[str, str]:
    """This environment with ``tree``'s packages first on the path: a child run from there imports its
    code and this venv's dependencies."""
    return {**os.environ, "PYTHONPATH": str(tree)}


def python(*args: str) -> list[str]:
    """An argv running this interpreter (the same venv) with ``args``."""
    return [sys.executable, *args]


def _signal(process: subprocess.Popen[bytes], sig: int, group: bool) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited between poll() and now
        if group:
            os.killpg(process.pid, sig)
        else:
            process.send_signal(sig)


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: ask the kernel for SIGTERM when the parent dies."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
