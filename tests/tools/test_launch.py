"""StopRequest: Ctrl-C and SIGTERM raise one KeyboardInterrupt, never inside a fork, never twice."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tools import launch as launch_module
from tools.launch import Launcher, StopRequest, sigterm_as_interrupt


def test_the_first_signal_raises_and_later_ones_are_only_noted() -> None:
    stop = StopRequest()
    stop.check()  # nothing asked yet
    with pytest.raises(KeyboardInterrupt):
        stop.handle(signal.SIGTERM, None)
    stop.handle(signal.SIGINT, None)  # during cleanup: noted, not raised
    assert stop.requested


def test_a_signal_inside_deferred_is_raised_when_the_block_ends() -> None:
    stop = StopRequest()
    reached = []
    with pytest.raises(KeyboardInterrupt), stop.deferred():
        stop.handle(signal.SIGTERM, None)
        reached.append("rest of the block")
    assert reached == ["rest of the block"]
    stop.handle(signal.SIGTERM, None)  # raised once already


def test_check_raises_a_stop_whose_exception_was_lost() -> None:
    stop = StopRequest()
    with pytest.raises(KeyboardInterrupt):
        stop.handle(signal.SIGTERM, None)  # imagine it raised inside a __del__ and was dropped
    with pytest.raises(KeyboardInterrupt):
        stop.check()


def test_a_signal_while_a_child_is_spawned_stops_after_it_is_registered(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    stop = StopRequest()
    monkeypatch.setattr(launch_module.tempfile, "tempdir", str(tmp_path))

    def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        stop.handle(signal.SIGTERM, None)  # as if it arrived in the fork: must not be lost
        return process

    monkeypatch.setattr(launch_module.procs, "spawn", spawn)
    launcher = Launcher("warmroute-test-", stop)
    with pytest.raises(KeyboardInterrupt):
        launcher._spawn("engine-1", 1, ["unused"])
    (child,) = launcher.children  # registered first, so close() stops it
    launcher.close()
    assert child.process.poll() is not None and list(tmp_path.iterdir()) == []


def test_sigterm_as_interrupt_installs_and_restores_both_handlers() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with sigterm_as_interrupt() as stop:
        assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGINT) == stop.handle
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
