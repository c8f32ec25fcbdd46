"""Hostile JSON is a 400 that says what was wrong, logs one line, and never reaches an engine.

Each of these was a 500 with two tracebacks: a lone surrogate made the key hashing raise
UnicodeEncodeError, a 4,301-digit integer made json.loads raise ValueError, deep nesting RecursionError.
"""

from __future__ import annotations

import httpx
import pytest
from hostile_engine import HostileEngine, ok_json
from hostile_gateway import HostileGateway, HostileGatewayFactory, assert_one_line

CHAT = "/v1/chat/completions"


@pytest.fixture
def c(shared_gateway: HostileGateway) -> HostileGateway:
    shared_gateway.engines["a"].requests.clear()
    return shared_gateway


def _post(c: HostileGateway, path: str, raw: bytes) -> httpx.Response:
    return httpx.post(c.url + path, content=raw, headers={"content-type": "application/json"}, timeout=10)


def _error(r: httpx.Response, code: str) -> dict[str, str]:
    assert r.status_code == 400, r.text
    err: dict[str, str] = r.json()["error"]
    assert err["code"] == code, err
    return err


USER = b'{"role": "user", "content": "hi"}'


@pytest.mark.parametrize(
    ("path", "raw", "param", "char"),
    [
        (
            CHAT,
            b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
            "messages[0].content",
            "\\ud800",
        ),
        (
            CHAT,
            b'{"model": "m", "messages": [{"role": "\\udc00user", "content": "hi"}]}',
            "messages[0].role",
            "\\udc00",
        ),
        (CHAT, b'{"model": "m\\ud800", "messages": [' + USER + b"]}", "model", "\\ud800"),
        (
            CHAT,
            b'{"model": "m", "messages": [{"role": "system", "content": "ok"}, '
            b'{"role": "user", "content": "\\udfff"}]}',
            "messages[1].content",
            "\\udfff",
        ),
        (
            CHAT,
            b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
            b'"text": "\\ud800"}]}]}',
            "messages[0].content[0].text",
            "\\ud800",
        ),
        (
            CHAT,
            b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url", '
            b'"image_url": {"url": "http://i/\\udbff"}}]}]}',
            "messages[0].content[0].image_url.url",
            "\\udbff",
        ),
        # The surrogate's UTF-8 bytes, not an escape: json.loads decodes with "surrogatepass".
        (
            CHAT,
            b'{"model": "m", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}',
            "messages[0].content",
            "\\ud800",
        ),
        ("/v1/completions", b'{"model": "m", "prompt": "\\ud800"}', "prompt", "\\ud800"),
        ("/v1/completions", b'{"model": "m", "prompt": ["fine", "\\ude00"]}', "prompt[1]", "\\ude00"),
        ("/v1/embeddings", b'{"model": "m\\ud800", "input": "x"}', "model", "\\ud800"),
    ],
)
def test_a_lone_surrogate_in_a_field_the_gateway_reads_is_400(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture, path: str, raw: bytes, param: str, char: str
) -> None:
    gateway_log.clear()
    err = _error(_post(c, path, raw), "invalid_request")
    assert err["message"] == f"invalid unicode: lone surrogate {char} in {param}"
    assert err["param"] == param
    assert c.engines["a"].requests == []
    assert_one_line(gateway_log, "lone surrogate")


def test_a_surrogate_pair_is_a_character_and_goes_through_untouched(c: HostileGateway) -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    r = _post(c, CHAT, raw)
    assert r.status_code == 200, r.text
    assert c.engines["a"].requests == [
        {"model": "m", "messages": [{"role": "user", "content": "\U0001f600"}]}
    ]


def test_a_lone_surrogate_after_the_conversation_head_is_the_engines_business(c: HostileGateway) -> None:
    """The gateway reads (hashes) only the head; later turns are forwarded as the client's bytes."""
    raw = b'{"model": "m", "messages": [' + USER + b', {"role": "assistant", "content": "\\ud800"}]}'
    assert _post(c, CHAT, raw).status_code == 200
    assert c.engines["a"].requests[0]["messages"][1]["content"] == "\ud800"


@pytest.mark.parametrize("path", [CHAT, "/v1/completions", "/v1/embeddings"])
def test_an_integer_over_pythons_digit_limit_is_400(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture, path: str
) -> None:
    gateway_log.clear()
    raw = b'{"model": "m", "messages": [' + USER + b'], "prompt": "x", "n": 1' + b"0" * 4300 + b"}"
    err = _error(_post(c, path, raw), "invalid_json")
    assert err["message"] == "request body is not valid JSON: integer literal too long (over 4300 digits)"
    assert c.engines["a"].requests == []
    assert_one_line(gateway_log, "integer literal too long")


