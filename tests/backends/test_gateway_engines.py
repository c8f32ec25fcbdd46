"""The lifecycle wired into the gateway, with engine simulators as real processes.

The gateway runs under uvicorn on this test's own event loop, so a test can read its controllers and send
them operator events directly; everything else goes over HTTP (/readyz, /metrics, the API) as a client's
would. Waits are on the controllers' state changes, or polls with deadlines where nothing announces one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from simprocs import SIM_START_TIMEOUT_S, SimFactory, sim_argv

from backends.events import Command, Operator
from backends.lifecycle import Lifecycle
from config.settings import load_settings
from gateway.app import Gateway
from gateway.observe import Observation
from gateway.readiness import readyz_backends
from routing.types import BackendState
from tools import procs

from clusters import served_gateway
from upstreams import PROBE_TIMEOUT_S

pytestmark = pytest.mark.anyio
S = BackendState
FAST_HEALTH = {"interval_s": 0.05, "timeout_s": PROBE_TIMEOUT_S, "fail_threshold": 2}
CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}


class Timeline:
    """Every state each controller reports, with its time; ``until`` waits for a predicate (deadline)."""

    def __init__(self, gw: Gateway) -> None:
        self.seen: list[tuple[str, BackendState, float]] = []
        self.changed = asyncio.Event()
        for bid, ctl in gw.fleet.controllers.items():
            ctl.on_change = self._wrap(bid, ctl.on_change)

    def _wrap(self, bid: str, inner: Callable[[Lifecycle], None] | None) -> Callable[[Lifecycle], None]:
        def on_change(lc: Lifecycle) -> None:
            at = time.monotonic()  # before the listeners it wraps, which may act on the change first
            if inner is not None:
                inner(lc)
            self.seen.append((bid, lc.state, at))
            self.changed.set()

        return on_change

    async def until(self, predicate: Callable[[], bool], within: float = SIM_START_TIMEOUT_S) -> None:
        async with asyncio.timeout(within):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

    def first(self, bid: str, state: BackendState, after: float) -> float:
        return next(t for b, s, t in self.seen if b == bid and s is state and t >= after)


@contextlib.asynccontextmanager
async def gateway(
    backends: list[dict[str, Any]], modules: tuple[object, ...] = (), **overrides: Any
) -> AsyncIterator[tuple[str, Gateway]]:
    overrides.setdefault("health", FAST_HEALTH)
    settings = load_settings(None, backends=backends, **overrides)
    async with served_gateway(settings, SIM_START_TIMEOUT_S, modules) as served:
        yield served


class Finished:
    """An observer after the gateway's own (its metrics among them): counts the requests finished."""

    def __init__(self) -> None:
        self.count = 0
        self.changed = asyncio.Event()

    def observe(self, obs: Observation) -> None:
        self.count += 1
        self.changed.set()

    async def until(self, n: int, within: float = SIM_START_TIMEOUT_S) -> None:
        async with asyncio.timeout(within):
            while self.count < n:
                self.changed.clear()
                await self.changed.wait()


def backend(bid: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"id": bid, "url": url, "models": ["sim-model"], **extra}


def state(gw: Gateway, bid: str) -> BackendState:
    return gw.fleet.controllers[bid].lifecycle.state


async def readyz(client: httpx.AsyncClient, url: str) -> dict[str, Any]:
    data: dict[str, Any] = (await client.get(url + "/readyz")).json()
    return data


async def faults(client: httpx.AsyncClient, sim_url: str, **patch: Any) -> None:
    (await client.post(sim_url + "/sim/faults", json=patch)).raise_for_status()


