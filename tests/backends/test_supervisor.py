"""backends.supervisor with real processes: spawn failures, exits, signals, stop, output, no orphans."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from simprocs import SIM_START_TIMEOUT_S, sim_argv

from backends import supervisor
from backends.supervisor import EXIT_LINES, MAX_LINE_CHARS, ExitInfo, Supervisor, group_alive
from tools import procs

pytestmark = pytest.mark.anyio
WITHIN_S = 20.0
UVLOOP = pytest.mark.parametrize(
    "anyio_backend", [("asyncio", {}), ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"]
)


class Recorder:
    """Collects starts and exits; ``exit(n)`` waits (with a deadline) for the n-th exit."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.exits: list[ExitInfo] = []
        self._changed = asyncio.Event()

    def started(self, pid: int) -> None:
        self.starts.append(pid)

    def exited(self, info: ExitInfo) -> None:
        self.exits.append(info)
        self._changed.set()

    async def exit(self, n: int = 1) -> ExitInfo:
        async with asyncio.timeout(WITHIN_S):
            while len(self.exits) < n:
                self._changed.clear()
                await self._changed.wait()
        return self.exits[n - 1]


@pytest.fixture
async def supervise() -> AsyncIterator[Callable[..., tuple[Supervisor, Recorder]]]:
    made: list[Supervisor] = []

    def make(command: Any, **kw: Any) -> tuple[Supervisor, Recorder]:
        rec = Recorder()
        sup = Supervisor("test", command, on_start=rec.started, on_exit=rec.exited, **kw)
        made.append(sup)
        return sup, rec

    yield make
    for sup in made:
        await sup.stop()


