"""Slow or idle clients are cut off on deadlines, not held forever (each of these sockets used to stay open,
unanswered, for as long as the client liked). Deadlines here: head 0.5 s, body silence 0.5 s."""

from __future__ import annotations

import threading
import time

import pytest
from hostile_gateway import HostileGateway, HostileGatewayFactory, assert_one_line, lines
from hostile_net import RawClient, RawResponse, post

CHAT_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
CHAT_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture
def c(hostile_gateway: HostileGatewayFactory) -> HostileGateway:
    return hostile_gateway()


def _timed_out(raw: RawClient, within: float) -> RawResponse:
    """The 408 the gateway must send, and the close right after it."""
    r = raw.read_response(within)
    assert r.status == 408, r
    assert r.error_code() == "request_timeout"
    assert r.headers["connection"] == "close"
    assert raw.wait_closed(1.0) == b""
    return r


def test_a_socket_that_sends_nothing_is_closed_after_the_head_deadline(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture
) -> None:
    gateway_log.clear()
    with RawClient(c.port) as raw:
        assert raw.silent_for(0.3)  # not cut before the deadline
        started = time.monotonic()
        assert raw.wait_closed(2.0) == b""  # closed without an answer: nobody asked anything
        assert time.monotonic() - started < 0.6
    assert lines(gateway_log) == []  # an idle socket is routine, not worth a line


@pytest.mark.parametrize(
    "partial",
    [b"GET /heal", b"GET /healthz HTTP/1.1\r\nhost: x\r\nx-a: b"],
    ids=["partial-request-line", "partial-headers"],
)
def test_a_partial_head_gets_408_after_the_head_deadline(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture, partial: bytes
) -> None:
    with RawClient(c.port) as raw:
        raw.send(partial)
        gateway_log.clear()
        r = _timed_out(raw, 2.0)
    assert "request head not complete within 0.5 s" in r.json()["error"]["message"]
    assert_one_line(gateway_log, "408 request_timeout")


def test_a_head_trickled_a_byte_at_a_time_still_meets_the_deadline(c: HostileGateway) -> None:
    """The head deadline is total, not per byte: slowloris gets 408 at 0.5 s however steady it is."""
    stop = threading.Event()
    with RawClient(c.port) as raw:
        raw.send(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")

        def drip() -> None:
            while not stop.wait(0.05):
                try:
                    raw.send(b"x")
                except OSError:
                    return

        dripper = threading.Thread(target=drip, daemon=True)
        started = time.monotonic()
        dripper.start()
        try:
            _timed_out(raw, 2.0)
            assert time.monotonic() - started < 1.0
        finally:
            stop.set()
            dripper.join(2)


def test_the_next_request_on_a_keep_alive_connection_has_its_own_head_deadline(c: HostileGateway) -> None:
    with RawClient(c.port) as raw:
        assert raw.request(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").status == 200
        raw.send(b"GET /healthz HTTP/1.1\r\nhost")
        _timed_out(raw, 2.0)


def test_a_body_shorter_than_its_content_length_gets_408(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture
) -> None:
    with RawClient(c.port) as raw:
        raw.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + CHAT_BODY[:10]
        )
        gateway_log.clear()
        r = _timed_out(raw, 2.0)
    assert r.json()["error"]["message"] == "request body stalled: nothing received for 0.5 s"
    assert c.engines["a"].requests == []
    assert_one_line(gateway_log, "408 request_timeout")


def test_a_chunked_body_that_never_ends_gets_408(c: HostileGateway) -> None:
    with RawClient(c.port) as raw:
        raw.send(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
        raw.send(b"%x\r\n%s\r\n" % (len(CHAT_BODY), CHAT_BODY))  # the whole JSON, but no last chunk
        _timed_out(raw, 2.0)
    assert c.engines["a"].requests == []


def test_a_slow_but_steady_body_is_not_cut_off(c: HostileGateway) -> None:
    """The body deadline is silence, not total time: 1.2 s of body in 0.2 s steps passes a 0.5 s limit."""
    with RawClient(c.port) as raw:
        raw.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n" % len(CHAT_BODY)
        )
        step = len(CHAT_BODY) // 6 + 1
        for i in range(0, len(CHAT_BODY), step):
            time.sleep(0.2)
            raw.send(CHAT_BODY[i : i + step])
        r = raw.read_response(5.0)
    assert r.status == 200, r
    assert c.engines["a"].requests == [{"model": "m", "messages": [{"role": "user", "content": "hi"}]}]


def _trickle(raw: RawClient, data: bytes, every_s: float, stop: threading.Event) -> threading.Thread:
    def drip() -> None:
        for i in range(len(data)):
            if stop.wait(every_s):
                return
            try:
                raw.send(data[i : i + 1])
            except OSError:
                return

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    return dripper


def test_a_body_trickled_slower_than_the_minimum_rate_gets_408_at_the_whole_body_deadline(
    hostile_gateway: HostileGatewayFactory, gateway_log: pytest.LogCaptureFixture
) -> None:
    """Never silent for the 0.5 s silence limit, yet slow: the whole-body deadline (1 s, plus 1 s per
    1000 bytes) cuts it. It used to stay open, unanswered, for as long as the client liked."""
    c = hostile_gateway(limits={"body_deadline_s": 1.0, "body_min_bytes_per_s": 1000})
    stop = threading.Event()
    with RawClient(c.port) as raw:
        raw.send(CHAT_HEAD % len(CHAT_BODY))
        gateway_log.clear()
        started = time.monotonic()
        dripper = _trickle(raw, CHAT_BODY, 0.1, stop)
        try:
            r = _timed_out(raw, 10.0)
        finally:
            stop.set()
            dripper.join(2)
    assert time.monotonic() - started >= 1.0
    assert r.json()["error"]["message"].startswith("request body too slow: ")
    assert c.engines["a"].requests == []
    assert_one_line(gateway_log, "408 request_timeout: request body too slow")


def test_a_body_faster_than_the_minimum_rate_may_take_longer_than_the_deadline(
    hostile_gateway: HostileGatewayFactory,
) -> None:
    """Each byte buys 1/rate s: 64 bytes at about 40 B/s with a 0.3 s deadline and a 10 B/s minimum."""
    c = hostile_gateway(limits={"body_deadline_s": 0.3, "body_min_bytes_per_s": 10})
    with RawClient(c.port) as raw:
        raw.send(CHAT_HEAD % len(CHAT_BODY) + CHAT_BODY[:8])
        for i in range(8, len(CHAT_BODY), 8):
            time.sleep(0.2)
            raw.send(CHAT_BODY[i : i + 8])
        r = raw.read_response(5.0)
    assert r.status == 200, r
    assert c.engines["a"].requests == [{"model": "m", "messages": [{"role": "user", "content": "hi"}]}]


def test_a_client_that_waits_for_100_continue_gets_it_and_then_its_deadline(c: HostileGateway) -> None:
    with RawClient(c.port) as raw:
        raw.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
            b"content-length: %d\r\n\r\n" % len(CHAT_BODY)
        )
        assert raw.read_response(2.0).status == 100
        time.sleep(0.2)
        raw.send(CHAT_BODY)
        assert raw.read_response(5.0).status == 200


def test_well_behaved_requests_are_untouched(c: HostileGateway) -> None:
    with RawClient(c.port) as raw:
        for _ in range(3):
            assert raw.request(post("/v1/chat/completions", CHAT_BODY)).status == 200
        time.sleep(0.7)  # idle between requests: uvicorn's keep-alive (5 s), not the head deadline
        assert raw.request(post("/v1/chat/completions", CHAT_BODY)).status == 200