async def test_a_failed_canary_keeps_a_backend_out_and_readyz_says_what_it_answered(sims: SimFactory) -> None:
    good, bad = sims([], ["--repeat-token"])
    async with gateway([backend("good", good), backend("bad", bad)]) as (url, gw), httpx.AsyncClient() as c:
        tl = Timeline(gw)
        await tl.until(lambda: state(gw, "good") is S.READY and state(gw, "bad") is S.DOWN)
        body = await readyz(c, url)  # from 127.0.0.1: the full detail
        bad_status = body["backends"]["bad"]
        assert bad_status["state"] == "down" and bad_status["reason"].startswith(
            "canary failed: check 'consistency' answered one token repeated: 'duct duct"
        )
        assert bad_status["canary"]["check_name"] == "consistency"
        assert bad_status["canary"]["answered_text"].split()[:3] == ["duct"] * 3
        for _ in range(4):
            r = await c.post(url + "/v1/chat/completions", json=CHAT)
            assert (r.status_code, r.headers["x-warmroute-backend"]) == (200, "good")
        # Any other client sees ids, states and the short reason only.
        short = readyz_backends(gw.fleet.status(), detail=False)
        assert short == {
            "good": {"state": "ready", "reason": "canary passed"},
            "bad": {"state": "down", "reason": "canary failed"},
        }


async def test_health_loss_and_return_runs_the_canary_again(sims: SimFactory) -> None:
    (sim,) = sims([])
    async with gateway([backend("a", sim)]) as (url, gw), httpx.AsyncClient() as c:
        tl = Timeline(gw)
        await tl.until(lambda: state(gw, "a") is S.READY)
        first_canary = gw.fleet.controllers["a"].status()["canary"]["at"]
        await faults(c, sim, health_fail=True)
        await tl.until(lambda: state(gw, "a") is S.DOWN)
        r = await c.post(url + "/v1/chat/completions", json=CHAT)
        assert (r.status_code, r.json()["error"]["code"]) == (503, "no_healthy_backend")
        marked = time.monotonic()
        await faults(c, sim, health_fail=False)
        await tl.until(lambda: state(gw, "a") is S.READY)
        assert [s for b, s, t in tl.seen if t >= marked] == [S.CANARY, S.READY]
        assert gw.fleet.controllers["a"].status()["canary"]["at"] > first_canary
        assert (await c.post(url + "/v1/chat/completions", json=CHAT)).status_code == 200


async def test_the_breaker_opens_on_a_5xx_burst_and_closes_after_a_half_open_success(
    sims: SimFactory,
) -> None:
    (sim,) = sims([])
    breaker = {"failure_threshold": 3, "open_s": 0.5, "open_max_s": 1.0}
    # The only engine for its model: its 5xx answers are counted per client, and open it once two clients
    # had one (one client alone could be sending what the engine chokes on).
    keys = [{"name": "x", "key": "key-of-x"}, {"name": "y", "key": "key-of-y"}]
    auth = {"client_keys": keys}
    async with (
        gateway([backend("a", sim)], breaker=breaker, auth=auth) as (url, gw),
        httpx.AsyncClient(headers={"authorization": "Bearer key-of-x"}) as c,
    ):
        tl = Timeline(gw)
        await tl.until(lambda: state(gw, "a") is S.READY)
        ctl = gw.fleet.controllers["a"]
        await faults(c, sim, fail_next=3)
        for key in ("key-of-x", "key-of-x", "key-of-y"):
            headers = {"authorization": f"Bearer {key}"}
            r = await c.post(url + "/v1/chat/completions", json=CHAT, headers=headers)
            assert r.status_code == 500
        assert ctl.status()["circuit"] == "open" and state(gw, "a") is S.READY  # not DOWN: it answers
        r = await c.post(url + "/v1/chat/completions", json=CHAT)
        assert (r.status_code, r.json()["error"]["code"]) == (503, "no_healthy_backend")
        assert "a=ready (circuit open)" in r.json()["error"]["message"]
        await tl.until(lambda: ctl.status()["circuit"] == "half_open", within=5)
        assert (await c.post(url + "/v1/chat/completions", json=CHAT)).status_code == 200  # the trial
        assert ctl.status()["circuit"] == "closed"
        assert (await c.post(url + "/v1/chat/completions", json=CHAT)).status_code == 200


