"""Local ports and child processes, one copy for the tools and the tests. Everything binds 127.0.0.1.

``spawn`` starts a child and ``stop`` ends it (SIGTERM, then SIGKILL); ``child`` does both around a ``with``
block. ``wait_http`` polls a URL until it answers as wanted and fails fast when the process behind it exits
first, so a crashed child is reported at once instead of after the whole timeout.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
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
    """A port that was free a moment ago; the child binds it a little later (a small, accepted race)."""
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((LOCALHOST, port))
        except OSError:
            return False
    return True


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
    cwd: Path | str | None = None,
    group: bool = False,
) -> Iterator[subprocess.Popen[bytes]]:
    """``spawn`` for the duration of a ``with`` block; ``stop`` on the way out, whatever happened."""
    process = spawn(argv, stdout=stdout, stderr=stderr, cwd=cwd, group=group)
    try:
        yield process
    finally:
        stop(process, group=group)


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
