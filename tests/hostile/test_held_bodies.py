"""A worker holds at most ``limits.max_held_body_bytes`` of request bodies at once, over every request in
flight: slow uploads or large requests waiting on engines cannot add up to more, whatever their number."""

from __future__ import annotations

import json
import time

import pytest
from hostile_gateway import HostileGatewayFactory, assert_one_line
from hostile_net import RawClient

from gateway.inbound import BodyBudget

BUDGET = 4096
HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"


def _chat(size: int) -> bytes:
    empty = json.dumps({"model": "m", "messages": [{"role": "user", "content": ""}]})
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * (size - len(empty))}]})
    return body.encode()


def _head(length: int) -> bytes:
    return b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n" + b"content-length: %d\r\n\r\n" % length


def _until_held(budget: BodyBudget, n: int) -> None:
    """The gateway charges a body when its app starts reading it, on the server's own loop thread."""
    deadline = time.monotonic() + 10
    while budget.held != n:
        assert time.monotonic() < deadline, f"held {budget.held}, never {n}"
        time.sleep(0.005)


def test_a_body_that_would_pass_the_budget_is_503_with_retry_after_and_the_budget_comes_back(
    hostile_gateway: HostileGatewayFactory, gateway_log: pytest.LogCaptureFixture
) -> None:
    c = hostile_gateway(limits={"max_held_body_bytes": BUDGET, "body_read_timeout_s": 30})
    budget = c.gateway.body_budget
    first, second = _chat(3000), _chat(2000)
    with RawClient(c.port) as slow:
        slow.send(_head(len(first)) + first[:100])  # declared 3000 bytes: charged at once, then held
        _until_held(budget, 3000)
        gateway_log.clear()
        with RawClient(c.port) as other:
            r = other.request(_head(len(second)) + second)
        assert (r.status, r.error_code(), r.headers["retry-after"]) == (503, "server_busy", "1")
        assert "already holds 3000 bytes of request bodies (limit 4096)" in r.json()["error"]["message"]
        assert_one_line(gateway_log, "503 server_busy")
        slow.send(first[100:])
        assert slow.read_response().status == 200
    assert c.engines["a"].raw == [first]  # the refused body never reached an engine
    _until_held(budget, 0)
    with RawClient(c.port) as again:  # the budget came back: the same body is served now
        assert again.request(_head(len(second)) + second).status == 200
    assert c.engines["a"].raw == [first, second]
    _until_held(budget, 0)


def test_the_budget_comes_back_when_the_client_goes_away_mid_body(
    hostile_gateway: HostileGatewayFactory,
) -> None:
    c = hostile_gateway(limits={"max_held_body_bytes": BUDGET})
    budget = c.gateway.body_budget
    body = _chat(3000)
    with RawClient(c.port) as gone:
        gone.send(_head(len(body)) + body[:10])
        _until_held(budget, 3000)
    _until_held(budget, 0)
    assert c.engines["a"].raw == []
    with RawClient(c.port) as probe:
        assert probe.request(_head(len(body)) + body).status == 200
