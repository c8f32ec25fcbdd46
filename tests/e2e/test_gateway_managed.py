"""The gateway manages one real vLLM engine itself: starts it from config, canaries it, serves a chat
through it, restarts it after a SIGKILL (the timeline is printed), and stops it on shutdown.

One engine, its own (not the session's), pinned to one core, eager mode: ~35 s per start, two starts.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from backends.lifecycle import Lifecycle
from config.settings import load_settings
from gateway.app import Gateway, create_app
from routing.types import BackendState
from tools.procs import free_port

from .engines import HEALTH_TIMEOUT_S, EngineConfig, VllmEngine, cpu_sets
from .gateways import MODEL, NO_THINKING
from upstreams import serve  # tests/ is on sys.path: pytest puts it there for the tests/e2e package

S = BackendState


class States:
    """Each state the controller reports, with its time (appended on the gateway's thread, read here)."""

    def __init__(self, gw: Gateway, bid: str) -> None:
        self.seen: list[tuple[BackendState, float]] = []
        ctl = gw.fleet.controllers[bid]
        inner = ctl.on_change
        assert inner is not None

        def on_change(lc: Lifecycle) -> None:
            inner(lc)
            self.seen.append((gw.registry.backends[bid].state, time.monotonic()))

        ctl.on_change = on_change

    def wait(self, pred: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not pred():
            assert time.monotonic() < deadline, f"{what} not reached in {timeout_s:.0f}s: {self.seen}"
            time.sleep(0.02)

    def first(self, state: BackendState, after: float) -> float | None:
        return next((t for s, t in self.seen if s is state and t >= after), None)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_gateway_starts_canaries_serves_restarts_and_stops_a_vllm_engine(
    engine_config: EngineConfig, engine_log_dir: Path
) -> None:
    port = free_port()
    engine = VllmEngine(
        engine_config, name="managed", port=port, cpus=cpu_sets(1)[0], log_path=engine_log_dir / "managed.log"
    )
    env = {k: v for k, v in engine.environment().items() if os.environ.get(k) != v}  # ours, not inherited
    managed = {
        "command": engine.command(),  # the argv engines.py uses
        "env": env,
        "start_timeout_s": HEALTH_TIMEOUT_S,
        "stop_timeout_s": 8,
        "restart": {"grace_s": 1, "backoff_initial_s": 1, "max_restarts": 3, "window_s": 600},
    }
    backend = {
        "id": "managed",
        "url": engine.base_url,
        "models": [MODEL],
        "dialect": "vllm",
        "managed": managed,
    }
    settings = load_settings(
        None, backends=[backend], health={"interval_s": 0.25, "timeout_s": 5, "fail_threshold": 1}
    )
    app = create_app(settings)
    gw: Gateway = app.state.gateway
    started = time.monotonic()
    with serve(app) as (url, _server):
        states = States(gw, "managed")
        ctl = gw.fleet.controllers["managed"]
        states.wait(lambda: ctl.lifecycle.state is S.READY, HEALTH_TIMEOUT_S, "first READY")
        first_ready = time.monotonic() - started
        canary = ctl.status()["canary"]
        assert canary["passed"] is True, canary
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
        r = httpx.post(url + "/v1/chat/completions", json={**chat, **NO_THINKING}, timeout=60)
        assert (r.status_code, r.headers["x-warmroute-backend"]) == (200, "managed")
        pid = ctl.status()["managed"]["pid"]

        killed = time.monotonic()
        os.killpg(pid, signal.SIGKILL)  # the whole group (API server, EngineCore), as a crash would
        states.wait(lambda: states.first(S.READY, killed) is not None, HEALTH_TIMEOUT_S, "READY again")
        marks = {s: states.first(s, killed) for s in (S.DOWN, S.STARTING, S.CANARY, S.READY)}
        timeline = ", ".join(f"{s.value} +{t - killed:.2f}s" for s, t in marks.items() if t is not None)
        print(
            f"\n[e2e] managed vLLM: first READY after {first_ready:.1f}s (start + canary); "
            f"SIGKILL -> {timeline}; canary took {canary['elapsed_s']:.2f}s",
            file=sys.stderr,
        )
        detail = httpx.get(url + "/readyz").json()["backends"]["managed"]["managed"]
        assert detail["exits"][-1]["signal"] == signal.SIGKILL and detail["pid"] != pid
        new_pid = detail["pid"]
        r = httpx.post(url + "/v1/chat/completions", json={**chat, **NO_THINKING}, timeout=60)
        assert r.status_code == 200
    deadline = time.monotonic() + 30
    while _group_alive(new_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group_alive(new_pid), "the engine outlived the gateway"
