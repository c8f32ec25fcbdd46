"""Bad input gets an OpenAI-shaped 4xx that says what was wrong; nothing reaches an engine; nothing leaks."""

from __future__ import annotations

import httpx
import openai
import pytest

from clusters import Cluster, ClusterFactory

OK_MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
def c(cluster: ClusterFactory) -> Cluster:
    return cluster(["a"], limits={"max_body_bytes": 4096})


def _error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code
    assert set(err) >= {"message", "type", "code"}
    return str(err["message"])


@pytest.mark.parametrize(
    ("raw", "code", "says"),
    [
        (b"{not json", "invalid_json", "not valid JSON"),
        (b"", "invalid_request", "empty"),
        (b"[1, 2]", "invalid_request", "JSON object"),
        (b'{"messages": []}', "invalid_request", "'model' is required"),
        (b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', "invalid_request", "'model' must"),
        (b'{"model": "m", "messages": "hi"}', "invalid_request", "'messages' must"),
        (b'{"model": "m", "messages": []}', "invalid_request", "non-empty"),
        (b'{"model": "m", "messages": ["hi"]}', "invalid_request", "messages[0] must be an object"),
        (b'{"model": "m", "messages": [{"content": "x"}]}', "invalid_request", "messages[0].role"),
        (b'{"model": "m", "messages": [{"role": "user", "content": 5}]}', "invalid_request", ".content"),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
            "invalid_request",
            "'stream' must be a boolean",
        ),
        (
            b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": {}}',
            "invalid_request",
            "'tools' must",
        ),
        (b"\xff\xfe", "invalid_json", "not valid JSON"),
    ],
)
def test_malformed_chat_bodies_are_400(c: Cluster, raw: bytes, code: str, says: str) -> None:
    r = httpx.post(c.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert says in _error(r, 400, code)
    assert c.engines["a"].requests == []
    c.wait_idle()


def test_completions_need_a_prompt(c: Cluster) -> None:
    r = httpx.post(c.url + "/v1/completions", json={"model": "m", "prompt": 3})
    assert "'prompt'" in _error(r, 400, "invalid_request")


def test_unknown_model_is_404_and_lists_what_is_served(c: Cluster) -> None:
    r = httpx.post(c.url + "/v1/chat/completions", json={"model": "nope", "messages": OK_MESSAGES})
    msg = _error(r, 404, "model_not_found")
    assert "'nope'" in msg and "m" in msg


def test_body_over_the_limit_is_413(c: Cluster) -> None:
    big = {"model": "m", "messages": [{"role": "user", "content": "x" * 5000}]}
    r = httpx.post(c.url + "/v1/chat/completions", json=big)
    _error(r, 413, "payload_too_large")


def test_chunked_body_over_the_limit_is_413(c: Cluster) -> None:
    def parts():  # no content-length: the limit must hold while reading
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}]}'

    r = httpx.post(c.url + "/v1/chat/completions", content=parts())
    _error(r, 413, "payload_too_large")


def test_unknown_route_and_wrong_method_are_openai_shaped(c: Cluster) -> None:
    _error(httpx.get(c.url + "/nope"), 404, "not_found")
    _error(httpx.get(c.url + "/v1/chat/completions"), 405, "method_not_allowed")


def test_no_healthy_backend_is_503_naming_states(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    c.engines["a"].healthy = False
    c.gateway.registry.backends["a"].state = c.gateway.registry.backends["a"].state.DOWN
    r = httpx.post(c.url + "/v1/chat/completions", json={"model": "m", "messages": OK_MESSAGES})
    assert "a=down" in _error(r, 503, "no_healthy_backend")


def test_openai_client_chat_stream_and_errors(c: Cluster) -> None:
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model="m", messages=OK_MESSAGES)  # type: ignore[arg-type]
    assert reply.choices[0].message.content == "a-0 a-1 a-2"
    pieces = [
        ch.choices[0].delta.content
        for ch in client.chat.completions.create(model="m", messages=OK_MESSAGES, stream=True)  # type: ignore[arg-type]
    ]
    assert "".join(p or "" for p in pieces) == "a-0 a-1 a-2 "
    assert [m.id for m in client.models.list()] == ["m"]
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="nope", messages=OK_MESSAGES)  # type: ignore[arg-type]
    assert nf.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as br:
        client.chat.completions.create(model="m", messages=[])
    assert "messages" in str(br.value)
    c.wait_idle()
