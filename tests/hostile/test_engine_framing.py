"""An engine that gets HTTP/1.1 framing wrong, through raw sockets: a status outside 100-599, a Content-Length
on a response that has no body, bytes after its answer, a transfer coding it made up. Each test names the
defect it proves fixed.
"""

from __future__ import annotations

import asyncio
import json
import select
import threading
from typing import Any

import httpx
import pytest
from hostile_engine import (
    CLOSE,
    Conn,
    HostileEngine,
    RawRequest,
    Script,
    head_then_silence,
    ok_json,
    response,
    steps,
    stray_on_reuse,
)
from hostile_gateway import HostileGateway, HostileGatewayFactory, assert_one_line, lines
from hostile_net import RawClient

from gateway.outcomes import AttemptOutcome
from gateway.upstream import UpstreamPool, UpstreamResponse

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
RR = {"policy": "round_robin"}  # deterministic: the first request goes to "a" (sorted ids)
FORGED = response(418, b'{"forged": true}', {"x-ratelimit-forged": "1", "content-type": "application/json"})


def engine(routes: dict[str, Script | list[Script]]) -> HostileEngine:
    """A hostile engine whose /health is fine: the health checker keeps it READY, so traffic reaches it."""
    return HostileEngine({"/health": steps(response(200)), **routes})


def sent(e: HostileEngine, path: str) -> list[tuple[str, bytes]]:
    return [(r.method, r.body) for r in e.requests if r.path == path]


def chats(e: HostileEngine) -> list[object]:
    return [json.loads(body) for _method, body in sent(e, "/v1/chat/completions")]


def breaker_failures(c: HostileGateway, backend: str) -> int:
    return c.gateway.fleet.controllers[backend].breaker.consecutive_failures


def attempts(c: HostileGateway) -> dict[tuple[str, AttemptOutcome], int]:
    return dict(c.gateway.metrics.tally.attempts)


# -- F7: a status outside 100-599 is a protocol error ------------------------------------------------------


@pytest.mark.parametrize("status", ["600", "999", "000", "099"])
def test_a_status_outside_100_599_is_retried_on_the_next_engine_and_fails_the_breaker(
    hostile_gateway: HostileGatewayFactory, gateway_log: pytest.LogCaptureFixture, status: str
) -> None:
    # F7: 600/999 left the client with no response and two tracebacks; 000/099 with a body answered 500
    # from an assertion, with no retry and nothing for the breaker.
    head = f"HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}"
    bad = engine({"/v1/chat/completions": steps(head.encode())})
    good = engine({"/v1/chat/completions": ok_json({"id": "good"})})
    with bad.serve() as a, good.serve() as b:
        c = hostile_gateway(engines=[], raw_engines={"a": a, "b": b}, routing=RR, health={"interval_s": 60})
        gateway_log.clear()
        r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.json()) == (200, {"id": "good"})
    assert (r.headers["x-warmroute-backend"], r.headers["x-warmroute-route"]) == ("b", "retry_next")
    assert chats(bad) == chats(good) == [CHAT]  # each engine got the request once
    assert breaker_failures(c, "a") == 1
    assert attempts(c) == {("a", AttemptOutcome.BROKEN): 1, ("b", AttemptOutcome.OK): 1}
    assert_one_line(gateway_log, f"backend a failed before answering: {a} answered with status {status}")
    assert c.gateway.registry.total_in_flight() == 0


def test_an_invalid_status_with_nobody_else_to_ask_is_a_502_in_the_route_shape(
    hostile_gateway: HostileGatewayFactory, gateway_log: pytest.LogCaptureFixture
) -> None:
    bad = engine({"/v1/chat/completions": steps(b"HTTP/1.1 999 X\r\ncontent-length: 0\r\n\r\n")})
    with bad.serve() as a:
        c = hostile_gateway(engines=[], raw_engines={"a": a}, health={"interval_s": 60})
        gateway_log.clear()
        r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 502
    assert r.json() == {
        "error": {
            "message": "backend a failed before answering",
            "type": "server_error",
            "param": None,
            "code": "upstream_error",
        }
    }
    assert chats(bad) == [CHAT]
    assert breaker_failures(c, "a") == 1
    assert_one_line(gateway_log, "backend a failed before answering")
    assert c.gateway.registry.total_in_flight() == 0


