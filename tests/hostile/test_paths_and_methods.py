"""Defect 8: request paths that could resolve outside /v1 on an engine or a front proxy that normalises
dot-segments (nginx does), and methods nobody should forward. Sent with a raw socket: HTTP libraries
normalise these before they leave."""

from __future__ import annotations

import json

import httpx
import pytest
from hostile_gateway import HostileGateway, HostileGatewayFactory
from hostile_net import RawClient

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


@pytest.fixture
def c(hostile_gateway: HostileGatewayFactory) -> HostileGateway:
    return hostile_gateway()


def raw_request(
    c: HostileGateway, method: str, target: str, body: bytes = b""
) -> tuple[int, dict[str, object]]:
    with RawClient(c.port) as client:
        client.send(
            f"{method} {target} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode("latin-1")
            + body
        )
        data = b""
        while chunk := client.recv(5):
            data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(payload)


@pytest.mark.parametrize(
    "target",
    [
        "/v1/../admin",
        "/v1/%2e%2e/admin",
        "/v1/%2E%2e/admin",
        "/v1/..%2Fadmin",
        "/v1/files/..%2f..%2fadmin",
        "/v1/files/%252e%252e/admin",  # decodes to %2e%2e: an engine that decodes again sees ..
        "/v1//files",
        "/v1/files/%00",
        "/v1/files\\..\\admin",
        "/v1/files/%5c..%5cadmin",
        "/v1/./files",
    ],
)
def test_paths_that_could_escape_v1_are_refused_and_never_reach_the_engine(
    c: HostileGateway, target: str
) -> None:
    status, body = raw_request(c, "GET", target)
    assert (status, body["error"]["code"]) == (400, "invalid_request")  # type: ignore[index]
    assert c.engines["a"].paths == []


@pytest.mark.parametrize("method", ["TRACE", "PROPFIND", "CONNECT", "PATCH"])
def test_unsafe_methods_are_refused(c: HostileGateway, method: str) -> None:
    target = "127.0.0.1:1" if method == "CONNECT" else "/v1/files"
    status, body = raw_request(c, method, target)
    assert status in (400, 405)
    assert c.engines["a"].paths == [] and c.engines["a"].requests == []
    if status == 405:
        assert body["error"]["code"] == "method_not_allowed"  # type: ignore[index]


def test_a_trailing_slash_gets_validation_and_affinity_not_the_engine_verbatim(c: HostileGateway) -> None:
    r = httpx.post(c.url + "/v1/chat/completions/", json={"model": "m", "messages": "not a list"})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "messages")
    r = httpx.post(c.url + "/v1/chat/completions/", json=CHAT)
    assert (r.status_code, r.headers["x-warmroute-route"]) == (200, "new_cheapest")  # the default: ttft
    assert c.engines["a"].paths == ["/v1/chat/completions"]


def test_ordinary_passthrough_paths_and_queries_still_work(c: HostileGateway) -> None:
    r = httpx.get(c.url + "/v1/files/file-abc.jsonl?purpose=batch&after=a%2Bb")
    assert r.status_code == 200
    assert c.engines["a"].paths == ["/v1/files/file-abc.jsonl?purpose=batch&after=a%2Bb"]
    assert httpx.delete(c.url + "/v1/files/file-abc").status_code == 200
