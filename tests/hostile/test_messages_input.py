"""Hostile and malformed bodies on /v1/messages and /v1/messages/count_tokens: each is a 4xx in Anthropic's
error shape that names what is wrong, never a 500 or a hang; the hostile ones log one line, the ordinary
ones none; nothing reaches the engine and nothing stays in flight."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest
from hostile_gateway import HostileGateway, assert_one_line, lines, start_gateway
from messages_engine import AnthropicEngine

MSG = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
USER = b'{"role": "user", "content": "hi"}'


@pytest.fixture(scope="module")
def gateway() -> Iterator[HostileGateway]:
    with contextlib.ExitStack() as stack:
        yield start_gateway(
            stack,
            engines=[AnthropicEngine("a")],
            backend={"native_shapes": ["chat", "completions", "messages"]},
        )


@pytest.fixture
def c(gateway: HostileGateway) -> HostileGateway:
    gateway.engines["a"].requests.clear()
    return gateway


def _post(c: HostileGateway, raw: bytes, path: str = MSG) -> httpx.Response:
    return httpx.post(c.url + path, content=raw, headers={"content-type": "application/json"}, timeout=10)


def _refused(c: HostileGateway, r: httpx.Response, status: int, kind: str) -> str:
    """An Anthropic error of ``status``; the engine saw nothing and nothing is left in flight."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/json"
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert c.engines["a"].requests == []
    assert c.gateway.registry.total_in_flight() == 0
    message: str = body["error"]["message"]
    return message


def _body(fields: bytes, messages: bytes = USER) -> bytes:
    return b'{"model": "m", "max_tokens": 64, "messages": [' + messages + b"]" + fields + b"}"


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b'{"model": "m", "max_tokens": ', "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, not list"),
        (
            b'{"model": 5, "max_tokens": 64, "messages": [' + USER + b"]}",
            "'model' must be a non-empty string",
        ),
        (b'{"max_tokens": 64, "messages": [' + USER + b"]}", "'model' is required"),
        (b'{"model": "m", "messages": [' + USER + b"]}", "'max_tokens' is required"),
        (_body(b"").replace(b"64", b'"64"'), "'max_tokens' must be an integer"),
        (_body(b"").replace(b"64", b"0"), "'max_tokens' must be an integer >= 1"),
        (_body(b"").replace(b"64", b"true"), "'max_tokens' must be an integer"),
        (_body(b"").replace(b"64", b"1.5"), "'max_tokens' must be an integer"),
        (b'{"model": "m", "max_tokens": 64, "messages": {}}', "'messages' must be a non-empty array"),
        (b'{"model": "m", "max_tokens": 64, "messages": []}', "'messages' must be a non-empty array"),
        (_body(b"", b'"hi"'), "messages[0] must be an object"),
        (_body(b"", b'{"role": "system", "content": "x"}'), "messages[0].role must be 'user' or 'assistant'"),
        (_body(b"", b'{"role": 5, "content": "x"}'), "messages[0].role"),
        (_body(b"", b'{"role": "user"}'), "'messages[0].content' must be a string or an array"),
        (_body(b"", b'{"role": "user", "content": 5}'), "'messages[0].content' must be a string or an array"),
        (_body(b"", b'{"role": "user", "content": [{"text": "x"}]}'), "with a string 'type'"),
        (_body(b"", b'{"role": "user", "content": ["x"]}'), "'messages[0].content[0]' must be an object"),
        (_body(b"", b'{"role": "user", "content": [{"type": "text", "text": 5}]}'), "content[0].text"),
        (_body(b', "system": 5'), "'system' must be a string or an array of text blocks"),
        (_body(b', "system": [{"type": "image"}]'), "'system[0]' must be a text block"),
        (_body(b', "tools": {}'), "'tools' must be an array"),
        (_body(b', "stream": "yes"'), "'stream' must be a boolean"),
        (_body(b', "metadata": []'), "'metadata' must be an object"),
        (_body(b', "thinking": {"type": "enabled", "budget_tokens": -1}'), "thinking.budget_tokens"),
        (_body(b', "thinking": {"type": "enabled", "budget_tokens": 1e9}'), "thinking.budget_tokens"),
        (_body(b', "thinking": {"type": null}'), "thinking.type"),
        (_body(b', "thinking": []'), "'thinking' must be an object"),
        (_body(b', "output_config": {"effort": 3}'), "output_config.effort"),
    ],
)
def test_a_malformed_body_is_a_400_that_says_what_and_logs_nothing(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture, raw: bytes, says: str
) -> None:
    gateway_log.clear()
    assert says in _refused(c, _post(c, raw), 400, "invalid_request_error")
    assert lines(gateway_log) == []