@pytest.mark.parametrize("status", [204, 304])
def test_no_content_length_is_relayed_on_a_response_without_a_body(
    hostile_gateway: HostileGatewayFactory, gateway_log: pytest.LogCaptureFixture, status: int
) -> None:
    # F7: a 304 with `content-length: 10` cut the client's connection, with tracebacks.
    bodiless = f'HTTP/1.1 {status} X\r\ncontent-length: 10\r\netag: "v1"\r\n\r\n'.encode()
    e = engine({"/v1/files/f": steps(bodiless), "/v1/files/g": ok_json({"id": "g"})})
    with e.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"e": url}, health={"interval_s": 60})
        gateway_log.clear()
        with RawClient(c.port) as client:
            got = client.request(b"GET /v1/files/f HTTP/1.1\r\nhost: x\r\n\r\n")
            then = client.request(b"GET /v1/files/g HTTP/1.1\r\nhost: x\r\n\r\n")  # same connection
    assert (got.status, got.body, "content-length" in got.headers) == (status, b"", False)
    assert b"transfer-encoding" not in got.raw_head
    assert (then.status, then.json()) == (200, {"id": "g"})
    assert sent(e, "/v1/files/f") == [("GET", b"")]
    assert not [r.getMessage() for r in lines(gateway_log)]  # no traceback, nothing to report
    assert breaker_failures(c, "e") == 0


def test_no_content_length_is_relayed_for_head(
    hostile_gateway: HostileGatewayFactory, gateway_log: pytest.LogCaptureFixture
) -> None:
    e = engine({"/v1/files/f": steps(response(200, headers={"content-length": "10"}))})
    with e.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"e": url}, health={"interval_s": 60})
        gateway_log.clear()
        r = httpx.head(c.url + "/v1/files/f")
    assert (r.status_code, r.content, "content-length" in r.headers) == (200, b"", False)
    assert sent(e, "/v1/files/f") == [("HEAD", b"")]
    assert not [r.getMessage() for r in lines(gateway_log)]


# -- F8: upstream framing ----------------------------------------------------------------------------------


def test_a_second_response_in_the_same_read_reaches_no_client(hostile_gateway: HostileGatewayFactory) -> None:
    # F8: the forged head overrode the real one (the client saw 418 and x-ratelimit-forged).
    first = response(200, b'{"id": "first"}', {"content-type": "application/json"})
    e = engine({"/v1/chat/completions": [steps(first + FORGED), ok_json({"id": "second"})]})
    with e.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"e": url}, health={"interval_s": 60})
        with httpx.Client(base_url=c.url) as client:
            answers = [client.post("/v1/chat/completions", json=CHAT) for _ in range(3)]
    assert [(r.status_code, r.json()) for r in answers] == [
        (200, {"id": "first"}),
        (200, {"id": "second"}),
        (200, {"id": "second"}),
    ]
    assert not [r for r in answers if any(k.startswith("x-ratelimit") for k in r.headers)]
    assert chats(e) == [CHAT] * 3
    assert breaker_failures(c, "e") == 0  # the engine answered; it only spoiled its connection


def test_a_late_body_after_a_head_response_is_not_the_next_clients_answer(
    hostile_gateway: HostileGatewayFactory,
) -> None:
    # F8: the engine sends its HEAD "body" once the next request arrives on the same connection: that
    # request's client got the forged answer.
    head = response(200, headers={"content-length": str(len(FORGED))})
    e = engine({"/v1/files/f": stray_on_reuse(head, FORGED), "/v1/files/g": ok_json({"id": "g"})})
    with e.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"e": url}, health={"interval_s": 60})
        with httpx.Client(base_url=c.url) as client:
            headed = client.head("/v1/files/f")
            answers = [client.get("/v1/files/g") for _ in range(2)]
    assert (headed.status_code, headed.content) == (200, b"")
    assert [(r.status_code, r.json()) for r in answers] == [(200, {"id": "g"})] * 2
    assert [(r.method, r.path) for r in e.requests if r.path.startswith("/v1/files")] == [
        ("HEAD", "/v1/files/f"),
        ("GET", "/v1/files/g"),
        ("GET", "/v1/files/g"),
    ]


def test_an_unknown_transfer_coding_is_read_until_the_engine_closes(
    hostile_gateway: HostileGatewayFactory, gateway_log: pytest.LogCaptureFixture
) -> None:
    # F8: `transfer-encoding: xchunked` is not chunked: the body runs to the close (RFC 9112 §6.3); it was
    # cut as "closed mid-body".
    answer = b'{"id": "whole", "choices": []}'
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ntransfer-encoding: xchunked\r\n\r\n"
    e = engine({"/v1/chat/completions": [steps(head + answer[:10], 0.05, answer[10:], CLOSE)]})
    with e.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"e": url}, health={"interval_s": 60})
        gateway_log.clear()
        r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.content) == (200, answer)
    assert chats(e) == [CHAT]
    assert breaker_failures(c, "e") == 0
    assert not [r.getMessage() for r in lines(gateway_log)]


