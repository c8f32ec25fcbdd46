"""``/v1/messages`` and ``/v1/messages/count_tokens`` as API shapes, in front of fake Anthropic engines: the
bytes an engine received, where conversations and their counts went, the usage metrics, Anthropic's error
bodies per status, client keys as ``x-api-key``, thinking budgets and images."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from messages_engine import COUNTED, AnthropicEngine
from starlette.types import Message

from config.settings import load_settings
from gateway.app import Gateway, create_app
from gateway.errors import NoHealthyBackend
from gateway.relay import send_error
from gateway.shapes.anthropic_errors import ANTHROPIC_ERRORS
from gateway.shapes.messages import usage
from gateway.waiting import EarlyHeadSend
from routing.keys import messages_key

from clusters import ClusterFactory
from upstreams import FAST_HEALTH, serve

MSG = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
SYSTEM = "You are a coding agent. " * 20


@pytest.fixture
def cluster(cluster: ClusterFactory) -> ClusterFactory:
    """Fake engines that serve /v1/messages natively (for the default dialect, openai, it is translated)."""
    return functools.partial(cluster, backend={"native_shapes": ["chat", "completions", "messages"]})


def turn1(**extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 2048,
        "system": SYSTEM,
        "messages": [{"role": "user", "content": "fix the bug"}],
        **extra,
    }


def turn2() -> dict[str, Any]:
    body = turn1()
    body["messages"] += [
        {"role": "assistant", "content": [{"type": "text", "text": "which bug?"}]},
        {"role": "user", "content": "the one in main.py"},
    ]
    return body


def post(url: str, body: dict[str, Any], path: str = MSG, **headers: str) -> httpx.Response:
    raw = json.dumps(body).encode()
    return httpx.post(url + path, content=raw, headers={"content-type": "application/json", **headers})


def metric(url: str, line_start: str) -> list[str]:
    return [line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith(line_start)]


def anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert set(body) == {"type", "error"} and set(body["error"]) == {"type", "message"}
    message: str = body["error"]["message"]
    return message


@contextlib.contextmanager
def gateway(
    engines: list[AnthropicEngine], backend: dict[str, Any], **overrides: Any
) -> Iterator[tuple[str, Gateway]]:
    """A gateway whose backends all get ``backend``'s settings (dialect, vision...), and ``overrides``."""
    with contextlib.ExitStack() as stack:
        urls = {e.name: stack.enter_context(serve(e.app()))[0] for e in engines}
        backends = [{"id": e.name, "url": urls[e.name], "models": ["m"], **backend} for e in engines]
        overrides.setdefault("health", FAST_HEALTH)
        overrides.setdefault("canary", {"enabled": False})
        app = create_app(load_settings(None, backends=backends, **overrides))
        url, _server = stack.enter_context(serve(app))
        yield url, app.state.gateway


# -- the key ------------------------------------------------------------------------------------------------


def test_the_key_is_model_tools_system_and_the_head_a_system_string_and_one_text_block_alike() -> None:
    base = turn1()
    as_block = {**base, "system": [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]}
    assert messages_key(base) == messages_key(as_block)
    assert messages_key(base) == messages_key(turn2())  # later turns only append
    cached = {**base, "messages": [{"role": "user", "content": [{"type": "text", "text": "fix the bug"}]}]}
    assert messages_key(base) == messages_key(cached)
    assert messages_key(base) != messages_key({**base, "system": "another agent"})
    assert messages_key(base) != messages_key({**base, "model": "n"})
    assert messages_key(base) != messages_key({**base, "tools": [{"name": "t", "input_schema": {}}]})
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    one = {**base, "messages": [{"role": "user", "content": [image]}]}
    other = {
        **base,
        "messages": [{"role": "user", "content": [{**image, "source": {**image["source"], "data": "BBBB"}}]}],
    }
    assert messages_key(one) != messages_key(other)


# -- conversations, bytes, pins -----------------------------------------------------------------------------