@pytest.mark.parametrize("path", [MSG, COUNT])
def test_the_count_is_checked_as_the_message_is_but_for_max_tokens(c: HostileGateway, path: str) -> None:
    raw = b'{"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": [{"type": 7}]}]}'
    assert "string 'type'" in _refused(c, _post(c, raw, path), 400, "invalid_request_error")
    count = _post(c, b'{"model": "m", "messages": [' + USER + b"]}", COUNT)
    assert count.status_code == 200 and count.json()["input_tokens"] == 42


@pytest.mark.parametrize(
    ("messages", "fields", "where"),
    [
        (b'{"role": "user", "content": "a\\ud800b"}', b"", "messages[0].content"),
        (
            b'{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}',
            b"",
            "messages[0].content[0].text",
        ),
        (USER, b', "system": "\\ud800"', "system"),
        (USER, b', "system": [{"type": "text", "text": "\\udbff"}]', "system[0].text"),
        (USER, b"", None),  # the model (see below)
        (
            b'{"role": "user", "content": [{"type": "image", "source": {"type": "base64", '
            b'"media_type": "image/png", "data": "AA\\udc00"}}]}',
            b"",
            "messages[0].content[0].source.data",
        ),
        (
            b'{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://i/\\ud800"}}]}',
            b"",
            "messages[0].content[0].source.url",
        ),
        (b'{"role": "user", "content": "\xed\xa0\x80"}', b"", "messages[0].content"),  # the surrogate's bytes
    ],
)
def test_a_lone_surrogate_where_the_gateway_reads_is_a_400_and_one_line(
    c: HostileGateway,
    gateway_log: pytest.LogCaptureFixture,
    messages: bytes,
    fields: bytes,
    where: str | None,
) -> None:
    gateway_log.clear()
    raw = _body(fields, messages)
    if where is None:  # the model: in place of the body's own (a second one would be a duplicate key)
        raw, where = _body(b"", messages).replace(b'"model": "m"', b'"model": "m\\ud800"'), "model"
    message = _refused(c, _post(c, raw), 400, "invalid_request_error")
    assert message.startswith("invalid unicode: lone surrogate \\u") and message.endswith(f" in {where}")
    assert_one_line(gateway_log, "lone surrogate")


def test_a_surrogate_after_the_head_is_the_engine_s_business(c: HostileGateway) -> None:
    later = USER + b', {"role": "assistant", "content": "\\ud800"}, ' + USER
    assert _post(c, _body(b"", later)).status_code == 200
    assert c.engines["a"].requests[0]["messages"][1]["content"] == "\ud800"


@pytest.mark.parametrize("path", [MSG, COUNT])
def test_hostile_json_is_refused_with_one_line_and_the_gateway_carries_on(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture, path: str
) -> None:
    cases = [
        (_body(b', "n": 1' + b"0" * 4300), 400, "invalid_request_error", "integer literal too long"),
        (_body(b', "x": ' + b"[" * 100_000 + b"]" * 100_000), 400, "invalid_request_error", "nesting deeper"),
        (_body(b', "model": "n"'), 400, "invalid_request_error", "duplicate key"),
        (_body(b"", b"{}," * 600_000 + USER), 413, "request_too_large", "JSON values"),
        (b"\xef\xbb\xbf" + _body(b""), 400, "invalid_request_error", "byte order mark"),
    ]
    for raw, status, kind, says in cases:
        gateway_log.clear()
        assert says in _refused(c, _post(c, raw, path), status, kind)
        assert_one_line(gateway_log, says)
    assert _post(c, _body(b"")).status_code == 200  # and the next request is served


def test_a_body_over_the_size_limit_is_a_413_in_anthropic_s_shape(c: HostileGateway) -> None:
    big = _body(b', "system": "' + b"x" * (c.gateway.settings.limits.max_body_bytes + 1) + b'"')
    _refused(c, _post(c, big), 413, "request_too_large")


def test_a_surrogate_after_the_head_survives_translation_to_chat() -> None:
    """An engine without /v1/messages (the default dialect) gets the chat translation: a lone surrogate the
    client sent as an escape reaches it as that escape (the body is re-serialised ASCII-escaped): no 500."""
    with contextlib.ExitStack() as stack:
        c = start_gateway(stack)  # fake engine "a" speaks chat only
        later = USER + b', {"role": "assistant", "content": "\\ud800"}, ' + USER
        r = _post(c, _body(b"", later))
        assert r.status_code == 200 and r.json()["type"] == "message", r.text
        engine = c.engines["a"]
        assert engine.paths == ["/v1/chat/completions"]
        assert b'"content":"\\ud800"' in engine.raw[0] and engine.raw[0].isascii()
        assert engine.requests[0]["messages"][1] == {"role": "assistant", "content": "\ud800"}
        assert c.gateway.registry.total_in_flight() == 0