async def test_drain_finishes_in_flight_takes_no_new_conversations_and_moves_pins(sims: SimFactory) -> None:
    a, b = sims([], [])
    async with gateway([backend("a", a), backend("b", b)]) as (url, gw), httpx.AsyncClient() as c:
        tl = Timeline(gw)
        await tl.until(lambda: state(gw, "a") is S.READY and state(gw, "b") is S.READY)
        # Find a conversation pinned to a.
        for n in range(50):
            headers = {"x-session-id": f"conv-{n}"}
            r = await c.post(url + "/v1/chat/completions", json=CHAT, headers=headers)
            if r.headers["x-warmroute-backend"] == "a":
                break
        else:
            pytest.fail("no conversation was pinned to a")
        await faults(c, a, stall_s=1.0)  # the next turn on a stays in flight for a second
        in_flight = asyncio.create_task(c.post(url + "/v1/chat/completions", json=CHAT, headers=headers))
        async with asyncio.timeout(5):
            while gw.registry.backends["a"].in_flight == 0:  # noqa: ASYNC110 - nothing announces it
                await asyncio.sleep(0.01)
        gw.fleet.controllers["a"].send(Operator(Command.DRAIN))
        assert state(gw, "a") is S.DRAINING
        for n in range(6):
            fresh = await c.post(
                url + "/v1/chat/completions", json=CHAT, headers={"x-session-id": f"new-{n}"}
            )
            assert fresh.headers["x-warmroute-backend"] == "b"
        finished = await in_flight
        assert (finished.status_code, finished.headers["x-warmroute-backend"]) == (200, "a")
        moved = await c.post(url + "/v1/chat/completions", json=CHAT, headers=headers)
        assert (moved.headers["x-warmroute-backend"], moved.headers["x-warmroute-route"]) == (
            "b",
            "repin_unhealthy",
        )


def managed_sim(port: int, *args: str, **restart: Any) -> dict[str, Any]:
    restart = {"grace_s": 0.5, "backoff_initial_s": 0.1, **restart}
    return {
        "command": sim_argv(port, "--log-level", "info", *args),
        "start_timeout_s": SIM_START_TIMEOUT_S,
        "stop_timeout_s": 5,
        "restart": restart,
    }


async def test_a_sigkilled_managed_engine_is_restarted_and_readyz_shows_why(sims: SimFactory) -> None:
    port = procs.free_port()
    cfg = backend("m", f"http://127.0.0.1:{port}", managed=managed_sim(port))
    async with gateway([cfg]) as (url, gw), httpx.AsyncClient() as c:
        tl = Timeline(gw)
        await tl.until(lambda: state(gw, "m") is S.READY)
        pid = gw.fleet.controllers["m"].status()["managed"]["pid"]
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        await tl.until(lambda: state(gw, "m") is S.DOWN)
        await tl.until(lambda: any(b == "m" and s is S.READY and t > killed for b, s, t in tl.seen))
        down, starting = tl.first("m", S.DOWN, killed), tl.first("m", S.STARTING, killed)
        canary, ready = tl.first("m", S.CANARY, killed), tl.first("m", S.READY, killed)
        print(
            f"\nsim SIGKILL timeline: DOWN +{down - killed:.3f}s, restarted +{starting - killed:.3f}s, "
            f"canary +{canary - killed:.3f}s, READY +{ready - killed:.3f}s"
        )
        assert starting - killed >= 0.5  # the grace period
        managed = (await readyz(c, url))["backends"]["m"]["managed"]
        assert managed["pid"] != pid and managed["running"] is True
        (exit_,) = managed["exits"]
        assert exit_["signal"] == signal.SIGKILL and exit_["lines"]  # what it printed before dying
        assert managed["last_lines"]
        assert (await c.post(url + "/v1/chat/completions", json=CHAT)).status_code == 200


async def test_a_start_command_that_always_fails_is_capped_and_reported() -> None:
    port = procs.free_port()
    failing = {
        "command": ["sh", "-c", "echo cannot load the weights; exit 3"],
        "restart": {"grace_s": 0, "backoff_initial_s": 0.05, "max_restarts": 2, "window_s": 60},
    }
    async with gateway([backend("m", f"http://127.0.0.1:{port}", managed=failing)]) as (url, gw):
        tl = Timeline(gw)
        await tl.until(lambda: gw.fleet.controllers["m"].lifecycle.gave_up, within=20)
        async with httpx.AsyncClient() as c:
            body = await readyz(c, url)
        m = body["backends"]["m"]
        assert m["state"] == "down" and m["managed"]["gave_up"] is True
        assert m["reason"] == (
            "gave up after 2 restarts in 60 s: engine process exited with code 3; last output: "
            "cannot load the weights"
        )
        assert [e["code"] for e in m["managed"]["exits"]] == [3, 3, 3]  # the start and two restarts
        await asyncio.sleep(0.5)  # ten backoff periods: no restart loop after the give-up
        status = gw.fleet.controllers["m"].status()["managed"]
        assert (len(status["exits"]), status["running"]) == (3, False)