def test_a_conversation_stays_on_one_engine_which_gets_the_client_s_own_bytes(
    cluster: ClusterFactory,
) -> None:
    c = cluster(engines=[AnthropicEngine("a"), AnthropicEngine("b")])
    sent = [json.dumps(turn1()).encode(), json.dumps(turn2()).encode()]
    served, reasons = [], []
    for raw in sent:
        r = httpx.post(c.url + MSG, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        served.append(r.headers["x-warmroute-backend"])
        reasons.append(r.headers["x-warmroute-route"])
    assert reasons == ["new_cheapest", "affinity_hit"]
    assert served[0] == served[1]
    engine = c.engines[served[0]]
    assert engine.raw == sent and engine.paths == [MSG, MSG]
    other = post(c.url, {**turn1(), "system": "another agent"})
    assert other.headers["x-warmroute-backend"] != served[0]  # a new conversation: the other engine


def test_count_tokens_goes_where_its_conversation_is_and_never_pins(cluster: ClusterFactory) -> None:
    c = cluster(engines=[AnthropicEngine("a"), AnthropicEngine("b")], routing={"policy": "affinity"})
    count_body = {k: v for k, v in turn1().items() if k != "max_tokens"}
    before = post(c.url, count_body, COUNT)  # before the conversation's first turn: nothing to follow
    assert before.status_code == 200, before.text
    assert before.json()["input_tokens"] == COUNTED
    assert before.headers["x-warmroute-route"] == "new_least_loaded"
    first = post(c.url, turn1())
    assert first.headers["x-warmroute-route"] == "new_least_loaded"  # the count made no pin
    home = first.headers["x-warmroute-backend"]
    counted = post(c.url, {k: v for k, v in turn2().items() if k != "max_tokens"}, COUNT)
    assert (counted.headers["x-warmroute-route"], counted.headers["x-warmroute-backend"]) == (
        "affinity_hit",
        home,
    )
    assert c.engines[home].paths[-2:] == [MSG, COUNT]
    c.wait_idle()
    assert metric(c.url, "warmroute_backend_conversations{") == [
        f'warmroute_backend_conversations{{backend="{b}"}} {1.0 if b == home else 0.0}' for b in ("a", "b")
    ]


# -- usage and the guard ------------------------------------------------------------------------------------


def test_a_stream_s_usage_is_read_from_its_first_event_and_its_last(cluster: ClusterFactory) -> None:
    engine = AnthropicEngine(
        "a", chunks=60, pad=100
    )  # the stream is ~10 KiB: message_start is out of the tail
    c = cluster(engines=[engine])
    r = post(c.url, turn1(stream=True))
    assert r.status_code == 200
    assert r.content.startswith(b"event: message_start\ndata: ") and r.content.endswith(
        b'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
    assert len(r.content) > 8192
    assert post(c.url, turn1()).status_code == 200  # and a whole body: its usage object
    c.wait_idle()
    assert metric(c.url, "warmroute_prompt_tokens_total") == [
        'warmroute_prompt_tokens_total{backend="a",model="m"} 20.0'
    ]
    assert metric(c.url, "warmroute_completion_tokens_total") == [
        'warmroute_completion_tokens_total{backend="a",model="m"} 122.0'
    ]
    assert metric(c.url, "warmroute_cached_prompt_tokens_total") == [
        'warmroute_cached_prompt_tokens_total{backend="a",model="m"} 10.0'
    ]
    # end_turn is counted as "stop", a stream and a body alike (the guard's bounded labels)
    assert metric(c.url, "warmroute_finish_reasons_total") == [
        'warmroute_finish_reasons_total{backend="a",reason="stop"} 2.0'
    ]


def test_the_usage_reader_adds_the_cache_fields_to_the_prompt_and_takes_the_last_output() -> None:
    usage_start = b'{"input_tokens":3,"output_tokens":1,"cache_read_input_tokens":5}'
    start = b'event: message_start\ndata: {"message":{"usage":' + usage_start + b"}}\n\n"
    end = b'event: message_delta\ndata: {"delta":{},"usage":{"output_tokens":9}}\n\n'
    got = usage(start + end)
    assert got is not None and (got.prompt_tokens, got.completion_tokens, got.cached_tokens) == (8, 9, 5)
    vllm_end = b'data: {"usage":{"input_tokens":4,"output_tokens":9,"cache_read_input_tokens":6}}\n\n'
    got = usage(start + vllm_end)  # vLLM repeats every field at the end: those win
    assert got is not None and (got.prompt_tokens, got.completion_tokens, got.cached_tokens) == (10, 9, 6)
    no_cache = usage(b'{"usage":{"input_tokens":4,"output_tokens":2}}')
    assert no_cache is not None and no_cache.cached_tokens is None
    assert usage(b'{"input_tokens": 42}') is None and usage(b'{"usage": null}') is None


def test_max_tokens_is_counted_as_length(cluster: ClusterFactory) -> None:
    c = cluster(
        engines=[AnthropicEngine("a", stop_reason="max_tokens"), AnthropicEngine("b", stop_reason="tool_use")]
    )
    for body in (turn1(stream=True), {**turn1(stream=True), "system": "other"}):
        assert post(c.url, body).status_code == 200
    c.wait_idle()
    assert sorted(metric(c.url, "warmroute_finish_reasons_total")) == [
        'warmroute_finish_reasons_total{backend="a",reason="length"} 1.0',
        'warmroute_finish_reasons_total{backend="b",reason="tool_calls"} 1.0',
    ]


def test_the_guard_ends_a_degenerate_stream_of_text_deltas_in_anthropic_s_shape(
    cluster: ClusterFactory,
) -> None:
    c = cluster(
        engines=[AnthropicEngine("a", chunks=40, repeat=" duct")], guard={"repeat_count": 8, "action": "end"}
    )
    r = post(c.url, turn1(stream=True))
    assert r.status_code == 200
    head, _, end = r.content.rpartition(b"event: error\ndata: ")
    assert head.count(b'"text":" duct"') < 8  # the read holding the tripping delta is not sent
    error = json.loads(end)
    assert error["type"] == "error" and "output degenerated" in error["error"]["message"]
    assert b"[DONE]" not in r.content
    c.wait_idle()
    assert metric(c.url, "warmroute_output_guard_trips_total") == [
        'warmroute_output_guard_trips_total{action="end",backend="a"} 1.0'
    ]


# -- errors -------------------------------------------------------------------------------------------------


def test_errors_on_the_messages_routes_are_anthropic_s_per_status(cluster: ClusterFactory) -> None:
    c = cluster(engines=[AnthropicEngine("a")], limits={"max_body_bytes": 4096})
    assert "max_tokens" in anthropic_error(
        post(c.url, {"model": "m", "messages": []}), 400, "invalid_request_error"
    )
    assert "messages" in anthropic_error(
        post(c.url, {"model": "m", "max_tokens": 5}), 400, "invalid_request_error"
    )
    assert "nope" in anthropic_error(post(c.url, {**turn1(), "model": "nope"}), 404, "not_found_error")
    assert "nope" in anthropic_error(post(c.url, {**turn1(), "model": "nope"}, COUNT), 404, "not_found_error")
    anthropic_error(httpx.get(c.url + MSG), 405, "invalid_request_error")
    anthropic_error(httpx.delete(c.url + COUNT + "/"), 405, "invalid_request_error")
    anthropic_error(post(c.url, {**turn1(), "system": "x" * 5000}), 413, "request_too_large")
    # OpenAI's routes keep OpenAI's shape
    chat = httpx.get(c.url + "/v1/chat/completions")
    assert chat.status_code == 405 and chat.json()["error"]["code"] == "method_not_allowed"
    c.stop_engine("a")
    c.wait_for(lambda: c.gateway.registry.backends["a"].state.value == "down", "a down")
    anthropic_error(post(c.url, turn1()), 503, "overloaded_error")


def test_a_stream_that_breaks_ends_with_an_anthropic_error_event_and_no_done(cluster: ClusterFactory) -> None:
    c = cluster(engines=[AnthropicEngine("a", chunks=5, die_after=2)])
    r = post(c.url, turn1(stream=True))
    assert r.status_code == 200
    head, _, end = r.content.rpartition(b"event: error\ndata: ")
    assert head.startswith(b"event: message_start") and b"a-1 " in head
    error = json.loads(end)
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert end.endswith(b"}\n\n") and b"[DONE]" not in r.content
    c.wait_idle()


def test_client_keys_are_taken_as_x_api_key_and_refused_in_anthropic_s_shape(cluster: ClusterFactory) -> None:
    c = cluster(engines=[AnthropicEngine("a")], auth={"client_keys": [{"name": "team", "key": "sk-team"}]})
    assert post(c.url, turn1(), **{"x-api-key": "sk-team"}).status_code == 200
    assert post(c.url, turn1(), authorization="Bearer sk-team").status_code == 200
    assert "missing API key" in anthropic_error(post(c.url, turn1()), 401, "authentication_error")
    assert "incorrect" in anthropic_error(
        post(c.url, turn1(), **{"x-api-key": "sk-other"}), 401, "authentication_error"
    )
    anthropic_error(post(c.url, turn1(), COUNT), 401, "authentication_error")
    chat = httpx.post(c.url + "/v1/chat/completions", json={"model": "m"})
    assert chat.status_code == 401 and chat.json()["error"]["code"] == "invalid_api_key"  # OpenAI's there
    assert 'warmroute_client_requests_total{client="team"} 2.0' in httpx.get(c.url + "/metrics").text
    assert "x-api-key" not in c.engines["a"].headers[0]  # the client's key stays with the gateway


# -- thinking budgets ---------------------------------------------------------------------------------------


def test_a_thinking_budget_goes_to_the_engine_as_the_client_sent_it() -> None:
    engine = AnthropicEngine("a")
    with gateway([engine], {"dialect": "vllm"}) as (url, _gw):
        for thinking in (
            {"type": "enabled", "budget_tokens": 1024},
            {"type": "disabled"},
            {"type": "adaptive"},
        ):
            raw = json.dumps(turn1(thinking=thinking, output_config={"effort": "low"})).encode()
            r = httpx.post(url + MSG, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
            assert engine.raw[-1] == raw
        text = httpx.get(url + "/metrics").text
    # adaptive with an effort: the effort table's budget, counted; the client's fields still go as sent
    assert 'warmroute_thinking_budget_attempts_total{enforced="native"} 2.0' in text
    assert 'warmroute_thinking_budget_attempts_total{enforced="off"} 1.0' in text


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1023}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, "thinking.budget_tokens"),  # == max_tokens
        ({"thinking": {"type": "enabled", "budget_tokens": "4096"}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled", "budget_tokens": True}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"thinking": "enabled"}, "'thinking'"),
        ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
        ({"output_config": "high"}, "'output_config'"),
    ],
)
def test_a_bad_budget_is_a_400_naming_its_field(
    cluster: ClusterFactory, extra: dict[str, Any], field: str
) -> None:
    c = cluster(engines=[AnthropicEngine("a")])
    assert field in anthropic_error(post(c.url, turn1(**extra)), 400, "invalid_request_error")
    count = {k: v for k, v in turn1(**extra).items() if k != "max_tokens"}
    if "2048" not in json.dumps(extra):  # a count has no max_tokens to leave room in
        assert field in anthropic_error(post(c.url, count, COUNT), 400, "invalid_request_error")
    assert c.engines["a"].requests == []


def test_a_budget_over_the_model_s_max_budget_is_a_400_naming_the_field() -> None:
    engine = AnthropicEngine("a")
    with gateway([engine], {"dialect": "vllm"}, models={"m": {"max_budget": 9000}}) as (url, _gw):
        too_big = turn1(max_tokens=20000, thinking={"type": "enabled", "budget_tokens": 9001})
        message = anthropic_error(post(url, too_big), 400, "invalid_request_error")
        assert "'thinking.budget_tokens' must be between 0 and 9000" in message
        assert (
            post(url, {**too_big, "thinking": {"type": "enabled", "budget_tokens": 9000}}).status_code == 200
        )
    assert len(engine.requests) == 1


def test_derived_budgets_are_spelled_per_anthropic_s_rules() -> None:
    engine = AnthropicEngine("a")
    models = {"m": {"default_budget": 4096}}
    with gateway([engine], {"dialect": "vllm"}, models=models) as (url, _gw):
        assert post(url, turn1(max_tokens=8192)).status_code == 200
        assert post(url, turn1(max_tokens=1000)).status_code == 200
        assert post(url, turn1(max_tokens=8192, thinking={"type": "disabled"})).status_code == 200
    assert [b.get("thinking") for b in engine.requests] == [
        {"type": "enabled", "budget_tokens": 4096},
        None,  # 4096 >= max_tokens: Anthropic would refuse it, so nothing is written
        {"type": "disabled"},  # the client's own
    ]


def test_llama_cpp_caps_the_client_s_budget_itself() -> None:
    engine = AnthropicEngine("a")
    with gateway([engine], {"dialect": "llamacpp"}) as (url, _gw):
        raw = json.dumps(turn1(thinking={"type": "enabled", "budget_tokens": 1024})).encode()
        assert (
            httpx.post(url + MSG, content=raw, headers={"content-type": "application/json"}).status_code
            == 200
        )
    assert engine.raw == [raw]


# -- images -------------------------------------------------------------------------------------------------

IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}


