"""Hostile session identities: too long, control characters, JSON-ish user ids, wrong types. Each is a 400
naming its source (logged once, without the value) or is simply no identity; never a 500, never an engine."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hostile_gateway import HostileGateway, assert_one_line, lines
from hostile_net import RawClient

CHAT = "/v1/chat/completions"
BODY: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def c(shared_gateway: HostileGateway) -> HostileGateway:
    shared_gateway.engines["a"].requests.clear()
    return shared_gateway


def _refused(c: HostileGateway, r: httpx.Response, param: str, why: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_request", param)
    assert err["message"].startswith(f"session identity from {param} {why}")
    assert c.engines["a"].requests == []
    assert c.gateway.registry.total_in_flight() == 0


@pytest.mark.parametrize(
    ("headers", "body", "param", "why"),
    [
        ({"x-claude-code-session-id": "s" * 10_000}, BODY, "header:x-claude-code-session-id",
         "is longer than"),
        ({"session_id": "a\tb"}, BODY, "header:session_id", "holds \\u0009"),
        ({"x-session-id": "é" * 300}, BODY, "header:x-session-id", "is longer than"),
        ({}, {**BODY, "prompt_cache_key": "k\u0000"}, "body:prompt_cache_key", "holds \\u0000"),
        ({}, {**BODY, "prompt_cache_key": "k\u001b[31m"}, "body:prompt_cache_key", "holds \\u001b"),
        ({}, {**BODY, "prompt_cache_key": "k" * 257}, "body:prompt_cache_key", "is longer than"),
        ({}, {**BODY, "metadata": {"user_id": json.dumps({"session_id": "s\n"})}},
         "body-session:metadata.user_id", "holds \\u000a"),
        ({"x-session-affinity": "ok", "x-claude-code-agent-id": "a" * 300}, BODY,
         "header:x-claude-code-agent-id", "is longer than"),
    ],
)  # fmt: skip
def test_a_hostile_identity_is_a_400_naming_its_source_logged_once_without_the_value(
    c: HostileGateway,
    gateway_log: pytest.LogCaptureFixture,
    headers: dict[str, str],
    body: dict[str, Any],
    param: str,
    why: str,
) -> None:
    gateway_log.clear()
    raw = json.dumps(body).encode()
    r = httpx.post(c.url + CHAT, content=raw, headers={k: v.encode() for k, v in headers.items()})
    _refused(c, r, param, why)
    assert_one_line(gateway_log, f"session identity from {param}")
    logged = " ".join(rec.getMessage() for rec in lines(gateway_log))
    for value in headers.values():
        assert value[:20] not in logged  # values are never logged
    assert "k\u0000" not in logged and "s" * 100 not in logged


def test_a_lone_surrogate_in_a_body_identity_is_a_400_not_a_500(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture
) -> None:
    gateway_log.clear()
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "\\ud800"}'
    r = httpx.post(c.url + CHAT, content=raw)
    _refused(c, r, "body:prompt_cache_key", "holds \\ud800")
    assert_one_line(gateway_log, "session identity from body:prompt_cache_key")


@pytest.mark.parametrize(
    ("byte", "says"),
    [
        (b"\x01", "invalid HTTP request"),  # the HTTP parser refuses C0 controls and DEL itself
        (b"\x7f", "invalid HTTP request"),
        (b"\x85", "session identity from header:x-claude-code-session-id holds \\u0085"),  # obs-text: ours
        (b"\x9b", "session identity from header:x-claude-code-session-id holds \\u009b"),
    ],
)
def test_control_bytes_in_a_raw_header_value_never_reach_an_engine(
    c: HostileGateway, byte: bytes, says: str
) -> None:
    raw = json.dumps(BODY).encode()
    head = (b"POST " + CHAT.encode() + b" HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"x-claude-code-session-id: a" + byte + b"b\r\nconnection: close\r\n")  # fmt: skip
    with RawClient.to(c.url) as client:
        r = client.request(head + b"content-length: %d\r\n\r\n" % len(raw) + raw)
    assert r.status == 400, r.body
    assert r.json()["error"]["message"].startswith(says)
    assert c.engines["a"].requests == []
    assert c.gateway.registry.total_in_flight() == 0


def test_a_header_past_the_servers_limit_is_refused_by_the_server(c: HostileGateway) -> None:
    r = httpx.post(c.url + CHAT, json=BODY, headers={"x-claude-code-session-id": "s" * 200_000})
    assert r.status_code in (400, 431), r.text
    assert c.engines["a"].requests == []


@pytest.mark.parametrize(
    "user_id",
    [
        '{"a":' + "[" * 2000 + "]" * 2000 + "}",  # parses past the recursion limit: no session, no error
        "{" * 100_000,  # past the length bound: not parsed at all
        '{"session_id": ["not", "a", "string"]}',
        '{"session_id": "unterminated',
        f"user_{'0' * 64}",  # a user, no session
        "",
    ],
)
def test_a_json_ish_or_sessionless_user_id_is_no_identity_and_goes_through(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture, user_id: str
) -> None:
    gateway_log.clear()
    body = {**BODY, "metadata": {"user_id": user_id}}
    raw = json.dumps(body).encode()
    r = httpx.post(c.url + CHAT, content=raw)
    assert r.status_code == 200, r.text
    assert c.engines["a"].requests == [body]  # forwarded as sent
    assert not [rec for rec in lines(gateway_log) if rec.name == "warmroute.identity"]


@pytest.mark.parametrize("value", [5, ["s"], {"id": "s"}, None, True])
def test_identity_fields_of_other_types_are_the_engines_business(c: HostileGateway, value: Any) -> None:
    body = {**BODY, "prompt_cache_key": value, "metadata": {"user_id": value}}
    r = httpx.post(c.url + CHAT, json=body)
    assert r.status_code == 200, r.text
    assert c.engines["a"].requests == [body]


def test_metadata_of_the_wrong_type_is_no_identity(c: HostileGateway) -> None:
    for metadata in ("user_x_session_y", ["user_id"], 3):
        assert httpx.post(c.url + CHAT, json={**BODY, "metadata": metadata}).status_code == 200