@pytest.mark.parametrize(("open_", "close"), [(b"[", b"]"), (b'{"a":', b"}")])
def test_nesting_past_the_parsers_depth_is_400_and_the_process_carries_on(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture, open_: bytes, close: bytes
) -> None:
    gateway_log.clear()
    deep = open_ * 100_000 + b"1" + close * 100_000
    raw = b'{"model": "m", "messages": [' + USER + b'], "x": ' + deep + b"}"
    err = _error(_post(c, CHAT, raw), "invalid_json")
    assert err["message"].startswith("request body is not valid JSON: nesting deeper than ")
    assert err["message"].endswith(" levels")
    assert_one_line(gateway_log, "nesting deeper than")
    assert httpx.get(c.url + "/healthz").status_code == 200
    ok = httpx.post(c.url + CHAT, json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200


def _tools_at(depth: int) -> bytes:
    return b'{"model": "m", "messages": [' + USER + b'], "tools": [' + b"[" * depth + b"]" * depth + b"]}"


def _parts_at(depth: int) -> bytes:
    part = b"[" * depth + b"]" * depth  # a non-object content part: the key hashes its JSON
    return b'{"model": "m", "messages": [{"role": "user", "content": [' + part + b"]}]}"


def _deepest_accepted(c: HostileGateway) -> int:
    lo, hi = 1, 5000  # lo parses, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if _post(c, CHAT, _tools_at(mid)).status_code == 400:
            hi = mid
        else:
            lo = mid
    return lo


def test_nesting_just_inside_the_parsers_depth_is_no_500_in_the_key_hashing(
    hostile_gateway: HostileGatewayFactory, gateway_log: pytest.LogCaptureFixture
) -> None:
    """Whatever json.loads accepted, re-encoding it for the conversation key must not overflow either.
    (The engine here never parses: a Python engine would overflow on its own at a different depth.)"""
    engine = HostileEngine({"/health": ok_json({}), CHAT: ok_json({"id": "x"})})
    with engine.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"h": url})
        edge = _deepest_accepted(c)
        assert 500 < edge < 5000
        answers = [
            _post(c, CHAT, make(d)) for d in range(edge - 8, edge + 6) for make in (_tools_at, _parts_at)
        ]
    # The exact edge moves by a level or two with the stack depth at parse time; either side is fine.
    assert {r.status_code for r in answers} == {200, 400}, [r.text for r in answers]
    assert {r.json()["error"]["code"] for r in answers if r.status_code == 400} == {"invalid_json"}
    assert not [r for r in gateway_log.records if r.name == "warmroute"]


def test_a_body_of_a_million_tiny_values_is_refused_before_it_is_parsed(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture
) -> None:
    """``{},`` is 3 bytes and, parsed, a 64-byte dict: 32 MiB of them took the gateway from 193 MB to 954 MB
    and its event loop for a second, only to answer 400. The default limit counts them first."""
    gateway_log.clear()
    raw = b'{"model": "m", "messages": [' + b"{}," * 600_000 + USER + b"]}"
    r = _post(c, CHAT, raw)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "payload_too_large"
    assert err["message"] == (
        "request body holds more than 500000 JSON values (',', '{' and '[' counted before parsing)"
    )
    assert c.engines["a"].requests == []
    assert_one_line(gateway_log, "JSON values")


def test_the_value_limit_is_a_setting_and_a_body_within_it_goes_through(
    hostile_gateway: HostileGatewayFactory,
) -> None:
    c = hostile_gateway(limits={"max_json_values": 1000})
    # Seven of the counted bytes (',', '{', '[') are outside "x".
    within = b'{"model": "m", "messages": [' + USER + b'], "x": [' + b"1," * 993 + b"1]}"
    over = b'{"model": "m", "messages": [' + USER + b'], "x": [' + b"1," * 994 + b"1]}"
    assert _post(c, CHAT, within).status_code == 200
    assert _post(c, CHAT, over).status_code == 413
    assert len(c.engines["a"].requests) == 1


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (b'{"model": "m", "messages": [' + USER + b'], "model": "other"}', "model"),
        (b'{"model": "m", "messages": [' + USER + b'], "messages": [' + USER + b"]}", "messages"),
        (b'{"model": "m", "messages": [' + USER + b'], "m\\u006fdel": "other"}', "model"),  # escaped
        (b'{"stream": false, "model": "m", "messages": [' + USER + b'], "stream": true}', "stream"),
    ],
    ids=["model", "messages", "escaped", "stream"],
)
def test_a_top_level_key_sent_twice_is_400_naming_it(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture, raw: bytes, key: str
) -> None:
    """The gateway would validate (and route by) the last one and forward bytes holding both, which an
    engine's parser may read the other way."""
    gateway_log.clear()
    err = _error(_post(c, CHAT, raw), "invalid_request")
    assert err["message"] == f"duplicate key '{key}' in the request body object"
    assert err["param"] == key
    assert c.engines["a"].requests == []
    assert_one_line(gateway_log, "duplicate key")


BODY = '{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (BODY.encode("utf-16"), "it is UTF-16; JSON must be UTF-8"),  # with its BOM
        (BODY.encode("utf-16-le"), "it is UTF-16-LE; JSON must be UTF-8"),
        (BODY.encode("utf-16-be"), "it is UTF-16-BE; JSON must be UTF-8"),
        (BODY.encode("utf-32"), "it is UTF-32; JSON must be UTF-8"),
        (BODY.encode("utf-32-le"), "it is UTF-32-LE; JSON must be UTF-8"),
        (BODY.encode("utf-8-sig"), "it starts with a byte order mark; send it without"),
    ],
    ids=["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-8-bom"],
)
def test_a_body_that_is_not_utf8_is_400(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture, raw: bytes, says: str
) -> None:
    """RFC 8259 §8.1. json.loads reads all of these, and the engine got the UTF-16 bytes as they came."""
    gateway_log.clear()
    err = _error(_post(c, CHAT, raw), "invalid_json")
    assert err["message"] == f"request body is not valid JSON: {says}"
    assert c.engines["a"].requests == []
    assert_one_line(gateway_log, says)
