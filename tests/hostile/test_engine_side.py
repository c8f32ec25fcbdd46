"""What a faulty engine can do to the gateway, through raw sockets: each test names the hardening defect it
proves fixed (a wedged engine held the client forever, a slow reader was blamed on the engine, a pin never
left a failing engine, engine headers clients rely on were dropped, /readyz and error bodies leaked
internals).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Mapping, Sequence

import httpx
import pytest
from hostile_engine import (
    HostileEngine,
    Script,
    head_then_silence,
    huge_headers,
    ok_json,
    response,
    steps,
    trickle,
)
from hostile_gateway import LATE_S, WAIT_S, HostileGateway, HostileGatewayFactory, assert_one_line

from gateway.outcomes import RequestOutcome

from upstreams import FakeEngine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
SLOW_PROBE_S = 4.0  # the probe deadline a trickling /health (12 s) runs into


def engine(routes: Mapping[str, Script | Sequence[Script]]) -> HostileEngine:
    """A hostile engine whose /health is fine: the health checker keeps it READY, so traffic reaches it."""
    return HostileEngine({"/health": steps(response(200)), **routes})


def test_engine_silent_after_its_sse_head_is_cut_after_read_s(hostile_gateway: HostileGatewayFactory) -> None:
    # Defect 1: the first silence budget was an absolute loop time passed as a delay: it never fired.
    engine_ = engine({"/v1/chat/completions": head_then_silence()})
    with engine_.serve() as url:
        c = hostile_gateway(
            engines=[], raw_engines={"wedged": url}, timeouts={"read_s": 0.5, "request_s": 10}
        )
        t = time.monotonic()
        r = httpx.post(c.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=WAIT_S)
        took = time.monotonic() - t
    lines = [line for line in r.text.splitlines() if line]
    assert lines[0] == "event: error"
    assert json.loads(lines[1].removeprefix("data: "))["error"] == {
        "message": "backend wedged sent nothing for 0.5s",
        "type": "server_error",
        "param": None,
        "code": "upstream_timeout",
    }
    assert lines[2] == "data: [DONE]"
    assert 0.5 <= took < 0.5 + LATE_S
    assert c.gateway.registry.total_in_flight() == 0


def test_engine_that_promises_a_json_body_and_sends_none_is_cut_by_request_s(
    hostile_gateway: HostileGatewayFactory,
) -> None:
    # Defect 1 too: a JSON head with content-length and no body. request_s bounds the whole request.
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n"
    engine_ = engine({"/v1/completions": steps(head, 30.0), "/v1/chat/completions": steps(head, 30.0)})
    with engine_.serve() as url:
        c = hostile_gateway(
            engines=[], raw_engines={"wedged": url}, timeouts={"read_s": 60, "request_s": 0.8}
        )
        t = time.monotonic()
        try:
            httpx.post(c.url + "/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=WAIT_S)
            raise AssertionError("a body cut short must not read as a whole answer")
        except httpx.RemoteProtocolError:
            pass  # the only honest signal once the status line is gone: the connection closes
        assert 0.8 <= time.monotonic() - t < 0.8 + LATE_S
        # A chat body is read whole (its reasoning fields are rewritten) and its head waits for it: the
        # client gets a proper error response instead.
        r = httpx.post(c.url + "/v1/chat/completions", json=CHAT, timeout=5)
        assert r.status_code == 504
        assert r.json()["error"]["message"] == "backend wedged did not finish within request_s=0.8s"
        assert c.gateway.registry.total_in_flight() == 0


def test_a_slow_reader_is_not_blamed_on_a_healthy_engine(hostile_gateway: HostileGatewayFactory) -> None:
    # Defect 6: time spent waiting for the client to read counted as engine silence (a 20 MB answer was
    # cut at 4 MB when the client paused longer than read_s).
    chunk = b"data: " + b"x" * 65530 + b"\n\n"
    body = chunk * 384  # 24 MiB: more than every socket buffer on the way can hold
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n" % len(body)
    engine_ = engine({"/v1/chat/completions": steps(head + body)})
    with engine_.serve() as url:
        # read_s 1 s: the engine thread may stall on a loaded machine too (0.4 s was within reach)
        c = hostile_gateway(engines=[], raw_engines={"fast": url}, timeouts={"read_s": 1.0})
        request = json.dumps({**CHAT, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", c.port)) as s:
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(request), request)
            )
            s.settimeout(10)
            received = [s.recv(65536)]
            time.sleep(3.0)  # the reader pauses for longer than read_s: the engine is not silent, we are
            while data := s.recv(1 << 20):
                received.append(data)
        answer = b"".join(received)
        assert answer.count(b"data: ") == 384  # every event arrived
        assert b"event: error" not in answer
        assert answer.endswith(b"0\r\n\r\n")  # and the chunked body ended properly
        assert c.gateway.registry.total_in_flight() == 0


def test_a_conversation_leaves_an_engine_that_fails_while_passing_health(
    hostile_gateway: HostileGatewayFactory,
) -> None:
    # Defect 7: the pin stayed; every turn paid the failing engine's whole timeout before retry_next.
    sick, well = FakeEngine("a"), FakeEngine("b")
    # first_byte_s is every engine's: 2 s gives the well one's prompt answers room on a loaded machine.
    c = hostile_gateway(engines=[sick, well], routing={"policy": "affinity"}, timeouts={"first_byte_s": 2.0})
    turn = [{"role": "user", "content": "same chat"}]
    first = httpx.post(c.url + "/v1/chat/completions", json={"model": "m", "messages": turn})
    pinned = first.headers["x-warmroute-backend"]
    other = "b" if pinned == "a" else "a"
    engines = {"a": sick, "b": well}
    engines[pinned].stall_s = 30  # health still answers 200
    follow = [*turn, {"role": "assistant", "content": "x"}, {"role": "user", "content": "turn 2"}]
    t = time.monotonic()
    second = httpx.post(c.url + "/v1/chat/completions", json={"model": "m", "messages": follow}, timeout=10)
    assert (second.headers["x-warmroute-backend"], second.headers["x-warmroute-route"]) == (
        other,
        "retry_next",
    )
    assert time.monotonic() - t >= 2.0  # this turn paid the timeout once
    seen = len(engines[pinned].requests)
    third = httpx.post(c.url + "/v1/chat/completions", json={"model": "m", "messages": follow}, timeout=10)
    assert (third.headers["x-warmroute-backend"], third.headers["x-warmroute-route"]) == (
        other,
        "affinity_hit",
    )
    # And the next one did not: it never went to the failing engine (which records a request as it
    # arrives, before its stall). A wall-clock "< 0.5 s" here failed whenever a loaded machine was slow.
    assert len(engines[pinned].requests) == seen
    engines[pinned].stall_s = 0


def test_rate_limit_and_redirect_headers_reach_the_client(hostile_gateway: HostileGatewayFactory) -> None:
    # Defect 9: Retry-After and x-ratelimit-* on a 429, Location on a redirect, were dropped.
    limited = response(
        429,
        b'{"error": {"message": "slow down"}}',
        {
            "content-type": "application/json",
            "retry-after": "7",
            "x-ratelimit-remaining-requests": "0",
            "x-internal-trace": "do-not-relay",
        },
    )
    moved = response(307, b"", {"location": "/v1/files/new-place"})
    engine_ = engine({"/v1/chat/completions": steps(limited), "/v1/files/old": steps(moved)})
    with engine_.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"e": url})
        r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
        assert (r.status_code, r.headers["retry-after"]) == (429, "7")
        assert r.headers["x-ratelimit-remaining-requests"] == "0"
        assert "x-internal-trace" not in r.headers
        r = httpx.get(c.url + "/v1/files/old")
        assert (r.status_code, r.headers["location"]) == (307, "/v1/files/new-place")


def test_readyz_and_error_bodies_show_ids_and_states_not_urls_or_internals(
    hostile_gateway: HostileGatewayFactory,
) -> None:
    # Defect 10: /readyz showed engine URLs and raw error text; 502s named exception classes.
    engine_ = engine({"/v1/chat/completions": steps(b"\x00garbage\r\n\r\n", 0.0)})
    with engine_.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"bad": url}, health={"interval_s": 60})
        r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
        assert (r.status_code, r.json()["error"]["message"]) == (502, "backend bad failed before answering")
        ready = asyncio.run(readyz_from(c, ("10.1.2.3", 40000)))  # any client not on loopback
        port = url.rsplit(":", 1)[1]
        assert "127.0.0.1" not in ready and port not in ready
        assert json.loads(ready)["backends"] == {"bad": {"state": "ready", "reason": "canary passed"}}
        # On loopback (an operator on the host): the lifecycle's full status.
        local = httpx.get(c.url + "/readyz").json()["backends"]["bad"]
        assert (local["state"], local["circuit"], local["routable"]) == ("ready", "closed", True)


async def readyz_from(c: HostileGateway, client: tuple[str, int]) -> str:
    transport = httpx.ASGITransport(app=c.server.config.app, client=client)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as http:
        return (await http.get("/readyz")).text


LEAKY = b'{"error": {"message": "pg://db-7.internal.corp:5432: connection refused", "type": "server_error"}}'


def leaky(status: int, **headers: str) -> Script:
    return steps(response(status, LEAKY, {"content-type": "application/json", **headers}))


def test_engine_5xx_bodies_are_relayed_as_they_are_by_default(hostile_gateway: HostileGatewayFactory) -> None:
    engine_ = engine({"/v1/chat/completions": leaky(500)})
    with engine_.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"bad": url})
        r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.content) == (500, LEAKY)


def test_hidden_engine_errors_keep_the_status_and_withhold_the_body(
    hostile_gateway: HostileGatewayFactory, gateway_log: pytest.LogCaptureFixture
) -> None:
    routes: dict[str, Script | Sequence[Script]] = {
        "/v1/chat/completions": [
            leaky(500),
            leaky(503, **{"retry-after": "7"}),
            leaky(502, **{"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}),  # only seconds are relayed
        ],
        "/v1/embeddings": leaky(500),  # a passthrough route: the same relay
    }
    engine_ = engine(routes)
    with engine_.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"bad": url}, server={"hide_engine_errors": True})
        got = []
        for path, body, status in [
            ("/v1/chat/completions", CHAT, 500),
            ("/v1/chat/completions", CHAT, 503),
            ("/v1/chat/completions", CHAT, 502),
            ("/v1/embeddings", {"model": "m", "input": "x"}, 500),
        ]:
            gateway_log.clear()
            r = httpx.post(c.url + path, json=body)
            assert r.json() == {
                "error": {
                    "message": f"backend bad failed to answer (HTTP {status}); the details are withheld",
                    "type": "server_error",
                    "param": None,
                    "code": "engine_error",
                }
            }
            assert b"internal" not in r.content
            got.append((r.status_code, r.headers.get("retry-after")))
            assert_one_line(
                gateway_log, f"backend bad answered {status}; its body is withheld from the client"
            )
    assert got == [(500, None), (503, "7"), (502, None), (500, None)]
    paths = [q.path for q in engine_.requests if q.path not in ("/health", "/metrics")]  # probes, scrapes
    assert paths == ["/v1/chat/completions"] * 3 + ["/v1/embeddings"]
    assert c.gateway.metrics.tally.requests[("bad", RequestOutcome.HTTP_5XX)] == 4
    assert c.gateway.registry.total_in_flight() == 0


def test_a_well_behaved_engine_is_unaffected(hostile_gateway: HostileGatewayFactory) -> None:
    engine_ = engine({"/v1/chat/completions": ok_json({"id": "x", "choices": []})})
    with engine_.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"ok": url})
        assert httpx.post(c.url + "/v1/chat/completions", json=CHAT).json() == {"id": "x", "choices": []}


def test_a_huge_response_head_is_cut_at_the_limit_and_the_gateway_stays_responsive(
    hostile_gateway: HostileGatewayFactory,
) -> None:
    # Defect 4 (engine side): 64 MiB of response header stalled the loop 2.2 s and grew RSS.
    engine_ = engine({"/v1/chat/completions": huge_headers(64 << 20)})
    with engine_.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"big": url}, health={"interval_s": 60})
        done: list[httpx.Response] = []
        worker = threading.Thread(
            target=lambda: done.append(httpx.post(c.url + "/v1/chat/completions", json=CHAT))
        )
        worker.start()
        # The gateway answers its own health check while the head streams in (no wall-clock bound: a busy
        # machine is slow, not stalled; the cost per byte is bounded by the limit cut asserted below).
        while worker.is_alive():
            assert httpx.get(c.url + "/healthz", timeout=30).status_code == 200
            worker.join(0.05)
        r = done[0]
        assert (r.status_code, r.json()["error"]["message"]) == (502, "backend big failed before answering")


def test_a_trickling_health_endpoint_fails_its_probe_and_delays_no_other_backend(
    hostile_gateway: HostileGatewayFactory,
) -> None:
    # Defect 5: one slow /health stalled every probe; the trickling engine stayed READY.
    slow = HostileEngine({"/health": trickle(response(200, b"ok" * 20), every_s=0.3)})  # 12 s in all
    sick = FakeEngine("ok", healthy=False)
    with slow.serve() as url:
        c = hostile_gateway(
            engines=[sick],
            raw_engines={"slow": url},
            health={"interval_s": 0.2, "timeout_s": SLOW_PROBE_S, "fail_threshold": 1},
        )
        backends = c.gateway.registry.backends
        c.wait_for(lambda: backends["slow"].state.value == "down", "slow down", SLOW_PROBE_S + WAIT_S)
        # Wait for the probe of "ok" after that (still a 503; nothing announces a probe that changes no
        # state, so poll): the next one is then due while "slow" is in its next probe.
        seen, deadline = backends["ok"].last_checked, time.monotonic() + WAIT_S
        while backends["ok"].last_checked == seen:
            assert time.monotonic() < deadline, "ok never probed again"
            time.sleep(0.01)
        sick.healthy = True  # a restarted engine answering 200 is READY again within a probe interval or two
        t = time.monotonic()
        c.wait_for(lambda: backends["ok"].state.value == "ready", "ok ready", WAIT_S)
        # Behind the slow probe it would wait for most of SLOW_PROBE_S; half of it allows a loaded machine.
        assert time.monotonic() - t < SLOW_PROBE_S / 2
        assert backends["slow"].state.value == "down"
