"""``warmroute demo --no-serve`` end to end: engines and gateway as child processes, affinity visible."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


def warmroute() -> list[str]:
    script = Path(sys.executable).parent / "warmroute"
    return [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli"]


def test_demo_shows_follow_ups_sticking_to_their_engine() -> None:
    done = subprocess.run(
        [*warmroute(), "demo", "--no-serve", "--port", "0", "--time-scale", "0.3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(engine-\d)\s+(\w+)\s+(\d+)\s", out, re.MULTILINE)
    assert len(rows) == 20  # 5 conversations x 4 turns
    home = {conv: engine for conv, turn, engine, _, _ in rows if turn == "1"}
    assert len(set(home.values())) == 3  # new conversations spread over all three engines
    for conv, turn, engine, route, _ in rows:
        if turn != "1":
            assert (engine, route) == (home[conv], "affinity_hit")
    warm = re.search(r"follow-ups on the warm engine: (\d+)/(\d+)", out)
    assert warm is not None and warm.group(1) == warm.group(2) == "15"
    assert "ERROR" not in out


@contextlib.contextmanager
def serving_demo(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """The demo in serving mode, its temporary folder under ``tmp_path``; killed after 120 s at the latest."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    argv = [sys.executable, "-m", "gateway.cli", "demo", "--port", "0", "--time-scale", "0.3"]
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
    with subprocess.Popen(argv, env=env, cwd=ROOT, **pipes) as proc:  # this checkout's code
        watchdog = threading.Timer(120, proc.kill)  # a hung demo fails the test instead of hanging it
        watchdog.start()
        try:
            yield proc
        finally:
            watchdog.cancel()
            if proc.poll() is None:
                proc.kill()


def read_until(proc: subprocess.Popen[str], prefix: str) -> list[str]:
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(prefix):
            return lines
    raise AssertionError(f"the demo ended before {prefix!r}:\n{''.join(lines)}")


def stopped_cleanly(proc: subprocess.Popen[str], tmp_path: Path) -> str:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, out + err
    assert "Traceback" not in err and "Exception ignored" not in err and "KeyboardInterrupt" not in err, err
    assert "stopping the gateway and the engines ..." in out
    assert list(tmp_path.iterdir()) == []  # its folder of configs and logs is gone
    return out


def test_sigterm_while_serving_exits_0_and_removes_its_folder(tmp_path: Path) -> None:
    with serving_demo(tmp_path) as proc:
        lines = read_until(proc, "Ctrl-C stops")
        (folder,) = tmp_path.iterdir()
        assert folder.name.startswith("warmroute-demo-")
        status = next(line for line in lines if line.startswith("Status page: "))
        url = status.split()[2]
        assert url.endswith("/admin/status")
        page = httpx.get(url, timeout=10)
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        stopped_cleanly(proc, tmp_path)
        gateway = url.removesuffix("/admin/status")
        with pytest.raises(httpx.ConnectError):  # the gateway was stopped with it
            httpx.get(gateway + "/healthz", timeout=5)


def test_sigterm_while_the_engines_start_exits_0_and_removes_its_folder(tmp_path: Path) -> None:
    """The signal lands while children start (the fork itself: tests/tools/test_launch.py)."""
    with serving_demo(tmp_path) as proc:
        read_until(proc, "starting ")
        stopped_cleanly(proc, tmp_path)