def stream_chat(max_tokens: int) -> dict[str, Any]:
    return {**CHAT, "stream": True, "max_tokens": max_tokens}


def counter(metrics: str, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # as Prometheus writes them
    for line in metrics.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize("action", ["record", "end"])
async def test_the_repetition_guard_trips_on_the_repeat_fault_and_not_on_normal_text(
    sims: SimFactory, action: str
) -> None:
    (sim,) = sims([])
    guard, finished = {"repeat_count": 8, "action": action}, Finished()
    async with gateway([backend("a", sim)], (finished,), guard=guard) as (url, gw), httpx.AsyncClient() as c:
        tl = Timeline(gw)
        await tl.until(lambda: state(gw, "a") is S.READY)
        normal = await c.post(url + "/v1/chat/completions", json=stream_chat(64))
        assert normal.text.endswith("data: [DONE]\n\n") and "event: error" not in normal.text
        await faults(c, sim, repeat_token=True)  # admitted already: the canary does not run again
        looping = await c.post(url + "/v1/chat/completions", json=stream_chat(64))
        # The client has the whole answer before the gateway's finish phase records it (metrics included):
        await finished.until(2)
        metrics = (await c.get(url + "/metrics")).text
        trips = "warmroute_output_guard_trips_total"
        assert counter(metrics, trips, backend="a", action=action) == 1
        finishes = "warmroute_finish_reasons_total"
        if action == "end":
            assert looping.text.count("duct") < 64
            assert looping.text.endswith("data: [DONE]\n\n")
            assert "event: error" in looping.text and "output degenerated: 'duct' repeated" in looping.text
            assert counter(metrics, finishes, backend="a", reason="length") == 0  # cut before the end
        else:
            assert looping.text.count('duct"}') == 64 and "event: error" not in looping.text
            assert counter(metrics, finishes, backend="a", reason="length") == 1
        assert counter(metrics, finishes, backend="a", reason="stop") + counter(
            metrics, finishes, backend="a", reason="length"
        ) == (1 if action == "end" else 2)
        assert finished.count == 2  # the two requests, nothing else (the canary is not a proxied request)


def test_sigterm_to_warmroute_serve_stops_its_managed_engine_and_leaves_no_child(tmp_path: Any) -> None:
    sim_port, port = procs.free_port(), procs.free_port()
    cfg = backend("m", f"http://127.0.0.1:{sim_port}", managed=managed_sim(sim_port))
    config = tmp_path / "warmroute.yaml"
    config.write_text(
        json.dumps({"backends": [cfg], "health": FAST_HEALTH, "server": {"shutdown_grace_s": 5}})
    )
    argv = procs.python("-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port))
    gateway_proc = procs.spawn(argv, stdout=None, stderr=None, group=True, die_with_parent=True)
    try:
        url = f"http://127.0.0.1:{port}"
        procs.wait_http(url + "/readyz", procs.ok, timeout_s=2 * SIM_START_TIMEOUT_S, process=gateway_proc)
        sim_pid = httpx.get(url + "/readyz").json()["backends"]["m"]["managed"]["pid"]
        assert _parent_of(sim_pid) == gateway_proc.pid
        gateway_proc.send_signal(signal.SIGTERM)
        assert gateway_proc.wait(timeout=30) in (0, -signal.SIGTERM)  # uvicorn >= 0.30 re-raises it
        assert not os.path.exists(f"/proc/{sim_pid}")  # stopped and reaped by the gateway, not orphaned
        with pytest.raises(ConnectionRefusedError):  # nothing listens there (TIME_WAIT may hold a bind)
            socket.create_connection(("127.0.0.1", sim_port), timeout=2).close()
    finally:
        procs.stop(gateway_proc, group=True)


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])