def test_image_blocks_never_go_to_text_only_backends() -> None:
    text_only, seeing = AnthropicEngine("t"), AnthropicEngine("v")
    with contextlib.ExitStack() as stack:
        urls = {e.name: stack.enter_context(serve(e.app()))[0] for e in (text_only, seeing)}
        backends = [
            {"id": "t", "url": urls["t"], "models": ["m"], "vision": "none"},
            {"id": "v", "url": urls["v"], "models": ["m"], "vision": "native"},
        ]
        app = create_app(load_settings(None, backends=backends, canary={"enabled": False}))
        url, _ = stack.enter_context(serve(app))
        body = turn1()
        body["messages"] = [{"role": "user", "content": [IMAGE, {"type": "text", "text": "what is it?"}]}]
        for _ in range(3):
            r = post(url, {**body, "system": f"s{_}"})
            assert (r.status_code, r.headers["x-warmroute-backend"]) == (200, "v")
        bad = {
            **body,
            "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}],
        }
        assert "source" in anthropic_error(post(url, bad), 400, "invalid_request_error")
    assert text_only.requests == [] and len(seeing.requests) == 3


def test_a_count_of_image_blocks_goes_only_where_its_turn_could() -> None:
    """The count's candidates are its turn's: never a text-only backend; a model with only text-only
    backends is a 400 on the count as on the turn."""
    text_only, seeing = AnthropicEngine("t"), AnthropicEngine("v")
    with contextlib.ExitStack() as stack:
        urls = {e.name: stack.enter_context(serve(e.app()))[0] for e in (text_only, seeing)}
        backends = [
            {"id": "t", "url": urls["t"], "models": ["m", "text"], "vision": "none"},
            {"id": "v", "url": urls["v"], "models": ["m"], "vision": "native"},
        ]
        app = create_app(load_settings(None, backends=backends, canary={"enabled": False}))
        url, _ = stack.enter_context(serve(app))
        content = [IMAGE, {"type": "text", "text": "what is it?"}]
        for i in range(4):
            count = {"model": "m", "system": f"s{i}", "messages": [{"role": "user", "content": content}]}
            r = post(url, count, COUNT)
            assert (r.status_code, r.headers["x-warmroute-backend"]) == (200, "v")
        text = {"model": "text", "messages": [{"role": "user", "content": content}]}
        assert "text-only" in anthropic_error(post(url, text, COUNT), 400, "invalid_request_error")
    assert text_only.requests == [] and seeing.paths == [COUNT] * 4


