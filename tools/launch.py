"""Child processes for ``warmroute demo`` and ``warmroute bench``: simulated engines and gateways, local.

Children run in a session of their own, so a Ctrl-C in the terminal reaches only this process, which then
stops them in order (gateways first, then engines). On Linux each child also receives SIGTERM if this
process dies without cleaning up (``PR_SET_PDEATHSIG``), so even a SIGKILL here leaves no orphans.
Child output goes to log files in a temporary folder; a child that fails to start is reported with the tail
of its log.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from backends.sim import config as sim_defaults
from tools import procs
from tools.procs import LOCALHOST, free_port

START_TIMEOUT_S = 45.0  # generous: several Python processes import at once on a busy 2-core machine
STOP_TIMEOUT_S = 5.0


class LaunchError(RuntimeError):
    """A child did not start or did not become ready; the message carries its log tail."""


@dataclass(frozen=True, slots=True)
class SimProfile:
    """Speeds and shape of the simulated engines (see ``warmroute sim --help``)."""

    prefill_tps: float = sim_defaults.DEFAULT_PREFILL_TPS
    ttft_base_ms: float = sim_defaults.DEFAULT_TTFT_BASE_MS
    decode_tps: float = 60.0  # a little faster than the sim's default, so bench runs finish sooner
    decode_slowdown: float = sim_defaults.DEFAULT_DECODE_SLOWDOWN
    answer_tokens: tuple[int, int] = (16, 64)
    max_running: int = sim_defaults.DEFAULT_MAX_RUNNING
    cache_tokens: int = sim_defaults.DEFAULT_CACHE_TOKENS
    time_scale: float = 1.0
    seed: int = 0
    #: Each engine publishes KV cache events on a port of its own and the gateway subscribes (``kv_events``).
    kv_events: bool = False

    def argv(self) -> list[str]:
        low, high = self.answer_tokens
        return [
            *("--prefill-tps", str(self.prefill_tps), "--ttft-base-ms", str(self.ttft_base_ms)),
            *("--decode-tps", str(self.decode_tps), "--decode-slowdown", str(self.decode_slowdown)),
            *("--answer-tokens", f"{low}:{high}", "--max-running", str(self.max_running)),
            *("--cache-tokens", str(self.cache_tokens), "--time-scale", str(self.time_scale)),
            *("--seed", str(self.seed)),
        ]


@dataclass(frozen=True, slots=True)
class Engine:
    """An OpenAI-compatible engine as the gateway config names it."""

    id: str
    url: str
    kv_endpoint: str | None = None  # its KV cache events' PUB socket, when it publishes them


@dataclass(slots=True)
class Child:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty log)"


def _child_env() -> dict[str, str]:
    # WARMROUTE_* variables would override the generated config file (the environment wins): drop them.
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMROUTE_")}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Launcher:
    """Owns every child it starts; ``close`` (or leaving the ``with`` block) stops them all."""

    def __init__(self, prefix: str = "warmroute-", stop: StopRequest | None = None) -> None:
        self.children: list[Child] = []
        self.stop_request = stop  # signals wait while a child is forked (``StopRequest.deferred``)
        self.workdir = Path(tempfile.mkdtemp(prefix=prefix))

    def __enter__(self) -> Launcher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- starting ---------------------------------------------------------------------------------------

    def start_sims(self, count: int, profile: SimProfile, model: str) -> list[Engine]:
        """``count`` simulated engines named engine-1..N; returns once every one answers /health."""
        started, kv = [], []
        for index in range(1, count + 1):
            name, port = f"engine-{index}", free_port()
            argv = procs.python("-m", "backends.sim", "--port", str(port), "--name", name, "--model", model)
            argv += [*profile.argv(), "--log-level", "warning"]
            endpoint = f"tcp://{LOCALHOST}:{free_port()}" if profile.kv_events else None
            if endpoint is not None:
                argv += ["--kv-events-endpoint", endpoint]
            kv.append(endpoint)
            started.append(self._spawn(name, port, argv))
        for child in started:
            self._wait(child, "/health", procs.ok)
        return [Engine(c.name, c.url, endpoint) for c, endpoint in zip(started, kv, strict=True)]

    def start_gateway(
        self,
        engines: Sequence[Engine],
        model: str,
        policy: str,
        *,
        port: int = 0,
        routing: dict[str, Any] | None = None,
        api_key: str | None = None,
        name: str = "gateway",
    ) -> Child:
        """``warmroute serve`` in front of ``engines`` (in-memory state); returns once all are ready."""
        port = port or free_port()
        backends = [
            {"id": e.id, "url": e.url, "models": [model], **({"api_key": api_key} if api_key else {}),
             **({"kv_events": {"endpoint": e.kv_endpoint}} if e.kv_endpoint else {})}
            for e in engines
        ]  # fmt: skip
        config = {
            "server": {"host": LOCALHOST, "port": port, "log_level": "warning"},
            "backends": backends,
            "routing": {"policy": policy, **(routing or {})},
            "health": {"interval_s": 2, "timeout_s": 2, "fail_threshold": 2},
            "redis": {"url": None},
        }
        path = self.workdir / f"{name}.yaml"
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        child = self._spawn(name, port, procs.python("-m", "gateway.cli", "serve", "--config", str(path)))
        self._wait(child, "/readyz", _all_backends_ready)
        return child

    def _spawn(self, name: str, port: int, argv: list[str], source: Path | None = None) -> Child:
        """``source``: a checkout whose packages the child imports (run from there, first on its path)."""
        log_path = self.workdir / f"{name}.log"
        deferred = self.stop_request.deferred() if self.stop_request else contextlib.nullcontext()
        env = _child_env()
        if source is not None:
            env["PYTHONPATH"] = str(source)
        with deferred, log_path.open("wb") as log:
            process = procs.spawn(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=source,
                group=True,
                die_with_parent=True,
            )
            child = Child(name, f"http://{LOCALHOST}:{port}", process, log_path)
            self.children.append(child)  # before a deferred stop is raised: it is stopped with the rest
        return child

    def _wait(self, child: Child, path: str, ready: Callable[[httpx.Response], bool]) -> None:
        try:
            procs.wait_http(child.url + path, ready, timeout_s=START_TIMEOUT_S, process=child.process)
        except procs.NotReady as exc:
            if exc.returncode is not None:
                raise LaunchError(
                    f"{child.name} exited with code {exc.returncode}:\n{child.log_tail()}"
                ) from None
            raise LaunchError(
                f"{child.name} not ready on {child.url} after {START_TIMEOUT_S:.0f}s:\n{child.log_tail()}"
            ) from None

    # -- watching and stopping -------------------------------------------------------------------------

    def dead(self) -> Iterator[Child]:
        return (c for c in self.children if c.process.poll() is not None)

    def stop(self, child: Child) -> None:
        """SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``."""
        procs.stop(child.process, STOP_TIMEOUT_S)
        if child in self.children:
            self.children.remove(child)

    def close(self) -> None:
        # Gateways were started after the engines they front: stop in reverse order.
        for child in reversed(list(self.children)):
            self.stop(child)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _all_backends_ready(response: httpx.Response) -> bool:
    if response.status_code != 200:
        return False
    backends = response.json().get("backends", {})
    return bool(backends) and all(b.get("state") == "ready" for b in backends.values())


class StopRequest:
    """Ctrl-C and SIGTERM as one request to stop, raised as a single ``KeyboardInterrupt``.

    Only the first signal raises: later ones are noted, so the cleanup that follows (stopping children,
    removing the work folder) is never cut short. Inside ``deferred()`` the exception waits for the end of
    the block: one raised while a child is forked lands in CPython's at-fork hooks, which print it as
    "Exception ignored" and drop it. Loops call ``check()``, which raises if a stop was asked for, in case an
    exception was dropped anyway (a ``__del__``, a weakref callback).
    """

    def __init__(self) -> None:
        self.requested = False
        self._raised = False
        self._deferring = 0

    def handle(self, _signum: int, _frame: object) -> None:
        self.requested = True
        if not self._raised and not self._deferring:
            self._raised = True
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
        if self.requested and not self._raised and not self._deferring:
            self._raised = True
            raise KeyboardInterrupt

    def check(self) -> None:
        if self.requested:
            self._raised = True
            raise KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[StopRequest]:
    """Treat SIGTERM like Ctrl-C inside the block, so the same cleanup runs for both (``StopRequest``)."""
    stop = StopRequest()
    previous = {s: signal.signal(s, stop.handle) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