# -- F8: the pool checks an idle connection before reusing it ----------------------------------------------


@pytest.fixture(params=["asyncio", ("asyncio", {"use_uvloop": True})], ids=["asyncio", "uvloop"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


def answer_then_on_cue(answer: bytes, cue: threading.Event, then: bytes | None) -> Script:
    """Send ``answer``; once ``cue`` is set, send ``then`` on the now idle connection (None: close it)."""

    async def run(_request: RawRequest, conn: Conn) -> None:
        conn.writer.write(answer)
        await conn.writer.drain()
        await asyncio.get_running_loop().run_in_executor(None, cue.wait, 10)
        if then is None:
            conn.writer.close()
            return
        conn.writer.write(then)
        await conn.writer.drain()

    return run


def block_until_readable(pool: UpstreamPool, origin: str) -> None:
    """Block the event loop (so it cannot read them) until the bytes or the close reach the idle socket."""
    (conn,) = pool._origins[origin].idle
    assert conn.transport is not None
    poller = select.poll()
    poller.register(conn.transport.get_extra_info("socket").fileno(), select.POLLIN)
    assert poller.poll(10_000), "nothing arrived on the idle connection"


async def read_all(response: UpstreamResponse) -> bytes:
    try:
        return b"".join([chunk async for chunk in response.aiter_raw()])
    finally:
        await response.aclose()


@pytest.mark.anyio
async def test_bytes_waiting_on_an_idle_connection_are_never_the_next_answer(anyio_backend: Any) -> None:
    # F8: bytes an engine wrote after a complete response became the next request's answer.
    cue = threading.Event()
    first = response(200, b"first")
    e = HostileEngine({"/x": [answer_then_on_cue(first, cue, FORGED), steps(response(200, b"own"))]})
    with e.serve() as url:
        pool = UpstreamPool(connect_timeout=2.0)
        try:
            assert await read_all(await pool.request("GET", url, "/x", [], b"")) == b"first"
            cue.set()
            block_until_readable(pool, url)
            answer = await pool.request("GET", url, "/x", [], b"")
            assert (answer.status, answer.header(b"x-ratelimit-forged"), await read_all(answer)) == (
                200,
                None,
                b"own",
            )
        finally:
            await pool.aclose()
    assert (e.connections, [r.path for r in e.requests]) == (2, ["/x", "/x"])


@pytest.mark.anyio
async def test_a_close_waiting_on_an_idle_connection_sends_a_post_on_a_fresh_one(anyio_backend: Any) -> None:
    # A POST is never resent: on a connection the engine had already closed it would have failed.
    cue = threading.Event()
    e = HostileEngine(
        {"/x": [answer_then_on_cue(response(200, b"first"), cue, None), ok_json({"id": "own"})]}
    )
    with e.serve() as url:
        pool = UpstreamPool(connect_timeout=2.0)
        try:
            assert await read_all(await pool.request("GET", url, "/x", [], b"")) == b"first"
            cue.set()
            block_until_readable(pool, url)
            answer = await pool.request("POST", url, "/x", [], b"{}")
            assert (answer.status, await read_all(answer)) == (200, b'{"id": "own"}')
        finally:
            await pool.aclose()
    assert [(r.method, r.body) for r in e.requests] == [("GET", b""), ("POST", b"{}")]


# -- a saturated pool logs one line, not one per request ---------------------------------------------------


def test_requests_refused_by_a_saturated_pool_log_one_line(
    hostile_gateway: HostileGatewayFactory, gateway_log: pytest.LogCaptureFixture
) -> None:
    # 4,904 requests that waited for a busy upstream pool logged 4,904 identical WARNING lines.
    e = engine({"/v1/chat/completions": head_then_silence()})
    with e.serve() as url:
        c = hostile_gateway(
            engines=[],
            raw_engines={"e": url},
            health={"interval_s": 60},
            limits={"max_connections": 1},
            upstream={"pool_timeout_s": 0.05},
            timeouts={"read_s": 30},
        )
        gateway_log.clear()
        stream = {**CHAT, "stream": True}
        with httpx.stream("POST", c.url + "/v1/chat/completions", json=stream, timeout=10) as held:
            assert held.status_code == 200  # its head came: it holds the pool's one connection
            refused = [httpx.post(c.url + "/v1/chat/completions", json=CHAT, timeout=10) for _ in range(4)]
    assert [(r.status_code, r.json()["error"]["code"]) for r in refused] == [(503, "upstream_busy")] * 4
    busy = [r.getMessage() for r in lines(gateway_log) if "busy" in r.getMessage()]
    assert busy == [
        f"all 1 connections to {url} busy for 0.05 s: 1 request(s) refused (one line per 10 s at most)",
    ]
