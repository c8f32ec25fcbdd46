"""On-demand engines through the gateway, with engine simulators as real processes started by the gateway.

The gateway runs under uvicorn on the test's event loop, so a test can watch its controllers' state changes
(``Timeline``) and read the scheduler; everything a client sees goes over HTTP. Waits are on state changes
with deadlines; nothing sleeps to let time pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from backends.lifecycle import Lifecycle
from backends.ondemand import Phase
from config.settings import load_settings
from gateway.app import Gateway
from gateway.observe import Observation
from routing.types import BackendState
from tools import procs

from clusters import served_gateway
from upstreams import PROBE_TIMEOUT_S

pytestmark = pytest.mark.anyio
S = BackendState
WITHIN = 60.0  # a Python process importing Starlette on a busy 2-core machine, plus its canary
FAST_HEALTH = {"interval_s": 0.05, "timeout_s": PROBE_TIMEOUT_S, "fail_threshold": 2}


def chat(model: str, *, stream: bool = False, max_tokens: int = 8) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    return {**body, "max_tokens": max_tokens, "stream": stream}


def sim_engine(bid: str, model: str, *sim_args: str, **managed: Any) -> dict[str, Any]:
    """An on-demand backend whose command starts a simulator serving ``model`` on a free port."""
    port = procs.free_port()
    argv = procs.python(
        "-m", "backends.sim", "--port", str(port), "--model", model, "--log-level", "warning", *sim_args
    )
    if "--time-scale" not in sim_args:
        argv += ["--time-scale", "0"]
    m = {"command": argv, "on_demand": True, "start_timeout_s": WITHIN, "stop_timeout_s": 5, **managed}
    return {"id": bid, "url": f"http://127.0.0.1:{port}", "models": [model], "managed": m}


class Timeline:
    """Every lifecycle state each controller reports, timed; ``until`` waits for a predicate (deadline)."""

    def __init__(self, gw: Gateway) -> None:
        self.seen: list[tuple[str, BackendState, float, str]] = []
        self.changed = asyncio.Event()
        for bid, ctl in gw.fleet.controllers.items():
            ctl.on_change = self._wrap(bid, ctl.on_change)

    def _wrap(self, bid: str, inner: Callable[[Lifecycle], None] | None) -> Callable[[Lifecycle], None]:
        def on_change(lc: Lifecycle) -> None:
            at = time.monotonic()  # before the fleet's own listener, which tells the scheduler (its ready_at)
            if inner is not None:
                inner(lc)
            self.seen.append((bid, lc.state, at, lc.reason))
            self.changed.set()

        return on_change

    async def until(self, predicate: Callable[[], bool], within: float = WITHIN) -> None:
        async with asyncio.timeout(within):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()

    def times(self, bid: str, state: BackendState) -> list[float]:
        return [t for b, s, t, _ in self.seen if b == bid and s is state]


@contextlib.asynccontextmanager
async def gateway(
    backends: list[dict[str, Any]], modules: tuple[object, ...] = (), **overrides: Any
) -> AsyncIterator[tuple[str, Gateway]]:
    overrides.setdefault("health", FAST_HEALTH)
    settings = load_settings(None, backends=backends, **overrides)
    async with served_gateway(settings, WITHIN, modules) as served:
        yield served


async def eventually(predicate: Callable[[], bool], within: float = WITHIN) -> None:
    """For what announces nothing (a request joining or leaving the queue): a poll with a deadline."""
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


def phase(gw: Gateway, bid: str) -> Phase:
    assert gw.fleet.demand is not None
    return gw.fleet.demand.schedule.engines[bid].phase


def accounted(gw: Gateway) -> None:
    """Every request is over: no lease, no claim, nobody waiting."""
    assert gw.fleet.demand is not None
    assert gw.registry.total_in_flight() == 0
    assert all(e.claims == 0 for e in gw.fleet.demand.schedule.engines.values())
    assert gw.fleet.demand.schedule.queue == ()


async def metric(c: httpx.AsyncClient, url: str, name: str, **labels: str) -> float:
    text = (await c.get(url + "/metrics")).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- start on the first request ------------------------------------------------------------------------------


async def test_the_first_request_starts_the_engine_and_succeeds() -> None:
    async with gateway([sim_engine("a", "ma")]) as (url, gw), httpx.AsyncClient(timeout=WITHIN) as c:
        assert gw.fleet.controllers["a"].status()["reason"] == "stopped (on demand): starts on a request"
        assert gw.fleet.controllers["a"].supervisor.running is False  # type: ignore[union-attr]
        assert [m["id"] for m in (await c.get(url + "/v1/models")).json()["data"]] == ["ma"]
        assert (await c.get(url + "/readyz")).status_code == 200  # a stopped zoo is ready to serve
        r = await c.post(url + "/v1/chat/completions", json=chat("ma"))
        assert (r.status_code, r.headers["x-warmroute-backend"]) == (200, "a")
        assert r.json()["choices"][0]["message"]["content"]
        status = (await c.get(url + "/readyz")).json()["backends"]["a"]
        assert (status["state"], status["on_demand"]["phase"], status["on_demand"]["claims"]) == (
            "ready",
            "ready",
            0,
        )
        assert await metric(c, url, "warmroute_ondemand_starts_total", backend="a") == 1
        assert await metric(c, url, "warmroute_ondemand_starting_seconds_count", backend="a") == 1
        accounted(gw)


async def test_twenty_concurrent_first_requests_start_it_once_and_all_succeed() -> None:
    async with gateway([sim_engine("a", "ma")]) as (url, gw), httpx.AsyncClient(timeout=WITHIN) as c:
        tl = Timeline(gw)
        replies = await asyncio.gather(
            *(c.post(url + "/v1/chat/completions", json=chat("ma")) for _ in range(20))
        )
        assert [r.status_code for r in replies] == [200] * 20
        assert len(tl.times("a", S.STARTING)) == 1
        assert await metric(c, url, "warmroute_ondemand_starts_total", backend="a") == 1
        waited = await metric(c, url, "warmroute_ondemand_wait_seconds_count", model="ma", outcome="admitted")
        assert waited == 20
        accounted(gw)


async def test_a_waiting_stream_gets_keepalive_comments_then_the_whole_answer() -> None:
    engine = sim_engine("a", "ma", "--start-delay-s", "1.0")
    async with (
        gateway([engine], on_demand={"keepalive_s": 0.2}) as (url, gw),
        httpx.AsyncClient(timeout=WITHIN) as c,
    ):
        async with c.stream("POST", url + "/v1/chat/completions", json=chat("ma", stream=True)) as r:
            assert (r.status_code, r.headers["content-type"]) == (200, "text/event-stream")
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
        events = raw.decode().split("\n\n")
        comments = [e for e in events if e.startswith(":")]
        assert comments[0].startswith(": waiting for a to start (0 s)") and len(comments) >= 2
        data = [e for e in events if e.startswith("data: ")]
        assert data[-1] == "data: [DONE]" and len(data) >= 3
        assert all(json.loads(e[6:])["object"] == "chat.completion.chunk" for e in data[:-1])
        accounted(gw)


# -- idle TTL ------------------------------------------------------------------------------------------------


async def test_idle_ttl_stops_the_engine_and_status_says_so() -> None:
    engine = sim_engine("a", "ma", idle_ttl_s=0.5)
    finished: list[
        tuple[str, float]
    ] = []  # the gateway's own end of the request: the idle clock starts after
    async with (
        gateway([engine], (Finished(finished),)) as (url, gw),
        httpx.AsyncClient(timeout=WITHIN) as c,
    ):
        tl = Timeline(gw)
        assert (await c.post(url + "/v1/chat/completions", json=chat("ma"))).status_code == 200
        ((_, done),) = finished
        await eventually(lambda: phase(gw, "a") is Phase.STOPPED)  # its stop has finished
        ctl = gw.fleet.controllers["a"]
        status = ctl.status()
        assert status["state"] == "down" and status["reason"].startswith("stopped: idle for ")
        assert status["reason"].endswith("(idle_ttl_s 0.5) (starts again on a request)")
        assert status["managed"]["running"] is False
        assert status["managed"]["exits"][-1]["requested"] is True  # our SIGTERM, no outage
        assert tl.times("a", S.DOWN)[-1] - done >= 0.5
        assert await metric(c, url, "warmroute_ondemand_stops_total", backend="a", why="idle") == 1
        # ... and the next request starts it again
        assert (await c.post(url + "/v1/chat/completions", json=chat("ma"))).status_code == 200
        assert len(tl.times("a", S.STARTING)) == 2
        accounted(gw)


# -- groups --------------------------------------------------------------------------------------------------


def exited_at(gw: Gateway, bid: str) -> float:
    """The last exit of ``bid``'s process, on the monotonic clock (exits are stamped with wall time)."""
    wall = gw.fleet.controllers[bid].status()["managed"]["exits"][-1]["at"]
    return float(wall) - time.time() + time.monotonic()


