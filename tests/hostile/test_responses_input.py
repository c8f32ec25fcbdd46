"""Hostile input on /v1/responses and the stored-response routes: an OpenAI-shaped 4xx naming what was
wrong, never a 500 or a hang, no engine reached, nothing left in flight; a hostile one logs one line."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from hostile_gateway import HostileGateway, HostileGatewayFactory, assert_one_line, lines

from responses_fakes import ResponsesEngine

PATH = "/v1/responses"
ITEM = b'{"role": "user", "content": "hi"}'


@pytest.fixture
def c(hostile_gateway: HostileGatewayFactory) -> Iterator[HostileGateway]:
    gw = hostile_gateway(engines=[ResponsesEngine("a")], limits={"max_body_bytes": 256 * 1024})
    yield gw
    assert gw.gateway.registry.total_in_flight() == 0
    assert gw.engines["a"].raw == []  # none of it reached the engine


def _post(c: HostileGateway, raw: bytes, path: str = PATH) -> httpx.Response:
    return httpx.post(c.url + path, content=raw, headers={"content-type": "application/json"}, timeout=10)


def _error(r: httpx.Response, status: int = 400) -> dict[str, str]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err: dict[str, str] = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}
    return err


WRONG_TYPES = [
    (b'{"input": "x"}', "model"),
    (b'{"model": 3, "input": "x"}', "model"),
    (b'{"model": "m"}', "input"),
    (b'{"model": "m", "input": 3}', "input"),
    (b'{"model": "m", "input": {"role": "user"}}', "input"),
    (b'{"model": "m", "input": [1]}', "input[0]"),
    (b'{"model": "m", "input": [{"role": 1, "content": "x"}]}', "input[0].role"),
    (b'{"model": "m", "input": [{"role": "user", "content": 7}]}', "input[0].content"),
    (b'{"model": "m", "input": "x", "instructions": ["a"]}', "instructions"),
    (b'{"model": "m", "input": "x", "prompt_cache_key": 1}', "prompt_cache_key"),
    (b'{"model": "m", "input": "x", "previous_response_id": 12}', "previous_response_id"),
    (b'{"model": "m", "input": "x", "stream": "yes"}', "stream"),
    (b'{"model": "m", "input": "x", "store": 1}', "store"),
    (b'{"model": "m", "input": "x", "tools": {}}', "tools"),
    (b'{"model": "m", "input": "x", "reasoning": "high"}', "reasoning"),
    (b'{"model": "m", "input": "x", "reasoning": {"effort": "extreme"}}', "reasoning.effort"),
    (b'{"model": "m", "input": "x", "reasoning": {"effort": 3}}', "reasoning.effort"),
]


@pytest.mark.parametrize(("raw", "param"), WRONG_TYPES)
def test_a_wrong_type_is_a_400_naming_the_field(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture, raw: bytes, param: str
) -> None:
    err = _error(_post(c, raw))
    assert err["param"] == param
    assert not [r for r in lines(gateway_log) if r.exc_info]  # an ordinary 400: no traceback


SURROGATES = [
    (b'{"model": "m", "input": "a\\ud800"}', "input"),
    (b'{"model": "m", "input": [{"role": "user", "content": "\\udc00"}]}', "input[0].content"),
    (
        b'{"model": "m", "input": [{"role": "user", "content": [{"type": "input_text", '
        b'"text": "\\ud800"}]}]}',
        "input[0].content[0].text",
    ),
    (
        b'{"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", '
        b'"image_url": "http://i/\\udbff"}]}]}',
        "input[0].content[0].image_url",
    ),
    (b'{"model": "m", "input": "x", "instructions": "\\udfff"}', "instructions"),
    (b'{"model": "m", "input": "x", "prompt_cache_key": "\\ud800"}', "prompt_cache_key"),
    (b'{"model": "m", "input": [{"role": "\\ud800", "content": "x"}]}', "input[0].role"),
]


@pytest.mark.parametrize(("raw", "param"), SURROGATES)
def test_a_lone_surrogate_the_gateway_reads_is_a_400_and_one_line(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture, raw: bytes, param: str
) -> None:
    gateway_log.clear()
    err = _error(_post(c, raw))
    assert err["param"] == param
    assert_one_line(gateway_log, "lone surrogate")


#: (body, what the error says, whether it is hostile: one log line; a cut body or an array is an ordinary
#: client mistake and logs nothing, as on every other route)
MALFORMED = [
    (b'{"model": "m", "input": ', "not valid JSON", False),
    (b"[" + ITEM + b"]", "object", False),
    (b'{"model": "m", "model": "m", "input": "x"}', "duplicate key", True),
    (b'{"model": "m", "input": "x", "n": 1' + b"0" * 4400 + b"}", "integer literal too long", True),
    (b'{"model": "m", "input": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}", "nesting deeper than", True),
]


@pytest.mark.parametrize(("raw", "says", "hostile"), MALFORMED)
def test_a_malformed_body_is_a_400(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture, raw: bytes, says: str, hostile: bool
) -> None:
    gateway_log.clear()
    err = _error(_post(c, raw))
    assert says in err["message"]
    if hostile:
        assert_one_line(gateway_log, says)
    else:
        assert not lines(gateway_log)


def test_a_deep_item_the_key_hashes_is_no_500(c: HostileGateway) -> None:
    """A non-message item in the head is hashed as JSON: whatever the parser took, hashing takes too."""
    for depth in (200, 900, 3000):
        item = b'{"type": "function_call_output", "output": ' + b"[" * depth + b"]" * depth + b"}"
        r = _post(c, b'{"model": "m", "input": [' + item + b", " + ITEM + b"]}")
        assert r.status_code in (200, 400), r.text
        if r.status_code == 200:
            c.engines["a"].raw.clear()


def test_a_body_over_the_limit_is_a_413(c: HostileGateway) -> None:
    raw = b'{"model": "m", "input": "' + b"x" * (300 * 1024) + b'"}'
    _error(_post(c, raw), 413)


BAD_IDS = [
    b'"../../etc/passwd"',
    b'"resp\\nINJECTED"',
    b'"' + b"r" * 201 + b'"',
    b'""',
    b'"resp_\\u0000"',
]


@pytest.mark.parametrize("rid", BAD_IDS)
def test_a_bad_previous_response_id_is_a_400_and_one_line(
    c: HostileGateway, gateway_log: pytest.LogCaptureFixture, rid: bytes
) -> None:
    gateway_log.clear()
    err = _error(_post(c, b'{"model": "m", "input": "x", "previous_response_id": ' + rid + b"}"))
    assert err["param"] == "previous_response_id"
    assert_one_line(gateway_log, "rejected a response id")


@pytest.mark.parametrize(
    "path",
    ["/v1/responses/%20x", "/v1/responses/a%0Ab", "/v1/responses/" + "r" * 201, "/v1/responses/_x/cancel",
     "/v1/responses/a%2Fb/input_items"],
)  # fmt: skip
def test_a_bad_id_in_the_path_is_a_4xx_that_reaches_no_engine(c: HostileGateway, path: str) -> None:
    method = "POST" if path.endswith("/cancel") else "GET"
    r = httpx.request(method, c.url + path, timeout=10)
    assert r.status_code in (400, 404), r.text
    assert "error" in r.json()


def test_an_unknown_id_in_the_path_is_a_404_and_a_wrong_method_a_405(c: HostileGateway) -> None:
    _error(httpx.get(c.url + "/v1/responses/resp_nobody", timeout=10), 404)
    _error(httpx.put(c.url + "/v1/responses/resp_nobody", timeout=10), 405)
    _error(httpx.get(c.url + "/v1/responses/resp_nobody/cancel", timeout=10), 405)
