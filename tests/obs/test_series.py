"""The series issue #11 asked for, read back from a live /metrics with exact counts."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from obs_engines import CACHED_TOKENS, CHAT, PROMPT_TOKENS, UsageEngine, labels, nonzero, samples, scrape_text

from backends.canary import CanaryResult
from backends.events import (
    CanaryPassed,
    Command,
    ConfigAdded,
    Event,
    Operator,
    ProbeFailed,
    ProbeOk,
    ProcessExited,
    ProcessStarted,
    TimerFired,
    TimerKind,
)
from backends.lifecycle import Lifecycle, LifecyclePolicy, transition
from backends.registry import Registry
from config.settings import load_settings
from gateway.app import create_app
from gateway.metrics import Metrics, RestartCause
from routing.types import BackendState
from tools.procs import free_port
from tools.redis_server import RedisServer

from clusters import ClusterFactory
from upstreams import PROBE_TIMEOUT_S, FakeEngine, serve


def chat(url: str, content: str = "hello", **extra: Any) -> httpx.Response:
    body = {**CHAT, "messages": [{"role": "user", "content": content}], **extra}
    return httpx.post(url + "/v1/chat/completions", json=body)


def stream(url: str, content: str = "hello") -> list[str]:
    body = {**CHAT, "messages": [{"role": "user", "content": content}], "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
        return [line for line in r.iter_lines() if line]


def test_routed_requests_by_model_backend_reason_and_outcome(cluster: ClusterFactory) -> None:
    c = cluster(["a"], routing={"policy": "affinity"})  # under ttft a repeated first turn is a twin
    assert chat(c.url).status_code == 200  # a new conversation
    assert chat(c.url).status_code == 200  # its second turn: the pin holds
    assert chat(c.url, model="zz").status_code == 404  # refused before routing: no model label for it
    c.wait_idle()
    assert nonzero(c.url, "warmroute_routed_requests_total") == {
        labels(model="m", backend="a", reason="new_least_loaded", outcome="ok"): 1,
        labels(model="m", backend="a", reason="affinity_hit", outcome="ok"): 1,
    }
    assert nonzero(c.url, "warmroute_requests_total") == {
        labels(backend="a", outcome="ok"): 2,
        labels(backend="", outcome="rejected"): 1,
    }


def test_engine_status_is_the_outcome(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", answer_status=400)])
    assert chat(c.url).status_code == 400
    c.wait_idle()
    assert nonzero(c.url, "warmroute_routed_requests_total") == {
        labels(model="m", backend="a", reason="new_cheapest", outcome="http_4xx"): 1  # the default: ttft
    }


def test_tokens_and_cached_tokens_from_usage(cluster: ClusterFactory) -> None:
    c = cluster(
        engines=[UsageEngine("a", chunks=3), FakeEngine("b", chunks=2)], routing={"policy": "round_robin"}
    )
    assert chat(c.url, "one").status_code == 200  # a: usage with cached tokens
    assert chat(c.url, "two").status_code == 200  # b: usage without prompt_tokens_details
    assert stream(c.url, "three")[-1] == "data: [DONE]"  # a: usage in the stream's last chunk
    c.wait_idle()
    a, b = labels(model="m", backend="a"), labels(model="m", backend="b")
    assert nonzero(c.url, "warmroute_prompt_tokens_total") == {a: 2 * PROMPT_TOKENS, b: 1}
    assert nonzero(c.url, "warmroute_completion_tokens_total") == {a: 6, b: 2}
    assert nonzero(c.url, "warmroute_cached_prompt_tokens_total") == {a: 2 * CACHED_TOKENS}
    # The denominator of a cache share counts only answers that said how much was cached.
    assert nonzero(c.url, "warmroute_cache_reported_prompt_tokens_total") == {a: 2 * PROMPT_TOKENS}


def test_time_to_first_token_counts_streamed_answers_only(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    assert chat(c.url).status_code == 200
    assert stream(c.url)[-1] == "data: [DONE]"
    c.wait_idle()
    a = labels(model="m", backend="a")
    assert samples(c.url, "warmroute_time_to_first_token_seconds_count") == {a: 1}
    assert samples(c.url, "warmroute_upstream_first_byte_seconds_count") == {labels(backend="a"): 2}
    inf = samples(c.url, "warmroute_time_to_first_token_seconds_bucket")[
        labels(le="+Inf", model="m", backend="a")
    ]
    assert inf == 1


def test_pinned_conversations_and_backend_gauges(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"])
    assert chat(c.url, "first conversation").status_code == 200
    assert chat(c.url, "second conversation").status_code == 200  # least loaded: the other backend
    c.wait_idle()
    assert samples(c.url, "warmroute_backend_conversations") == {
        labels(backend="a"): 1,
        labels(backend="b"): 1,
    }
    assert samples(c.url, "warmroute_backend_in_flight") == {labels(backend="a"): 0, labels(backend="b"): 0}
    assert nonzero(c.url, "warmroute_backend_state") == {
        labels(backend="a", state="ready"): 1,
        labels(backend="b", state="ready"): 1,
    }
    assert samples(c.url, "warmroute_backend_circuit_open") == {
        labels(backend="a"): 0,
        labels(backend="b"): 0,
    }


def test_canary_pass_counted_once_at_start(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"])
    assert nonzero(c.url, "warmroute_canary_runs_total") == {
        labels(backend="a", check="all", result="pass"): 1,
        labels(backend="b", check="all", result="pass"): 1,
    }


def test_canary_failure_counted_by_the_failed_check(cluster: ClusterFactory) -> None:
    c = cluster(
        engines=[FakeEngine("a"), FakeEngine("b", canary_answer="dup dup dup dup")], canary={"retry_s": 60}
    )
    # Its result is kept before the lifecycle hears it (CANARY -> DOWN: announced).
    c.wait_for(lambda: c.gateway.fleet.controllers["b"].last_canary is not None, "b's canary ran")
    assert nonzero(c.url, "warmroute_canary_runs_total") == {
        labels(backend="a", check="all", result="pass"): 1,
        labels(backend="b", check="consistency", result="fail"): 1,
    }
    note = c.gateway.metrics.fleet.recent[-1]
    assert (note.backend, note.kind, note.label) == ("b", "canary_failed", "consistency")


def test_no_created_series_and_every_family_prefixed(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    assert chat(c.url).status_code == 200
    c.wait_idle()
    text = scrape_text(c.url)
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and line[0] != "#"}
    assert names and all(n.startswith("warmroute_") for n in names)
    assert not [n for n in names if n.endswith("_created")]


def test_forget_backend_drops_its_series(cluster: ClusterFactory) -> None:
    c = cluster(engines=[UsageEngine("a"), FakeEngine("b")], routing={"policy": "round_robin"})
    assert chat(c.url, "one").status_code == 200
    assert stream(c.url, "two")[-1] == "data: [DONE]"
    c.wait_idle()
    c.gateway.metrics.forget_backend("a")
    text = scrape_text(c.url)
    counted = [
        line
        for line in text.splitlines()
        if 'backend="a"' in line and not line.startswith(("warmroute_backend_", "#"))
    ]
    assert counted == []
    assert 'warmroute_requests_total{backend="b",outcome="ok"} 1.0' in text


# -- restarts, from the lifecycle's own transitions --------------------------------------------------------


@dataclass
class _Controller:
    """What the transition hook reads of a ``BackendController``."""

    id: str
    policy: LifecyclePolicy
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    last_canary: CanaryResult | None = None
    now: float = 1000.0

    def send(self, metrics: Metrics, event: Event) -> list[Any]:
        before = self.lifecycle
        self.lifecycle, actions = transition(before, event, self.now, self.policy)
        metrics.transition(self, event, before, actions)  # type: ignore[arg-type]
        self.now += 1
        return actions


def _restart_timer(actions: list[Any]) -> TimerFired:
    (arm,) = [a for a in actions if type(a).__name__ == "ArmTimer" and a.kind is TimerKind.RESTART]
    return TimerFired(TimerKind.RESTART, arm.seq)


def test_restarts_counted_by_the_cause_of_the_outage() -> None:
    settings = load_settings(None, backends=[{"id": "e", "url": "http://127.0.0.1:9", "models": ["m"]}])
    metrics = Metrics(Registry(settings.backends))
    ctl = _Controller("e", LifecyclePolicy(managed=True, grace_s=0, max_restarts=5, fail_threshold=1))
    ctl.send(metrics, ConfigAdded())
    ctl.send(metrics, ProcessStarted(42))
    # 1. The process dies: restarted, cause "exited".
    actions = ctl.send(metrics, ProcessExited("exited with code 3", code=3))
    ctl.send(metrics, _restart_timer(actions))
    # 2. It comes up, then fails its health probe: restarted, cause "unhealthy".
    ctl.send(metrics, ProcessStarted(43))
    ctl.send(metrics, ProbeOk())
    ctl.send(metrics, CanaryPassed(ctl.lifecycle.canary_seq))
    assert ctl.lifecycle.state is BackendState.READY
    actions = ctl.send(metrics, ProbeFailed("connection refused"))
    ctl.send(metrics, _restart_timer(actions))
    # 3. It never becomes healthy: the start timeout takes it down and it is restarted again.
    actions = ctl.send(metrics, TimerFired(TimerKind.START_TIMEOUT, ctl.lifecycle.timer_seq))
    ctl.send(metrics, _restart_timer(actions))
    # 4. It dies for good; the operator resets it after the give-up.
    for pid in (44, 45):
        ctl.send(metrics, ProcessStarted(pid))
        actions = ctl.send(metrics, ProcessExited("was killed by signal 9 (SIGKILL)", signal=9))
        ctl.send(metrics, _restart_timer(actions))
    ctl.send(metrics, ProcessExited("exited with code 1", code=1))  # the fifth restart in the window
    assert ctl.lifecycle.gave_up
    ctl.send(metrics, Operator(Command.RESET))
    assert metrics.fleet.restarts == {
        ("e", RestartCause.EXITED): 3,
        ("e", RestartCause.UNHEALTHY): 1,
        ("e", RestartCause.START_TIMEOUT): 1,
        ("e", RestartCause.OPERATOR): 1,
    }
    assert metrics.fleet.give_ups == {("e",): 1}
    assert [n.label for n in metrics.fleet.recent] == [
        "exited",
        "unhealthy",
        "start_timeout",
        "exited",
        "exited",
        "operator",
    ]


def wait_for(condition: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail("condition not met in time")
        time.sleep(0.02)


def test_pinned_conversations_come_from_the_shared_store(
    cluster: ClusterFactory, redis_server: RedisServer, redis_prefix: str
) -> None:
    shared = {"redis": {"url": redis_server.url, "prefix": redis_prefix, "timeout_s": 2.0}}
    one, other = cluster(["a", "b"], **shared), cluster(["a", "b"], **shared)
    assert chat(one.url, "first conversation").status_code == 200
    assert chat(one.url, "second conversation").status_code == 200
    one.wait_idle()
    # The other replica routed nothing, and its scrape shows the pins all the same.
    assert samples(other.url, "warmroute_backend_conversations") == {
        labels(backend="a"): 1,
        labels(backend="b"): 1,
    }
    assert nonzero(other.url, "warmroute_requests_total") == {}


def test_unknown_model_on_a_passthrough_route_gets_no_series(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    r = httpx.post(c.url + "/v1/embeddings", json={"model": "not-configured", "input": "x"})
    assert r.status_code == 404
    assert httpx.post(c.url + "/v1/embeddings", json={"model": "m", "input": "x"}).status_code == 200
    c.wait_idle()
    assert nonzero(c.url, "warmroute_routed_requests_total") == {
        labels(model="m", backend="a", reason="least_loaded", outcome="ok"): 1
    }
    assert "not-configured" not in scrape_text(c.url)


def test_a_managed_engine_that_keeps_exiting_counts_restarts_and_the_give_up() -> None:
    """The real wiring: the gateway's own controllers report to its metrics (gateway.app sets the hook)."""
    failing = {
        "command": ["sh", "-c", "echo cannot load the weights; exit 3"],
        "restart": {"grace_s": 0, "backoff_initial_s": 0.05, "max_restarts": 2, "window_s": 60},
    }
    url = f"http://127.0.0.1:{free_port()}"
    backend = {"id": "m", "url": url, "models": ["m"], "managed": failing}
    settings = load_settings(
        None, backends=[backend], health={"interval_s": 0.2, "timeout_s": PROBE_TIMEOUT_S}
    )
    app = create_app(settings)
    with serve(app) as (gateway_url, _server):
        gw = app.state.gateway
        wait_for(lambda: gw.fleet.controllers["m"].lifecycle.gave_up)
        assert nonzero(gateway_url, "warmroute_backend_restarts_total") == {
            labels(backend="m", cause="exited"): 2
        }
        assert nonzero(gateway_url, "warmroute_backend_give_ups_total") == {labels(backend="m"): 1}
        page = httpx.get(gateway_url + "/admin/status").text
        assert page.count("<td class=bad>restart</td><td>exited</td>") == 2
        assert "gave up" in page
