"""Slow or idle clients are cut off on deadlines, not held forever (each of these sockets used to stay open,
unanswered, for as long as the client liked). Deadlines here: head 0.5 s, body silence 0.5 s.

Nothing here depends on how fast the machine is. A deadline never fires early, so "not before" is measured
from before the client connects; "soon after" allows a loaded machine's stalls (LATE_S) and stays well short
of what would close the socket otherwise (uvicorn's 5 s keep-alive, or never). Waits for an answer give up
only after WAIT_S. A test that needs a client to keep pace either makes the limit it must not reach long
beside its pace, or counts only a run in which the client really kept pace."""

from __future__ import annotations

import threading
import time

import pytest
from hostile_gateway import LATE_S, WAIT_S, HostileGateway, HostileGatewayFactory, assert_one_line, lines
from hostile_net import RawClient, RawResponse, post

CHAT_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n"
CHAT_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
#: A silence limit for tests about other limits: no stall of a loaded machine reaches it.
NO_SILENCE_LIMIT = {"body_read_timeout_s": 60.0}


@pytest.fixture
def c(hostile_gateway: HostileGatewayFactory) -> HostileGateway:
    return hostile_gateway()


def _timed_out(raw: RawClient) -> RawResponse:
    """The 408 the gateway must send, and the close right after it."""
    r = raw.read_response(WAIT_S)
    assert r.status == 408, r
    assert r.error_code() == "request_timeout"
    assert r.headers["connection"] == "close"
    assert raw.wait_closed(WAIT_S) == b""
    return r


def test_a_socket_that_sends_nothing_is_closed_after_the_head_deadline(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture
) -> None:
    gateway_log.clear()
    connecting = time.monotonic()  # the deadline runs from the accept, after this
    with RawClient(c.port) as raw:
        assert raw.wait_closed(WAIT_S) == b""  # closed without an answer: nobody asked anything
        closed = time.monotonic()
    assert 0.5 <= closed - connecting < 0.5 + LATE_S
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
        r = _timed_out(raw)
    assert "request head not complete within 0.5 s" in r.json()["error"]["message"]
    assert_one_line(gateway_log, "408 request_timeout")


def test_a_head_trickled_a_byte_at_a_time_still_meets_the_deadline(c: HostileGateway) -> None:
    """The head deadline is total, not per byte: slowloris gets 408 at 0.5 s however steady it is."""
    stop = threading.Event()
    connecting = time.monotonic()
    with RawClient(c.port) as raw:
        raw.send(b"GET /healthz HTTP/1.1\r\nhost: x\r\n")

        def drip() -> None:
            while not stop.wait(0.05):
                try:
                    raw.send(b"x")
                except OSError:
                    return

        dripper = threading.Thread(target=drip, daemon=True)
        dripper.start()
        try:
            _timed_out(raw)  # a per-byte deadline would never come: the drip goes on until the 408
            assert time.monotonic() - connecting < 0.5 + LATE_S
        finally:
            stop.set()
            dripper.join(2)


def test_the_next_request_on_a_keep_alive_connection_has_its_own_head_deadline(c: HostileGateway) -> None:
    with RawClient(c.port) as raw:
        assert raw.request(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n").status == 200
        raw.send(b"GET /healthz HTTP/1.1\r\nhost")
        _timed_out(raw)


def test_a_body_shorter_than_its_content_length_gets_408(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture
) -> None:
    with RawClient(c.port) as raw:
        raw.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + CHAT_BODY[:10]
        )
        gateway_log.clear()
        r = _timed_out(raw)
    assert r.json()["error"]["message"] == "request body stalled: nothing received for 0.5 s"
    assert c.engines["a"].requests == []
    assert_one_line(gateway_log, "408 request_timeout")