def live_members(pgid: int) -> list[int]:
    """Processes of group ``pgid`` that are not zombies, read from /proc independently of the module."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
            if int(pgrp) == pgid and state != "Z":
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


# -- bad commands --------------------------------------------------------------------------------------


async def test_a_command_that_does_not_exist_is_one_exit_with_a_clear_cause(supervise: Any) -> None:
    sup, rec = supervise(["/nonexistent/engine-binary", "--port", "1"])
    await sup.start()  # does not raise
    info = await rec.exit()
    assert info == ExitInfo(
        "could not be started: [Errno 2] No such file or directory: '/nonexistent/engine-binary'",
        None,
        None,
        info.at,
        (),
        requested=False,
        spawn_failed=True,
    )
    assert (sup.running, rec.starts, len(rec.exits)) == (False, [], 1)
    assert sup.lines()[-1] == f"[warmroute] {info.cause}"


async def test_a_bad_cwd_is_a_spawn_failure(supervise: Any, tmp_path: Path) -> None:
    sup, rec = supervise(["true"], cwd=tmp_path / "missing")
    await sup.start()
    info = await rec.exit()
    assert info.spawn_failed and info.cause.startswith(
        "could not be started: [Errno 2] No such file or directory"
    )


async def test_a_shell_command_that_does_not_exist_exits_127_saying_so(supervise: Any) -> None:
    sup, rec = supervise("nonexistent-engine-xyz --port 1")
    await sup.start()
    info = await rec.exit()
    assert (info.code, info.signal, info.spawn_failed, info.requested) == (127, None, False, False)
    assert len(info.lines) == 1 and "nonexistent-engine-xyz" in info.lines[0] and "not found" in info.lines[0]


@UVLOOP
async def test_exit_code_and_last_lines(supervise: Any) -> None:
    sup, rec = supervise("echo loading; echo boom >&2; exit 3")
    await sup.start()
    info = await rec.exit()
    assert (info.cause, info.code, info.signal, info.lines, info.requested) == (
        "exited with code 3",
        3,
        None,
        ("loading", "boom"),  # stderr merged into stdout
        False,
    )
    assert info.pid == rec.starts[0]
    assert await sup.wait() == info
    assert sup.lines()[-3:] == ("loading", "boom", f"[warmroute] pid {info.pid} exited with code 3")


# -- a real engine ----------------------------------------------------------------------------------------


async def test_a_simulator_started_through_it_answers_health_and_stops_cleanly(supervise: Any) -> None:
    port = procs.free_port()
    sup, rec = supervise(sim_argv(port))
    await sup.start()
    url = f"http://{procs.LOCALHOST}:{port}/health"
    await asyncio.to_thread(procs.wait_http, url, procs.ok, timeout_s=SIM_START_TIMEOUT_S)
    async with httpx.AsyncClient() as client:
        assert (await client.get(url)).status_code == 200
    pgid = sup.pid
    assert pgid is not None and os.getpgid(pgid) == pgid  # a group of its own
    await sup.stop()
    info = await rec.exit()
    assert info.requested is True and not sup.running
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


@UVLOOP
async def test_sigkill_from_outside_is_an_exit_by_signal_9(supervise: Any) -> None:
    sup, rec = supervise(["sleep", "300"])
    await sup.start()
    os.kill(rec.starts[0], signal.SIGKILL)
    info = await rec.exit()
    assert (info.cause, info.code, info.signal, info.requested) == (
        "was killed by signal 9 (SIGKILL)",
        None,
        9,
        False,
    )


# -- stopping ---------------------------------------------------------------------------------------------


async def test_stop_ends_the_whole_group_children_included(supervise: Any) -> None:
    sup, rec = supervise("sleep 300 & sleep 301 & echo forked; wait")
    await sup.start()
    pgid = rec.starts[0]
    async with asyncio.timeout(WITHIN_S):
        while len(live_members(pgid)) < 3:  # noqa: ASYNC110 - the shell forks when it gets to it
            await asyncio.sleep(0.01)
    await sup.stop()
    info = await rec.exit()
    assert (info.requested, info.signal) == (True, signal.SIGTERM)
    assert live_members(pgid) == [] and not group_alive(pgid)


async def test_children_a_crashed_leader_left_behind_are_ended(supervise: Any) -> None:
    sup, rec = supervise("sleep 300 & echo forked; exit 5")
    await sup.start()
    info = await rec.exit()
    assert (info.code, info.lines) == (5, ("forked",))
    assert live_members(rec.starts[0]) == []  # the orphaned sleep went with it


async def test_stop_of_an_argv_child_leaves_no_process_in_its_group(supervise: Any) -> None:
    sup, rec = supervise(["sleep", "300"])
    await sup.start()
    pgid = rec.starts[0]
    await sup.stop()
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)
    assert (await rec.exit()).signal == signal.SIGTERM


async def test_a_child_that_ignores_sigterm_gets_sigkill_after_the_stop_timeout(supervise: Any) -> None:
    sup, rec = supervise("trap '' TERM; echo ready; sleep 300 & wait", stop_timeout_s=0.3)
    await sup.start()
    pgid = rec.starts[0]
    async with asyncio.timeout(WITHIN_S):
        while "ready" not in sup.lines():  # noqa: ASYNC110 - the trap must be set before we signal
            await asyncio.sleep(0.01)
    await sup.stop()
    info = await rec.exit()
    assert (info.signal, info.requested) == (signal.SIGKILL, True)
    assert f"[warmroute] pid {pgid} still running 0.3 s after the stop: SIGKILL" in sup.lines()
    assert live_members(pgid) == []


async def test_the_stop_command_is_used_when_configured(supervise: Any, tmp_path: Path) -> None:
    sup, rec = supervise(
        "echo $$ > engine.pid; exec sleep 300",
        stop_command="echo stopping; kill -INT $(cat engine.pid)",
        cwd=tmp_path,
    )
    await sup.start()
    async with asyncio.timeout(WITHIN_S):
        while not (tmp_path / "engine.pid").exists() or not (tmp_path / "engine.pid").read_text():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    await sup.stop()
    info = await rec.exit()
    assert (info.signal, info.requested) == (signal.SIGINT, True)  # what the stop command sent, not SIGTERM
    lines = sup.lines()
    assert lines.index("[warmroute] stop command: echo stopping; kill -INT $(cat engine.pid)") < lines.index(
        "stopping"
    )
    assert "[warmroute] stop command exited with code 0" in lines
    assert info.lines == ()  # the stop command's output is not the engine's


async def test_an_ignored_sigint_of_the_gateway_is_not_the_engines(supervise: Any, tmp_path: Path) -> None:
    """A gateway started in the background without job control has SIGINT ignored; its engine must not
    inherit that, or a stop command's ``kill -INT`` does nothing (and the stop ends in SIGKILL)."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sup, rec = supervise(
            "echo $$ > engine.pid; exec sleep 300", stop_command="kill -INT $(cat engine.pid)", cwd=tmp_path
        )
        await sup.start()
    finally:
        signal.signal(signal.SIGINT, before)
    async with asyncio.timeout(WITHIN_S):
        while not (tmp_path / "engine.pid").exists() or not (tmp_path / "engine.pid").read_text():  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    await sup.stop()
    assert ((await rec.exit()).signal, sup.lines().count("[warmroute] stop command exited with code 0")) == (
        signal.SIGINT,
        1,
    )


async def test_stop_without_a_process_runs_the_stop_command_of_a_detached_engine(
    supervise: Any, tmp_path: Path
) -> None:
    sup, rec = supervise("true", stop_command=["touch", str(tmp_path / "stopped")])
    await sup.stop()
    assert (tmp_path / "stopped").exists() and rec.exits == []
    plain, _ = supervise("true")
    await plain.stop()  # nothing to do, nothing raised


