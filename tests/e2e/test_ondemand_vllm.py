"""On-demand real vLLM engines: the first request through the gateway starts one, a request for the other
model of its exclusive group swaps them (the timeline is printed), and an idle TTL stops the second.

Two engines that never run at once (group ``box``, ``max_running: 1``), the same tiny model served under two
names, both pinned to one core, eager mode: two starts of ~35-90 s each.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from backends.lifecycle import Lifecycle
from backends.ondemand import Phase
from backends.supervisor import group_alive
from config.settings import load_settings
from gateway.app import Gateway, create_app
from routing.types import BackendState
from tools.procs import free_port

from .engines import HEALTH_TIMEOUT_S, EngineConfig, VllmEngine, cpu_sets
from .gateways import MODEL, NO_THINKING
from upstreams import serve  # tests/ is on sys.path: pytest puts it there for the tests/e2e package

S = BackendState
OTHER = "tiny-chat-b"
IDLE_TTL_S = 10.0


class States:
    """Each state every controller reports, with its time (appended on the gateway's thread)."""

    def __init__(self, gw: Gateway) -> None:
        self.seen: list[tuple[str, BackendState, float]] = []
        for bid, ctl in gw.fleet.controllers.items():
            ctl.on_change = self._wrap(bid, ctl.on_change)

    def _wrap(self, bid: str, inner: Callable[[Lifecycle], None] | None) -> Callable[[Lifecycle], None]:
        def on_change(lc: Lifecycle) -> None:
            if inner is not None:
                inner(lc)
            self.seen.append((bid, lc.state, time.monotonic()))

        return on_change

    def last(self, bid: str, state: BackendState) -> float:
        return [t for b, s, t in self.seen if b == bid and s is state][-1]


def wait(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s:.0f}s"
        time.sleep(0.05)


def on_demand_backend(bid: str, engine: VllmEngine) -> dict[str, Any]:
    env = {k: v for k, v in engine.environment().items() if os.environ.get(k) != v}  # ours, not inherited
    managed = {
        "command": engine.command(),
        "env": env,
        "start_timeout_s": HEALTH_TIMEOUT_S,
        "stop_timeout_s": 15,
        "on_demand": True,
        "idle_ttl_s": IDLE_TTL_S,
        "group": "box",
    }
    models = [engine.config.served_model_name]
    return {"id": bid, "url": engine.base_url, "models": models, "dialect": "vllm", "managed": managed}


def exited_at(gw: Gateway, bid: str) -> float:
    wall = gw.fleet.controllers[bid].status()["managed"]["exits"][-1]["at"]
    return float(wall) - time.time() + time.monotonic()


def test_on_demand_vllm_starts_on_the_first_request_swaps_and_stops_after_its_idle_ttl(
    engine_config: EngineConfig, engine_log_dir: Path
) -> None:
    cpus = cpu_sets(1)[0]
    a = VllmEngine(
        engine_config, name="od-a", port=free_port(), cpus=cpus, log_path=engine_log_dir / "od-a.log"
    )
    other_config = dataclasses.replace(engine_config, served_model_name=OTHER)
    b = VllmEngine(
        other_config, name="od-b", port=free_port(), cpus=cpus, log_path=engine_log_dir / "od-b.log"
    )
    settings = load_settings(
        None,
        backends=[on_demand_backend("a", a), on_demand_backend("b", b)],
        groups={"box": {"max_running": 1}},
        health={"interval_s": 0.25, "timeout_s": 5, "fail_threshold": 1},
        on_demand={"keepalive_s": 5},
    )
    app = create_app(settings)
    gw: Gateway = app.state.gateway
    demand = gw.fleet.demand
    assert demand is not None
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, **NO_THINKING}
    with serve(app) as (url, _server):
        states = States(gw)
        assert gw.fleet.controllers["a"].status()["managed"]["running"] is False  # nothing at start-up
        models = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
        assert models == [MODEL, OTHER]

        # 1. The first request starts a, waits for its canary, and is answered.
        t0 = time.monotonic()
        r = httpx.post(
            url + "/v1/chat/completions", json={"model": MODEL, **chat}, timeout=HEALTH_TIMEOUT_S + 60
        )
        assert (r.status_code, r.headers["x-warmroute-backend"]) == (200, "a"), r.text
        first = time.monotonic() - t0

        # 2. A stream for the other model swaps a out (it is idle) and b in; keep-alives while it waits.
        arrival = time.monotonic()
        comments = 0
        with httpx.stream(
            "POST",
            url + "/v1/chat/completions",
            json={"model": OTHER, **chat, "stream": True},
            timeout=HEALTH_TIMEOUT_S + 60,
        ) as stream:
            assert stream.status_code == 200
            lines: list[str] = []
            first_token = None
            for line in stream.iter_lines():
                lines.append(line)
                comments += line.startswith(": waiting for b to start")
                if first_token is None and line.startswith("data: {"):
                    first_token = time.monotonic()
        assert first_token is not None and comments >= 1
        assert [x for x in lines if x][-1] == "data: [DONE]" and not any(
            x.startswith("event: error") for x in lines
        )
        a_told, a_exited = states.last("a", S.DOWN), exited_at(gw, "a")
        b_ready = states.last("b", S.READY)
        assert arrival <= a_told <= a_exited <= b_ready <= first_token
        print(
            f"\n[e2e] on-demand vLLM: first request answered after {first:.1f}s (start + canary); swap "
            f"timeline from the request's arrival: a told to stop +{a_told - arrival:.2f}s, a exited "
            f"+{a_exited - arrival:.2f}s, b ready +{b_ready - arrival:.2f}s, first token "
            f"+{first_token - arrival:.2f}s ({comments} keep-alive comments)",
            file=sys.stderr,
        )

        # 3. b's idle TTL stops it: stop requested, process group gone, status says why.
        idle_from = time.monotonic()
        wait(lambda: demand.schedule.engines["b"].phase is Phase.STOPPED, IDLE_TTL_S + 60, "b stopped")
        status = gw.fleet.controllers["b"].status()
        assert status["state"] == "down" and status["reason"].startswith("stopped: idle for ")
        assert status["managed"]["running"] is False and status["managed"]["exits"][-1]["requested"] is True
        assert states.last("b", S.DOWN) - idle_from >= IDLE_TTL_S - 1.0
        print(
            f"[e2e] on-demand vLLM: b stopped {states.last('b', S.DOWN) - idle_from:.1f}s after its last "
            f"request (idle_ttl_s {IDLE_TTL_S:g}), exited {exited_at(gw, 'b') - idle_from:.1f}s after",
            file=sys.stderr,
        )
        for bid in ("a", "b"):
            pid = gw.fleet.controllers[bid].status()["managed"]["exits"][-1]["pid"]
            assert not group_alive(pid), f"{bid}'s engine outlived its stop"  # zombies excluded
