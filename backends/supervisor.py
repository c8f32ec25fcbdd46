"""Child process supervisor for one managed engine: start it, keep its last output lines, report its exit,
stop it. It decides nothing: whether and when to restart is ``backends.lifecycle``'s call.

- The command is an argv list, or a string run by ``/bin/sh -c``. The child gets a session (and process
  group) of its own, so ``stop`` reaches everything it started and a Ctrl-C in the terminal does not.
- stdout and stderr are merged into a ring buffer of the last ``log_lines`` lines (also logged at DEBUG).
- Every exit reaches ``on_exit`` once, as an ``ExitInfo``: code or signal, time, the last lines it printed,
  and whether the gateway asked for it. A command that cannot be spawned at all (no such file, not
  executable, bad cwd) is reported the same way, with ``spawn_failed``, instead of raising.
- ``stop``: the stop command if one is configured, else SIGTERM to the group; SIGKILL to the group after
  ``stop_timeout_s``. When the leader exits, by itself or not, whatever it left in its group is ended too
  (SIGTERM, then SIGKILL): no orphan keeps a GPU. On Linux the child also asks the kernel for SIGTERM when
  the gateway dies (``PR_SET_PDEATHSIG``), so even a SIGKILL of the gateway leaves no engine behind — for
  the direct child only: a shell that forks (rather than execs) its last command shields it from that.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

Command = str | Sequence[str]

EXIT_LINES = 20  # of the process's own output, carried by its ExitInfo
MAX_LINE_CHARS = 4000
_LEFTOVER_GRACE_S = 2.0  # per signal, for what a dead leader left in its group
_DRAIN_S = 1.0  # for the last output after the group is gone
_POLL_S = 0.02
_PR_SET_PDEATHSIG = 1

log = logging.getLogger("warmroute.supervisor")


@dataclass(frozen=True, slots=True)
class ExitInfo:
    cause: str  # "exited with code 3", "was killed by signal 9 (SIGKILL)", "could not be started: ..."
    code: int | None
    signal: int | None
    at: float  # wall-clock time.time()
    lines: tuple[str, ...]  # the last lines this process printed
    requested: bool  # the gateway asked it to stop
    spawn_failed: bool = False
    pid: int | None = None
    #: A stop was under way when it was told (asked for, or it found the process gone already): the gateway
    #: was replacing or ending it, so this exit is no outage of its own.
    stopping: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "lines": list(self.lines)}


def describe_exit(returncode: int) -> tuple[str, int | None, int | None]:
    """(cause, code, signal) from a Popen-style return code (negative: killed by that signal)."""
    if returncode >= 0:
        return f"exited with code {returncode}", returncode, None
    number = -returncode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = "unknown"
    return f"was killed by signal {number} ({name})", None, number


class Supervisor:
    """One engine process at a time. ``start``/``stop``/``restart`` are serialised; none raises for
    anything the child does."""

    def __init__(
        self,
        name: str,
        command: Command,
        *,
        stop_command: Command | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
        stop_timeout_s: float = 30.0,
        log_lines: int = 200,
        on_start: Callable[[int], None] | None = None,
        on_exit: Callable[[ExitInfo], None] | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.name = name
        self.command = command
        self.stop_command = stop_command
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.stop_timeout_s = stop_timeout_s
        self.on_start = on_start
        self.on_exit = on_exit
        self.log = logger or log
        self.last_exit: ExitInfo | None = None
        self._lines: deque[str] = deque(maxlen=log_lines)  # everything, with our own [warmroute] notes
        self._own: deque[str] = deque(maxlen=EXIT_LINES)  # the current process's output only
        self._proc: asyncio.SubprocessTransport | None = None
        self._watch: asyncio.Task[ExitInfo] | None = None
        self._stopping = False  # a stop is under way
        self._asked = False  # and it was sent while the process still ran
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.get_pid()

    @property
    def running(self) -> bool:
        return self._proc is not None

    def lines(self) -> tuple[str, ...]:
        """The last ``log_lines`` output lines, across restarts, with start/exit notes between them."""
        return tuple(self._lines)

    def output(self) -> tuple[str, ...]:
        """The last ``EXIT_LINES`` lines the current (or last) process printed itself."""
        return tuple(self._own)

    async def start(self) -> None:
        """Start the command unless it runs already; returns once spawned (or once its failure is told)."""
        async with self._lock:
            await self._start()

    async def stop(self) -> None:
        """Stop it and wait for its exit (``on_exit`` has run when this returns)."""
        async with self._lock:
            await self._stop()

    async def restart(self) -> None:
        async with self._lock:
            await self._stop()
            await self._start()

    async def wait(self) -> ExitInfo | None:
        """The exit of the process started last (waits while it runs); None if none was ever started."""
        return None if self._watch is None else await asyncio.shield(self._watch)

    # -- internals ----------------------------------------------------------------------------------------

    async def _start(self) -> None:
        if self._proc is not None:
            return
        self._stopping = self._asked = False
        self._own.clear()
        self._note(f"starting: {_display(self.command)}")
        try:
            proc, pipe = await _spawn(self.command, self.env, self.cwd, self._own_line)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            cause = f"could not be started: {exc}"
            self._note(cause)
            self._exited(ExitInfo(cause, None, None, time.time(), (), requested=False, spawn_failed=True))
            return
        self._proc, pid = proc, proc.get_pid()
        self._note(f"started pid {pid}")
        self._watch = asyncio.create_task(
            self._watch_process(proc, pipe), name=f"warmroute-supervise-{self.name}"
        )
        if self.on_start is not None:
            self.on_start(pid)

    async def _stop(self) -> None:
        proc, watch = self._proc, self._watch
        if proc is None or watch is None:
            if self.stop_command is not None:  # a detached engine runs without a process of ours
                await self._run_stop_command()
            return
        self._stopping, pid = True, proc.get_pid()
        # Asked for only if it still ran: an exit already seen but not yet told (its group being ended, its
        # last output drained) keeps its own cause. A failed health probe can start a restart in that moment.
        self._asked = proc.get_returncode() is None
        if self.stop_command is not None:
            await self._run_stop_command()
        else:
            _signal_group(pid, signal.SIGTERM)
        try:
            async with asyncio.timeout(self.stop_timeout_s):
                await asyncio.shield(watch)
        except TimeoutError:
            self._note(f"pid {pid} still running {self.stop_timeout_s:g} s after the stop: SIGKILL")
            _signal_group(pid, signal.SIGKILL)
            await asyncio.shield(watch)

    async def _watch_process(self, proc: asyncio.SubprocessTransport, pipe: _Pipe) -> ExitInfo:
        pid = proc.get_pid()
        await pipe.exited
        returncode = proc.get_returncode()
        await _end_group(pid)  # the leader is gone: what it left behind goes too (and the pipe closes)
        await pipe.drained(_DRAIN_S)
        proc.close()
        cause, code, number = describe_exit(returncode if returncode is not None else -signal.SIGKILL)
        info = ExitInfo(
            cause, code, number, time.time(), tuple(self._own), self._asked, pid=pid, stopping=self._stopping
        )
        self._note(f"pid {pid} {cause}")
        self._proc = None
        self._exited(info)
        return info

    async def _run_stop_command(self) -> None:
        assert self.stop_command is not None
        self._note(f"stop command: {_display(self.stop_command)}")
        try:
            proc, pipe = await _spawn(self.stop_command, self.env, self.cwd, self._line)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            self._note(f"stop command could not be started: {exc}")
            return
        try:
            async with asyncio.timeout(self.stop_timeout_s):
                await pipe.exited
        except TimeoutError:
            self._note(f"stop command still running after {self.stop_timeout_s:g} s: SIGKILL")
            _signal_group(proc.get_pid(), signal.SIGKILL)
            await pipe.exited
        await _end_group(proc.get_pid())
        await pipe.drained(_DRAIN_S)
        proc.close()
        returncode = proc.get_returncode()
        self._note(
            f"stop command {describe_exit(returncode if returncode is not None else -signal.SIGKILL)[0]}"
        )

    def _line(self, text: str) -> None:
        self._lines.append(text)
        self.log.debug("%s| %s", self.name, text)

    def _own_line(self, text: str) -> None:
        self._line(text)
        self._own.append(text)

    def _note(self, text: str) -> None:
        self._lines.append(f"[warmroute] {text}")
        self.log.info("engine %s: %s", self.name, text)

    def _exited(self, info: ExitInfo) -> None:
        self.last_exit = info
        if self.on_exit is None:
            return
        try:
            self.on_exit(info)
        except Exception:  # a bug in the listener must not leave the exit unrecorded here
            self.log.exception("engine %s: on_exit callback failed", self.name)


class _Lines:
    """Bytes in, lines out. A line over ``MAX_LINE_CHARS`` keeps its head; the rest up to its newline is
    dropped, so one endless line cannot grow a buffer."""

    def __init__(self, sink: Callable[[str], None]) -> None:
        self._sink = sink
        self._pending = b""
        self._overlong = False

    def feed(self, data: bytes) -> None:
        *complete, self._pending = (self._pending + data).split(b"\n")
        for raw in complete:
            if not self._overlong:
                self._emit(raw)
            self._overlong = False
        if self._overlong:
            self._pending = b""
        elif len(self._pending) > MAX_LINE_CHARS:
            self._emit(self._pending)
            self._pending, self._overlong = b"", True

    def flush(self) -> None:
        if self._pending and not self._overlong:
            self._emit(self._pending)
        self._pending = b""

    def _emit(self, raw: bytes) -> None:
        self._sink(raw.decode(errors="replace").rstrip("\r")[:MAX_LINE_CHARS])


class _Pipe(asyncio.SubprocessProtocol):
    """The child's merged output, and its exit. ``process_exited`` fires when the process ends, even while
    something it left behind holds the pipe open (Python 3.11's ``Process.wait()`` would wait for that)."""

    def __init__(self, sink: Callable[[str], None]) -> None:
        loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[None] = loop.create_future()
        self._closed: asyncio.Future[None] = loop.create_future()
        self._lines = _Lines(sink)

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        self._lines.feed(data)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lines.flush()
        if not self._closed.done():
            self._closed.set_result(None)

    async def drained(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the last output (a reparented grandchild may hold the pipe)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(self._closed)
        self._lines.flush()


async def _spawn(
    command: Command, env: Mapping[str, str], cwd: str | Path | None, sink: Callable[[str], None]
) -> tuple[asyncio.SubprocessTransport, _Pipe]:
    argv = ["/bin/sh", "-c", command] if isinstance(command, str) else list(command)
    return await asyncio.get_running_loop().subprocess_exec(
        lambda: _Pipe(sink),
        *argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(env),
        cwd=cwd,
        start_new_session=True,
        preexec_fn=_in_child,
    )


async def _end_group(pgid: int) -> None:
    """SIGTERM, then SIGKILL, to whatever still lives in process group ``pgid``; bounded in time."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not group_alive(pgid):
            return
        _signal_group(pgid, sig)
        deadline = loop.time() + _LEFTOVER_GRACE_S
        while group_alive(pgid) and loop.time() < deadline:  # noqa: ASYNC110 - the kernel offers no event
            await asyncio.sleep(_POLL_S)


def group_alive(pgid: int) -> bool:
    """Does a live (not zombie) process remain in group ``pgid``? On Linux this reads /proc, because an
    orphan whose new parent never reaps it (pid 1 in some containers) stays a zombie in the group and
    ``killpg(pgid, 0)`` would go on finding it."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # it ended while we looked
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid pgrp ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pgid, sig)


def _display(command: Command) -> str:
    return command if isinstance(command, str) else subprocess.list2cmdline(list(command))


def _in_child() -> None:
    """Runs in the child between fork and exec: SIGINT and SIGQUIT at their defaults, and on Linux SIGTERM
    asked of the kernel for when the parent dies.

    A gateway started in the background by a shell without job control (``warmroute ... &`` in a script,
    nohup) has SIGINT and SIGQUIT ignored, and an ignored signal survives exec: its engines would shrug off a
    stop command's ``kill -INT`` (and Python engines never install their handler for it). Through libc, not
    ``signal.signal``: this may run in a fork of a thread that is not the interpreter's main one."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p  # sighandler_t; 0 is SIG_DFL
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal(signal.SIGINT, 0)
        libc.signal(signal.SIGQUIT, 0)
        if sys.platform == "linux":  # a copy of tools/procs.py's (the product may not import tools)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