async def test_restart_stops_then_starts_a_new_process(supervise: Any) -> None:
    sup, rec = supervise(["sleep", "300"])
    await sup.start()
    await sup.restart()
    first = await rec.exit()
    assert first.requested is True and first.pid == rec.starts[0]
    assert len(rec.starts) == 2 and rec.starts[1] != rec.starts[0] and sup.pid == rec.starts[1]
    os.kill(rec.starts[1], signal.SIGKILL)
    assert (await rec.exit(2)).requested is False  # the new process's own exit is not "requested"


async def test_an_exit_a_restart_finds_already_seen_keeps_its_own_cause(
    supervise: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The process dies by itself; before its exit is told (its group still being ended), a restart's stop
    comes (a failed health probe started it): the exit is the process's own, not a requested one, and marked
    as found by a stop (no outage of its own: the restart answers it)."""
    exit_seen, release = asyncio.Event(), asyncio.Event()
    end_group = supervisor._end_group

    async def held_end_group(pgid: int) -> None:
        exit_seen.set()  # the leader's exit is known here, and not told before ``release``
        await release.wait()
        await end_group(pgid)

    monkeypatch.setattr(supervisor, "_end_group", held_end_group)
    sup, rec = supervise(["sleep", "300"])
    await sup.start()
    os.kill(rec.starts[0], signal.SIGKILL)
    async with asyncio.timeout(WITHIN_S):
        await exit_seen.wait()
    restart = asyncio.create_task(sup.restart())
    await asyncio.sleep(0)  # one turn of the loop: the restart runs up to its wait for the exit, no further
    assert rec.exits == [] and len(rec.starts) == 1
    release.set()
    async with asyncio.timeout(WITHIN_S):
        await restart
    (info,) = rec.exits
    assert (info.cause, info.requested, info.stopping) == ("was killed by signal 9 (SIGKILL)", False, True)
    assert len(rec.starts) == 2 and sup.pid == rec.starts[1]
    await sup.stop()
    assert (await rec.exit(2)).requested is True  # a stop of a running process is still asked for


# -- output ---------------------------------------------------------------------------------------------


async def test_output_is_a_bounded_ring_and_exit_lines_are_the_last_ones(supervise: Any) -> None:
    script = "import sys\nfor i in range(500): print(i)\nprint('x' * 100000)\nsys.exit(1)"
    sup, rec = supervise([sys.executable, "-c", script], log_lines=50)
    await sup.start()
    info = await rec.exit()
    assert info.lines == (*(str(i) for i in range(481, 500)), "x" * MAX_LINE_CHARS)
    assert len(info.lines) == EXIT_LINES
    assert len(sup.lines()) == 50 and sup.lines()[-1] == f"[warmroute] pid {info.pid} exited with code 1"


async def test_env_is_added_and_cwd_is_used(supervise: Any, tmp_path: Path) -> None:
    sup, rec = supervise('echo "$ENGINE_FLAG $HOME"; pwd', env={"ENGINE_FLAG": "on"}, cwd=tmp_path)
    await sup.start()
    info = await rec.exit()
    assert info.lines == (f"on {os.environ['HOME']}", str(tmp_path))  # the gateway's environment, plus env


async def test_output_goes_to_the_logger_at_debug(supervise: Any, caplog: pytest.LogCaptureFixture) -> None:
    sup, rec = supervise("echo hello-engine")
    with caplog.at_level(logging.DEBUG, logger="warmroute.supervisor"):
        await sup.start()
        await rec.exit()
    assert ("warmroute.supervisor", logging.DEBUG, "test| hello-engine") in caplog.record_tuples


async def test_a_failing_exit_listener_is_logged_and_the_exit_still_recorded(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(info: ExitInfo) -> None:
        raise RuntimeError("listener bug")

    sup = Supervisor("test", "exit 4", on_exit=broken)
    await sup.start()
    info = await sup.wait()
    assert info is not None and info.code == 4 and sup.last_exit == info
    assert "engine test: on_exit callback failed" in caplog.messages


# -- the gateway dying -----------------------------------------------------------------------------------

_PARENT = textwrap.dedent(
    """
    import asyncio
    from backends.supervisor import Supervisor

    async def main():
        sup = Supervisor("orphan-test", ["sleep", "300"])
        await sup.start()
        print(sup.pid, flush=True)
        await asyncio.sleep(300)

    asyncio.run(main())
    """
)


def test_a_sigkilled_gateway_leaves_no_engine_behind() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, cwd=Path.cwd())
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()  # SIGKILL: no cleanup code runs in the parent
        parent.wait()
        deadline = time.monotonic() + WITHIN_S
        while alive(child) and time.monotonic() < deadline:  # PR_SET_PDEATHSIG sends SIGTERM; no event
            time.sleep(0.01)
        assert not alive(child)
    finally:
        parent.kill()
        parent.wait()