class Finished:
    def __init__(self, into: list[tuple[str, float]]) -> None:
        self.into = into

    def observe(self, obs: Observation) -> None:
        self.into.append((obs.model or "", time.monotonic()))


def pair(residency: float = 0.0, **a_args: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    slow = ("--time-scale", "1", "--decode-tps", "40", "--ttft-base-ms", "0", "--answer-tokens", "40:40")
    backends = [sim_engine("a", "ma", *slow, group="gpu", **a_args), sim_engine("b", "mb", group="gpu")]
    return backends, {"groups": {"gpu": {"max_running": 1, "min_residency_s": residency}}}


async def test_a_group_swaps_on_demand_and_never_while_a_stream_is_in_flight() -> None:
    backends, extra = pair()
    finished: list[tuple[str, float]] = []  # when the gateway's finish phase saw each request end
    async with (
        gateway(backends, (Finished(finished),), **extra) as (url, gw),
        httpx.AsyncClient(timeout=WITHIN) as c,
    ):
        tl = Timeline(gw)
        assert gw.fleet.demand is not None
        arrival = time.monotonic()
        async with c.stream(
            "POST", url + "/v1/chat/completions", json=chat("ma", stream=True, max_tokens=40)
        ) as stream:
            chunks = stream.aiter_raw()
            first = b""
            while b"data: {" not in first:  # keep-alive comments while a starts, then its first token
                first += await anext(chunks)
            other = asyncio.create_task(c.post(url + "/v1/chat/completions", json=chat("mb")))
            await eventually(
                lambda: gw.fleet.demand is not None and gw.fleet.demand.schedule.waiting("mb") == 1
            )
            assert phase(gw, "a") is Phase.READY and phase(gw, "b") is Phase.STOPPED  # eviction refused
            rest = b"".join([chunk async for chunk in chunks])
        text = (first + rest).decode()
        assert text.rstrip().endswith("data: [DONE]") and "event: error" not in text
        assert text.startswith(": waiting for a to start (0 s)\n\n")
        chunks_ = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]
        deltas = [ch["choices"][0]["delta"].get("content") for ch in chunks_ if ch["choices"]]
        assert len([d for d in deltas if d]) == 40  # every token of the answer
        assert chunks_[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        r = await other
        assert (r.status_code, r.headers["x-warmroute-backend"]) == (200, "b")
        a_stopped, b_ready = tl.times("a", S.DOWN)[-1], tl.times("b", S.READY)[0]
        (stream_finished,) = [at for model, at in finished if model == "ma"]
        assert stream_finished <= a_stopped <= tl.times("b", S.STARTING)[0] <= b_ready
        answered = time.monotonic()
        print(
            f"\nsim swap held back by a stream: the stream finished at the gateway "
            f"{stream_finished - arrival:.3f}s after it arrived; from there a told to stop "
            f"+{a_stopped - stream_finished:.3f}s, b ready +{b_ready - stream_finished:.3f}s, "
            f"b answered +{answered - stream_finished:.3f}s"
        )
        assert await metric(c, url, "warmroute_ondemand_evictions_refused_total", backend="a") == 1
        assert await metric(c, url, "warmroute_ondemand_swaps_total", group="gpu") == 1
        accounted(gw)


async def test_the_swap_timeline_from_arrival_to_first_token() -> None:
    backends, extra = pair()
    async with gateway(backends, **extra) as (url, gw), httpx.AsyncClient(timeout=WITHIN) as c:
        tl = Timeline(gw)
        assert (await c.post(url + "/v1/chat/completions", json=chat("ma"))).status_code == 200
        arrival = time.monotonic()
        async with c.stream("POST", url + "/v1/chat/completions", json=chat("mb", stream=True)) as r:
            async for chunk in r.aiter_raw():
                if b"data: {" in chunk:
                    break
            first_token = time.monotonic()
        a_stopping, b_ready = tl.times("a", S.DOWN)[-1], tl.times("b", S.READY)[-1]
        a_exited = exited_at(gw, "a")
        assert arrival <= a_stopping <= a_exited <= tl.times("b", S.STARTING)[-1] <= b_ready <= first_token
        print(
            f"\nsim swap timeline from the request's arrival: a told to stop +{a_stopping - arrival:.3f}s, "
            f"a exited +{a_exited - arrival:.3f}s, b ready +{b_ready - arrival:.3f}s, "
            f"first token +{first_token - arrival:.3f}s"
        )


async def test_alternating_traffic_is_batched_and_does_not_thrash_below_the_residency() -> None:
    backends, extra = pair(residency=1.0)
    async with gateway(backends, **extra) as (url, gw), httpx.AsyncClient(timeout=WITHIN) as c:
        tl = Timeline(gw)
        models = ["ma", "mb"] * 4
        replies = await asyncio.gather(*(c.post(url + "/v1/chat/completions", json=chat(m)) for m in models))
        assert [(r.status_code, r.headers["x-warmroute-backend"]) for r in replies] == [
            (200, m[1]) for m in models
        ]
        # Eight alternating requests, one swap: a served all of its own during its residency, then b.
        assert (len(tl.times("a", S.STARTING)), len(tl.times("b", S.STARTING))) == (1, 1)
        assert tl.times("a", S.DOWN)[-1] - tl.times("a", S.READY)[0] >= 1.0
        assert await metric(c, url, "warmroute_ondemand_swaps_total", group="gpu") == 1
        accounted(gw)


# -- holds ---------------------------------------------------------------------------------------------------


async def test_a_hold_keeps_the_engine_and_the_other_model_gets_503_naming_it() -> None:
    backends, extra = pair(idle_ttl_s=0.2)
    async with gateway(backends, **extra) as (url, gw), httpx.AsyncClient(timeout=WITHIN) as c:
        admin = url + "/admin/backends"
        # The hold is placed while a's first stream is in flight: an engine is never stopped with a request
        # in flight, so its 0.2 s idle TTL cannot run out before the hold is there, however slow the machine.
        async with c.stream("POST", url + "/v1/chat/completions", json=chat("ma", stream=True)) as stream:
            assert stream.status_code == 200
            chunks = stream.aiter_raw()
            first = b""
            while b"data: {" not in first:  # keep-alive comments while a starts, then its first token
                first += await anext(chunks)
            bad = await c.post(admin + "/a/hold", json={"duration_s": -1})
            assert (bad.status_code, bad.json()["error"]["param"]) == (422, "duration_s")
            assert (await c.post(admin + "/zz/hold", json={"duration_s": 30})).status_code == 404
            r = await c.post(admin + "/a/hold", json={"duration_s": 30, "reason": "benchmark run 7"})
            async for _ in chunks:
                pass
        held = r.json()["on_demand"]
        assert (
            r.status_code == 200 and held["hold"]["reason"] == "benchmark run 7" and held["phase"] == "ready"
        )
        removal = await c.delete(admin + "/a")  # the scheduler comes from the config file
        assert removal.status_code == 409 and "on-demand engine" in removal.json()["error"]["message"]
        r = await c.post(url + "/v1/chat/completions", json=chat("mb"))
        assert r.status_code == 503 and 29 <= int(r.headers["retry-after"]) <= 30
        err = r.json()["error"]
        assert err["code"] == "engine_held"
        assert err["message"].startswith(
            "backend b cannot start: group 'gpu' is held by backend a (benchmark run 7) for another "
        )
        assert "(until 20" in err["message"]  # the wall-clock end, ISO 8601
        status = (await c.get(url + "/readyz")).json()["backends"]
        assert status["a"]["on_demand"]["hold"]["reason"] == "benchmark run 7"
        assert status["a"]["state"] == "ready"  # idle far past its 0.2 s TTL, held
        view = (await c.get(admin + "/a")).json()["on_demand"]
        assert (view["phase"], view["hold"]["reason"]) == ("ready", "benchmark run 7")
        never = (await c.get(admin + "/b")).json()["on_demand"]
        assert (never["phase"], never["phase_for_s"]) == ("stopped", None)  # never started
        assert "_created" not in (await c.get(url + "/metrics")).text
        released = await c.delete(admin + "/a/hold")
        assert released.status_code == 200 and released.json()["on_demand"]["hold"] is None
        r = await c.post(url + "/v1/chat/completions", json=chat("mb"))
        assert (r.status_code, r.headers["x-warmroute-backend"]) == (200, "b")
        accounted(gw)


async def test_the_hold_header_holds_the_engine_when_enabled() -> None:
    backends, extra = pair()
    async with (
        gateway(backends, on_demand={"hold_header": True}, **extra) as (url, _gw),
        httpx.AsyncClient(timeout=WITHIN) as c,
    ):
        r = await c.post(url + "/v1/chat/completions", json=chat("ma"), headers={"x-warmroute-hold": "60"})
        assert r.status_code == 200
        r = await c.post(url + "/v1/chat/completions", json=chat("mb"))
        assert r.status_code == 503 and r.json()["error"]["message"].startswith(
            "backend b cannot start: group 'gpu' is held by backend a (x-warmroute-hold on a request for ma)"
        )


async def test_only_the_client_keys_named_in_hold_clients_may_hold_by_header() -> None:
    backends, extra = pair()
    keys = {
        "client_keys": [
            {"name": "bench", "key": "k-bench-0123456789"},
            {"name": "chat", "key": "k-chat-0123456789"},
        ]
    }
    async with (
        gateway(backends, on_demand={"hold_header": True, "hold_clients": ["bench"]}, auth=keys, **extra) as (
            url,
            gw,
        ),
        httpx.AsyncClient(timeout=WITHIN) as c,
    ):
        hold = {"x-warmroute-hold": "60"}
        r = await c.post(
            url + "/v1/chat/completions",
            json=chat("ma"),
            headers={**hold, "authorization": "Bearer k-chat-0123456789"},
        )
        assert r.status_code == 200 and gw.fleet.status()["a"]["on_demand"]["hold"] is None  # not trusted
        r = await c.post(
            url + "/v1/chat/completions",
            json=chat("ma"),
            headers={**hold, "authorization": "Bearer k-bench-0123456789"},
        )
        assert r.status_code == 200 and gw.fleet.status()["a"]["on_demand"]["hold"] is not None


async def test_on_demand_backends_cannot_be_added_at_runtime() -> None:
    backends, extra = pair()
    async with gateway(backends, **extra) as (url, _gw), httpx.AsyncClient(timeout=WITHIN) as c:
        new = sim_engine("c", "mc", group="gpu")
        r = await c.post(url + "/admin/backends", json=new)
        assert r.status_code == 422  # managed without admin.allow_managed, or on-demand: refused either way
        assert (await c.post(url + "/admin/backends/b/hold", json={"duration_s": 5})).status_code == 200


# -- failures and bounds -------------------------------------------------------------------------------------


async def test_a_failing_start_command_answers_every_waiting_request_with_its_cause() -> None:
    port = procs.free_port()
    failing = {"command": ["sh", "-c", "echo cannot load the weights; exit 3"], "on_demand": True}
    cfg = {"id": "a", "url": f"http://127.0.0.1:{port}", "models": ["ma"], "managed": failing}
    async with gateway([cfg]) as (url, gw), httpx.AsyncClient(timeout=WITHIN) as c:

        async def streamed() -> tuple[int, str]:
            async with c.stream("POST", url + "/v1/chat/completions", json=chat("ma", stream=True)) as r:
                return r.status_code, (await r.aread()).decode()

        plain = [c.post(url + "/v1/chat/completions", json=chat("ma")) for _ in range(2)]
        *replies, (stream_status, stream_text) = await asyncio.gather(*plain, streamed())
        cause = (
            "backend a failed to start: engine process exited with code 3; "
            "last output: cannot load the weights"
        )
        for r in replies:
            assert r.status_code == 503
            assert r.json()["error"] == {
                "message": cause,
                "type": "server_error",
                "param": None,
                "code": "engine_start_failed",
            }
        assert stream_status == 200  # its head went out while it waited
        assert stream_text.startswith(": waiting for a to start (0 s)\n\n")
        error = json.loads(stream_text.split("event: error\ndata: ", 1)[1].split("\n\n", 1)[0])
        assert error["error"]["message"] == cause
        assert stream_text.endswith("data: [DONE]\n\n")
        status = gw.fleet.controllers["a"].status()
        assert status["reason"].startswith("stopped after a failure: engine process exited with code 3")
        assert (
            status["managed"]["exits"][-1]["code"] == 3 and len(status["managed"]["exits"]) == 1
        )  # no restart
        accounted(gw)


async def test_a_full_queue_is_a_503_with_retry_after_and_leavers_leave_the_queue() -> None:
    engine = sim_engine("a", "ma", "--start-delay-s", "30")
    limits = {"max_waiting": 2, "retry_after_s": 7}
    async with gateway([engine], on_demand=limits) as (url, gw), httpx.AsyncClient(timeout=WITHIN) as c:
        assert gw.fleet.demand is not None
        demand = gw.fleet.demand
        waiting = [
            asyncio.create_task(c.post(url + "/v1/chat/completions", json=chat("ma"))) for _ in range(2)
        ]
        await eventually(lambda: demand.schedule.waiting("ma") == 2 or any(t.done() for t in waiting))
        r = await c.post(url + "/v1/chat/completions", json=chat("ma"))
        assert (r.status_code, r.headers["retry-after"]) == (503, "7")
        assert r.json()["error"]["code"] == "on_demand_queue_full"
        assert r.json()["error"]["message"] == "2 requests for model 'ma' are waiting already"
        assert await metric(c, url, "warmroute_ondemand_queue_depth", model="ma") == 2
        for task in waiting:
            task.cancel()  # the clients leave
        await asyncio.gather(*waiting, return_exceptions=True)
        await eventually(lambda: demand.schedule.waiting("ma") == 0, within=10)
        accounted(gw)


async def test_a_start_timeout_answers_the_waiting_request_with_it_and_stops_the_engine() -> None:
    engine = sim_engine("a", "ma", "--start-delay-s", "60", start_timeout_s=1.0)
    async with gateway([engine]) as (url, gw), httpx.AsyncClient(timeout=WITHIN) as c:
        r = await c.post(url + "/v1/chat/completions", json=chat("ma"))
        assert (r.status_code, r.json()["error"]["code"]) == (503, "engine_start_failed")
        message = r.json()["error"]["message"]
        assert message.startswith("backend a failed to start: not healthy within 1 s of starting")
        await eventually(lambda: phase(gw, "a") is Phase.STOPPED)
        assert gw.fleet.controllers["a"].status()["managed"]["running"] is False
        accounted(gw)


@pytest.mark.parametrize("enabled", [False, True])
async def test_the_hold_header_is_ignored_when_off_or_from_an_untrusted_client(enabled: bool) -> None:
    backends, extra = pair()
    async with (
        gateway(backends, on_demand={"hold_header": enabled}, **extra) as (url, gw),
        httpx.AsyncClient(timeout=WITHIN) as c,
    ):
        assert gw.waiting is not None
        gw.waiting.may_hold = lambda ctx: False  # the auth layer's predicate: nobody is trusted
        r = await c.post(url + "/v1/chat/completions", json=chat("ma"), headers={"x-warmroute-hold": "60"})
        assert r.status_code == 200
        r = await c.post(url + "/v1/chat/completions", json=chat("mb"))
        assert (r.status_code, r.headers["x-warmroute-backend"]) == (200, "b")  # swapped: no hold
        accounted(gw)
