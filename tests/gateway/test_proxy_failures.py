"""Failures before and after the first byte, disconnects, timeouts: the client sees the right thing and every
counter returns to zero."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import openai
import pytest

from clusters import ClusterFactory
from upstreams import FakeEngine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
RR = {"routing": {"policy": "round_robin"}}  # deterministic: the first request goes to "a" (sorted ids)


def test_5xx_before_first_byte_is_retried_on_the_next_backend(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", fail_next=1), FakeEngine("b")], **RR)
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert r.headers["x-warmroute-backend"] == "b"
    assert r.headers["x-warmroute-route"] == "retry_next"
    assert len(c.engines["a"].requests) == 1  # it was tried
    c.wait_idle()


def test_5xx_with_nobody_else_to_ask_is_relayed(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", fail_next=1)])
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "engine exploded"
    c.wait_idle()


def test_only_one_retry(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine(n, fail_next=5) for n in ("a", "b", "c")], **RR)
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 500
    assert sum(len(e.requests) for e in c.engines.values()) == 2
    c.wait_idle()


def test_connect_error_retries_and_marks_the_backend_down(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"], routing={"policy": "round_robin"}, health={"interval_s": 60})
    c.engine_servers["a"].should_exit = True  # the port closes; the health loop won't notice for 60 s
    deadline = time.monotonic() + 5
    while _port_open(c.gateway.registry.backends["a"].cfg.url) and time.monotonic() < deadline:
        time.sleep(0.02)
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert r.headers["x-warmroute-backend"] == "b"
    assert c.gateway.registry.backends["a"].state.value == "down"
    # Later requests skip it without paying for a failed connect.
    for _ in range(3):
        assert httpx.post(c.url + "/v1/chat/completions", json=CHAT).headers["x-warmroute-backend"] == "b"
    c.wait_idle()


def test_all_backends_unreachable_gives_502_then_503_never_500(cluster: ClusterFactory) -> None:
    c = cluster(["a"], health={"interval_s": 60})
    c.stop_engine("a")
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    # Health has not noticed yet: the connect error is the first sign, and nobody else serves the model.
    assert (r.status_code, r.json()["error"]["code"]) == (502, "upstream_error")
    assert r.json()["error"]["message"] == "backend a is unreachable"
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.json()["error"]["code"]) == (503, "no_healthy_backend")
    c.wait_idle()


def test_first_byte_timeout_retries_on_next(cluster: ClusterFactory) -> None:
    # first_byte_s is every engine's: 2 s gives b's prompt answer room on a loaded machine (0.3 s did not).
    c = cluster(engines=[FakeEngine("a", stall_s=30), FakeEngine("b")], timeouts={"first_byte_s": 2.0}, **RR)
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert r.headers["x-warmroute-backend"] == "b"
    c.wait_idle()  # the stalled engine saw its request cancelled
    assert c.engines["a"].cancelled == 1


def test_mid_stream_failure_ends_with_error_event_and_done(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", chunks=5, die_after=2)])
    with httpx.stream("POST", c.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200
    assert "a-0" in lines[0] and "a-1" in lines[1]
    assert lines[-3] == "event: error"
    assert '"code": "upstream_error"' in lines[-2]
    assert lines[-1] == "data: [DONE]"
    c.wait_idle()


def test_mid_stream_failure_raises_in_the_openai_client(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", chunks=5, die_after=2)])
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
    got = []
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        for chunk in client.chat.completions.create(model="m", messages=CHAT["messages"], stream=True):
            got.append(chunk.choices[0].delta.content)
    assert got == ["a-0 ", "a-1 "]
    c.wait_idle()


def test_stalled_stream_hits_read_timeout_with_error_event(cluster: ClusterFactory) -> None:
    gate = threading.Event()  # never set: the engine goes silent after its first chunk
    c = cluster(engines=[FakeEngine("a", gate=gate)], timeouts={"read_s": 0.3})
    with httpx.stream("POST", c.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert '"code": "upstream_timeout"' in lines[-2]
    assert lines[-1] == "data: [DONE]"
    gate.set()
    c.wait_idle()


def test_client_disconnect_mid_stream_cancels_upstream(cluster: ClusterFactory) -> None:
    gate = threading.Event()
    c = cluster(engines=[FakeEngine("a", gate=gate)])
    with httpx.stream("POST", c.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        lines = r.iter_lines()  # keep a reference: a dropped iterator closes the response (a disconnect)
        next(line for line in lines if line)
        assert c.engines["a"].active == 1
    # The client closed its connection; the gateway must drop the engine's stream and its lease.
    c.wait_idle()
    assert c.engines["a"].cancelled == 1
    gate.set()


def test_client_disconnect_while_waiting_for_headers_cancels_upstream(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", stall_s=5)])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(c.url + "/v1/chat/completions", json=CHAT, timeout=httpx.Timeout(5, read=0.3))
    c.wait_idle()
    assert c.engines["a"].cancelled == 1


def test_many_disconnects_leave_no_lease_behind(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", chunks=50, chunk_delay_s=0.01), FakeEngine("b", chunks=50)])

    def one(i: int) -> None:
        body = {**CHAT, "messages": [{"role": "user", "content": f"q{i}"}], "stream": True}
        with httpx.stream("POST", c.url + "/v1/chat/completions", json=body) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n >= i % 7:
                    break

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c.wait_idle()


def _port_open(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) == 0
