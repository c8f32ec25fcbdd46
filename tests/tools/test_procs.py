"""tools.procs: waiting for a child to answer, and stopping it (and its own children) afterwards."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tools.procs import NotReady, child, free_port, ok, python, spawn, stop, wait_http

from upstreams import serve

# Prints the pid of a grandchild it started, then sleeps: both must be gone once the group is stopped.
PARENT_OF_SLEEPER = (
    "import subprocess, sys, time\n"
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(60)\n"
)
IGNORES_SIGTERM = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_wait_http_fails_fast_when_the_process_exits_first() -> None:
    proc = spawn(python("-c", "raise SystemExit(3)"))
    started = time.monotonic()
    with pytest.raises(NotReady) as caught:
        wait_http(f"http://127.0.0.1:{free_port()}/", timeout_s=30, process=proc)
    assert caught.value.returncode == 3
    assert time.monotonic() - started < 10  # not the 30 s timeout


def test_wait_http_polls_until_ready_and_times_out_otherwise() -> None:
    hits = 0

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal hits
        if scope["type"] != "http":
            return
        hits += 1
        status = 200 if hits >= 3 and scope["path"] == "/ready" else 503
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    with serve(app) as (url, _server):
        wait_http(url + "/ready", ok, timeout_s=10)
        assert hits == 3  # two 503s, then the 200
        with pytest.raises(NotReady) as caught:
            wait_http(url + "/never", ok, timeout_s=0.3)
        assert caught.value.returncode is None


def test_child_stops_the_whole_group_on_the_way_out() -> None:
    with (
        pytest.raises(RuntimeError),
        child(python("-c", PARENT_OF_SLEEPER), stdout=subprocess.PIPE, group=True) as proc,
    ):
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        proc.stdout.close()
        raise RuntimeError("the block fails; the children must still be stopped")
    assert proc.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 5
    while not _gone(grandchild) and time.monotonic() < deadline:  # SIGTERM is delivered asynchronously
        time.sleep(0.02)
    assert _gone(grandchild)


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored() -> None:
    proc = spawn(python("-c", IGNORES_SIGTERM), stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"  # the handler is installed
    stop(proc, timeout_s=0.5)
    assert proc.returncode == -signal.SIGKILL
    stop(proc)  # already exited: nothing to do, no error
    proc.stdout.close()