def test_image_blocks_for_embeds_backends_with_the_sidecar_down_are_an_anthropic_503() -> None:
    """Image blocks reach an embeds backend as chat through the sidecar (tests/gateway/
    test_vision_agent_shapes.py); with no sidecar to encode them the answer is Anthropic's overloaded
    error, never the blocks sent unencoded, and text goes there as ever."""
    engine = AnthropicEngine("e")
    sidecar = {"url": "http://127.0.0.1:9"}  # nothing listens: the sidecar is down
    with gateway([engine], {"vision": "embeds"}, sidecar=sidecar) as (url, _gw):
        body = turn1()
        body["messages"] = [{"role": "user", "content": [IMAGE]}]
        message = anthropic_error(post(url, body), 503, "overloaded_error")
        assert "vision sidecar" in message
        assert post(url, turn1()).status_code == 200
    assert len(engine.requests) == 1


# -- a stream that waited for an on-demand engine ------------------------------------------------------------


@pytest.mark.anyio
async def test_an_error_after_an_early_stream_head_ends_the_stream_in_anthropic_s_shape() -> None:
    sent: list[Message] = []

    async def out(message: Message) -> None:
        sent.append(message)

    send = EarlyHeadSend(out, ANTHROPIC_ERRORS)
    await send.head()
    await send_error(send, NoHealthyBackend("backend a failed to start: boom"), ANTHROPIC_ERRORS)
    end = sent[-1]["body"]
    assert end.startswith(b"event: error\ndata: ") and end.endswith(b"\n\n") and b"[DONE]" not in end
    error = json.loads(end.removeprefix(b"event: error\ndata: "))
    assert error == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "HTTP 503: backend a failed to start: boom"},
    }