def test_a_chunked_body_that_never_ends_gets_408(c: HostileGateway) -> None:
    with RawClient(c.port) as raw:
        raw.send(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n")
        raw.send(b"%x\r\n%s\r\n" % (len(CHAT_BODY), CHAT_BODY))  # the whole JSON, but no last chunk
        _timed_out(raw)
    assert c.engines["a"].requests == []


def _send_steadily(raw: RawClient, data: bytes, every_s: float, gaps: list[float]) -> None:
    """``data`` a byte at a time, ``every_s`` apart; ``gaps`` gets the time between sends there really was
    (a loaded machine can stall the sender far past ``every_s``)."""
    last = time.monotonic()
    for i in range(len(data)):
        time.sleep(every_s)
        now = time.monotonic()
        gaps.append(now - last)
        raw.send(data[i : i + 1])
        last = now


def test_a_slow_but_steady_body_is_not_cut_off(hostile_gateway: HostileGatewayFactory) -> None:
    """The body deadline is silence, not total time: 63 bytes 25 ms apart (1.5 s at least) pass a 1 s limit.
    A 408 is right only after a silence of 1 s, so only a run whose longest gap stayed under half of that
    counts; a run the machine stalled for longer (it used to fail here, cut off mid-body) is run again."""
    c = hostile_gateway(limits={"body_read_timeout_s": 1.0})
    for _attempt in range(5):
        gaps: list[float] = []
        with RawClient(c.port) as raw:
            raw.send(CHAT_HEAD % len(CHAT_BODY))
            try:
                _send_steadily(raw, CHAT_BODY, 0.025, gaps)
                r: RawResponse | OSError = raw.read_response(WAIT_S)
            except OSError as cut:  # the gateway answered and closed while the body was still coming
                r = cut
        if max(gaps) < 0.5:
            break
    else:
        pytest.fail(f"the client was never steady: its longest gaps were {max(gaps):.2f} s and more")
    assert isinstance(r, RawResponse) and r.status == 200, (r, max(gaps))
    assert sum(gaps) > 1.0  # longer than the limit in all: only silence counts
    assert c.engines["a"].requests[-1:] == [{"model": "m", "messages": [{"role": "user", "content": "hi"}]}]


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
    c = hostile_gateway(limits={"body_deadline_s": 1.0, "body_min_bytes_per_s": 1000, **NO_SILENCE_LIMIT})
    stop = threading.Event()
    started = time.monotonic()  # before the head: the deadline runs from the gateway's reading it
    with RawClient(c.port) as raw:
        raw.send(CHAT_HEAD % len(CHAT_BODY))
        gateway_log.clear()
        dripper = _trickle(raw, CHAT_BODY, 0.1, stop)
        try:
            r = _timed_out(raw)
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
    """Each byte buys 1/rate s: 64 bytes over 0.7 s at least (8 every 0.1 s) with a 0.3 s deadline and a 1 B/s
    minimum (8 bytes buy 8 s: no stall of a loaded machine uses that up)."""
    c = hostile_gateway(limits={"body_deadline_s": 0.3, "body_min_bytes_per_s": 1, **NO_SILENCE_LIMIT})
    with RawClient(c.port) as raw:
        raw.send(CHAT_HEAD % len(CHAT_BODY) + CHAT_BODY[:8])
        for i in range(8, len(CHAT_BODY), 8):
            time.sleep(0.1)
            raw.send(CHAT_BODY[i : i + 8])
        r = raw.read_response(WAIT_S)
    assert r.status == 200, r
    assert c.engines["a"].requests == [{"model": "m", "messages": [{"role": "user", "content": "hi"}]}]


def test_a_client_that_waits_for_100_continue_gets_it_and_then_its_deadline(
    hostile_gateway: HostileGatewayFactory,
) -> None:
    c = hostile_gateway(limits={"body_read_timeout_s": 5.0})  # a pause after the 100 far under the limit
    with RawClient(c.port) as raw:
        raw.send(
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
            b"content-length: %d\r\n\r\n" % len(CHAT_BODY)
        )
        assert raw.read_response(WAIT_S).status == 100
        time.sleep(0.2)
        raw.send(CHAT_BODY)
        assert raw.read_response(WAIT_S).status == 200


def test_well_behaved_requests_are_untouched(c: HostileGateway) -> None:
    with RawClient(c.port) as raw:
        for _ in range(3):
            assert raw.request(post("/v1/chat/completions", CHAT_BODY)).status == 200
        time.sleep(0.7)  # idle between requests: uvicorn's keep-alive (5 s), not the head deadline
        assert raw.request(post("/v1/chat/completions", CHAT_BODY)).status == 200