def test_the_admin_dry_run_keys_a_messages_body_as_the_endpoint_does(cluster: ClusterFactory) -> None:
    c = cluster(engines=[AnthropicEngine("a")])
    for path in (MSG, COUNT):
        r = httpx.post(c.url + "/admin/route/explain", json={"path": path, "body": turn1()})
        assert r.status_code == 200, r.text
        assert r.json()["key"] == messages_key(turn1())
    sample = {"path": MSG, "body": {"model": "m", "messages": []}}
    bad = httpx.post(c.url + "/admin/route/explain", json=sample)
    assert bad.status_code == 400 and "max_tokens" in bad.text


def test_under_ttft_a_later_turn_s_count_goes_where_that_turn_goes(cluster: ClusterFactory) -> None:
    """No session id: turn 2 is told apart by its first reply (the key grows a reply hash, the engine that
    wrote that reply is its home); its count must follow the same key and home, not land as a new head."""
    c = cluster(engines=[AnthropicEngine("a"), AnthropicEngine("b")])  # the default policy, ttft
    first = post(c.url, turn1())
    home = first.headers["x-warmroute-backend"]
    c.wait_idle()
    count_body = {k: v for k, v in turn2().items() if k != "max_tokens"}
    counted = [post(c.url, count_body, COUNT) for _ in range(3)]  # a count teaches nothing: same answer
    assert [r.headers["x-warmroute-backend"] for r in counted] == [home] * 3
    dry = httpx.post(c.url + "/admin/route/explain", json={"path": COUNT, "body": count_body}).json()
    assert dry["backend"] == home and dry["reason"] == counted[0].headers["x-warmroute-route"]
    second = post(c.url, turn2())
    assert second.headers["x-warmroute-backend"] == home
    assert {r.headers["x-warmroute-route"] for r in counted} == {second.headers["x-warmroute-route"]}
