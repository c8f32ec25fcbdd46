"""Translation where an engine lacks a shape, through the gateway: a Messages or Responses request reaches a
chat-only engine as the chat request it asks for (exact bytes, at /v1/chat/completions), and the client gets
its own shape back, streamed or whole, errors included; the official SDKs are the callers.

The shapes here are test-local and minimal (named as the real ones, ``ShapeName`` values): translation reads
only their name, their error rendering and their usage reader.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from config.settings import RoutingConfig, load_settings
from gateway.app import create_app
from gateway.context import canonical_json
from gateway.errors import BadRequest, GatewayError
from gateway.observe import Usage
from gateway.shapes.base import ApiShape, ErrorShape, ThinkingUse
from gateway.shapes.table import SHAPES
from gateway.translate import messages as messages_translate
from gateway.translate import responses as responses_translate
from routing.load import tie_break

from clusters import Cluster, loop_of
from upstreams import PROBE_TIMEOUT_S, FakeEngine, _is_canary, serve

# -- minimal client shapes --------------------------------------------------------------------------------


def validate(body: dict[str, Any]) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required", param="model")
    return model


def key(body: dict[str, Any], model: str, routing: RoutingConfig) -> str:
    return f"t:{model}:{body.get('instructions') or ''}"


def _last_usage(tail: bytes) -> dict[str, Any] | None:
    at = tail.rfind(b'"usage":')
    if at < 0:
        return None
    found = json.JSONDecoder().raw_decode(tail[at + len(b'"usage":') :].decode())[0]
    return found if isinstance(found, dict) else None


def anthropic_usage(tail: bytes) -> Usage | None:
    u = _last_usage(tail)
    if u is None:
        return None
    cached = u.get("cache_read_input_tokens") or 0
    return Usage(u["input_tokens"] + cached, u["output_tokens"], cached)


def responses_usage(tail: bytes) -> Usage | None:
    u = _last_usage(tail)
    if u is None:
        return None
    return Usage(u["input_tokens"], u["output_tokens"], u["input_tokens_details"]["cached_tokens"])


def anthropic_body(err: GatewayError) -> bytes:
    kind = "invalid_request_error" if err.status < 500 else "api_error"
    return json.dumps({"type": "error", "error": {"type": kind, "message": err.message}}).encode()


def anthropic_end(err: GatewayError) -> bytes:
    return b"event: error\ndata: " + anthropic_body(err) + b"\n\n"


MESSAGES = ApiShape(
    name="messages",
    path="/v1/messages",
    validate=validate,
    key=key,
    errors=ErrorShape(anthropic_body, anthropic_end),
    usage=anthropic_usage,
    text_key=b'"text":',
)
RESPONSES = ApiShape(
    name="responses", path="/v1/responses", validate=validate, key=key, usage=responses_usage
)
ALL = (*SHAPES, MESSAGES, RESPONSES)

# -- a chat-only engine answering from a script --------------------------------------------------------------


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "chatcmpl-7", "object": "chat.completion.chunk", "model": "m", "choices": choices, **extra}


USAGE = {"prompt_tokens": 40, "completion_tokens": 6, "prompt_tokens_details": {"cached_tokens": 16}}
TOOL_STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "need ls"}),
    chunk({"content": "Looking"}),
    chunk(
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "ls", "arguments": '{"pa'},
                }
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'th": "/"}'}}]}),
    chunk({}, "tool_calls"),
    chunk(usage=USAGE),
]
TOOL_WHOLE = {
    "id": "chatcmpl-7",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Looking",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "ls", "arguments": '{"path": "/"}'},
                    }
                ],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": USAGE,
}


@dataclass
class ChatOnly(FakeEngine):
    """Answers chat with ``stream`` (chunks, then [DONE]) or ``whole``; or ``refuse`` as (status, body)."""

    stream: list[dict[str, Any]] = field(default_factory=lambda: list(TOOL_STREAM))
    whole: dict[str, Any] = field(default_factory=lambda: dict(TOOL_WHOLE))
    refuse: tuple[int, dict[str, Any]] | None = None

    async def _chat(self, request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        if _is_canary(body):
            return await super()._chat(request)
        self.raw.append(raw)
        self.paths.append(request.scope["raw_path"].decode("latin-1"))
        self.requests.append(body)
        if self.refuse is not None:
            return JSONResponse(self.refuse[1], self.refuse[0])
        if not body.get("stream"):
            return JSONResponse(self.whole)

        async def events() -> AsyncIterator[bytes]:
            for c in self.stream:
                yield b"data: " + json.dumps(c).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def gateway() -> Iterator[Any]:
    """``gateway(engine, dialect, more=[(engine, {backend fields})])``: engines behind a gateway serving
    ``ALL`` shapes."""
    stack = contextlib.ExitStack()

    def make(
        engine: FakeEngine,
        dialect: str = "openai",
        more: Sequence[tuple[FakeEngine, dict[str, Any]]] = (),
        shapes: tuple[ApiShape, ...] = ALL,
        **fields: Any,  # more backend fields of ``engine``
    ) -> Cluster:
        backends, servers = [], {}
        for fake, extra in [(engine, {"dialect": dialect, **fields}), *more]:
            url, servers[fake.name] = stack.enter_context(serve(fake.app()))
            backends.append({"id": fake.name, "url": url, "models": list(fake.models), **extra})
        settings = load_settings(
            None, backends=backends, health={"interval_s": 0.2, "timeout_s": PROBE_TIMEOUT_S}
        )
        app = create_app(settings, shapes=shapes)
        gw_url, gw_server = stack.enter_context(serve(app))
        engines = {engine.name: engine, **{fake.name: fake for fake, _ in more}}
        return Cluster(gw_url, engines, servers, app.state.gateway, loop_of(gw_server))

    with stack:
        yield make


TOOLS = [{"name": "ls", "description": "list a directory", "input_schema": {"type": "object"}}]
ASK = {"model": "m", "max_tokens": 256, "tools": TOOLS, "messages": [{"role": "user", "content": "list /"}]}


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            head, data = block.split("\n")
            out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


# -- Messages ------------------------------------------------------------------------------------------------


def test_a_messages_request_reaches_a_chat_only_engine_as_chat_and_the_answer_comes_back_as_a_message(
    gateway: Any,
) -> None:
    c = gateway(ChatOnly("a"))
    r = httpx.post(c.url + "/v1/messages?beta=true", json=ASK)
    assert r.status_code == 200, r.text
    engine = c.engines["a"]
    assert engine.paths == ["/v1/chat/completions"]  # the attempt's own path, no client query
    assert engine.raw == [canonical_json(messages_translate.request(ASK))]  # exactly the translation's bytes
    assert engine.requests[0]["messages"] == [{"role": "user", "content": "list /"}]
    assert r.json() == messages_translate.response(TOOL_WHOLE, "m")
    assert r.json()["content"][1] == {
        "type": "tool_use",
        "id": "call_1",
        "name": "ls",
        "input": {"path": "/"},
    }
    c.wait_idle()
    lines = httpx.get(c.url + "/metrics").text.splitlines()  # the observers read the client's shape
    assert 'warmroute_prompt_tokens_total{backend="a",model="m"} 40.0' in lines
    assert 'warmroute_cached_prompt_tokens_total{backend="a",model="m"} 16.0' in lines


def test_a_streamed_messages_request_gets_anthropic_events(gateway: Any) -> None:
    c = gateway(ChatOnly("a"))
    r = httpx.post(c.url + "/v1/messages", json={**ASK, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert c.engines["a"].requests[0]["stream_options"] == {"include_usage": True}
    names = [name for name, _ in sse_events(r.content)]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert b"[DONE]" not in r.content
    final = sse_events(r.content)[-2][1]
    assert final["delta"]["stop_reason"] == "tool_use"
    assert final["usage"] == {
        "input_tokens": 24,
        "output_tokens": 6,
        "cache_read_input_tokens": 16,
        "cache_creation_input_tokens": 0,
    }
    c.wait_idle()
    lines = httpx.get(c.url + "/metrics").text.splitlines()
    assert 'warmroute_completion_tokens_total{backend="a",model="m"} 6.0' in lines


def test_the_anthropic_sdk_against_a_chat_only_engine_whole_and_streamed(gateway: Any) -> None:
    c = gateway(ChatOnly("a"))
    client = anthropic.Anthropic(base_url=c.url, api_key="k", max_retries=0)
    msg = client.messages.create(
        model="m", max_tokens=256, tools=TOOLS, messages=[{"role": "user", "content": "x"}]
    )  # type: ignore[arg-type]
    assert [b.type for b in msg.content] == ["text", "tool_use"]
    tool = msg.content[1]
    assert tool.type == "tool_use" and (tool.name, tool.input) == ("ls", {"path": "/"})
    assert (msg.stop_reason, msg.usage.input_tokens, msg.usage.cache_read_input_tokens) == (
        "tool_use",
        24,
        16,
    )
    with client.messages.stream(
        model="m",
        max_tokens=256,
        tools=TOOLS,
        messages=[{"role": "user", "content": "x"}],  # type: ignore[arg-type]
    ) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].type == "thinking" and final.content[0].thinking == "need ls"
    assert final.content[1].type == "text" and final.content[1].text == "Looking"
    assert final.content[2].type == "tool_use" and final.content[2].input == {"path": "/"}
    assert (final.stop_reason, final.usage.output_tokens, final.usage.input_tokens) == ("tool_use", 6, 24)
    # The SDK sends the tool result back: the engine gets a tool message after the assistant's call.
    follow = [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "call_1", "name": "ls", "input": {"path": "/"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "bin etc"}]},
    ]
    client.messages.create(model="m", max_tokens=256, tools=TOOLS, messages=follow)  # type: ignore[arg-type]
    assert c.engines["a"].requests[-1]["messages"][1:] == [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": '{"path":"/"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "bin etc"},
    ]


def test_an_engine_s_4xx_and_a_refused_field_are_the_client_shape_s_errors(gateway: Any) -> None:
    engine = ChatOnly(
        "a", refuse=(400, {"error": {"message": "context too long", "type": "BadRequestError"}})
    )
    c = gateway(engine)
    client = anthropic.Anthropic(base_url=c.url, api_key="k", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert err.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "context too long"},
    }
    refused = httpx.post(c.url + "/v1/messages", json={**ASK, "mcp_servers": [{"type": "url", "url": "x"}]})
    assert refused.status_code == 400
    assert refused.json()["error"]["type"] == "invalid_request_error"
    assert "'mcp_servers' cannot be translated" in refused.json()["error"]["message"]
    assert len(engine.requests) == 1  # the refused request never reached the engine
    c.wait_idle()
    assert c.in_flight() == 0


def test_an_engine_error_mid_stream_ends_the_stream_in_the_client_s_shape(gateway: Any) -> None:
    boom = [
        chunk({"content": "par"}),
        {"error": {"message": "engine fell over", "type": "InternalServerError"}},
    ]
    c = gateway(ChatOnly("a", stream=boom))
    r = httpx.post(c.url + "/v1/messages", json={**ASK, "stream": True})
    events = sse_events(r.content)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    assert "engine fell over" in events[-1][1]["error"]["message"]
    c.wait_idle()
    lines = httpx.get(c.url + "/metrics").text.splitlines()
    assert 'warmroute_requests_total{backend="a",outcome="mid_stream_error"} 1.0' in lines


def test_an_engine_serving_the_shape_gets_the_client_s_bytes_and_chat_is_untouched(gateway: Any) -> None:
    c = gateway(ChatOnly("a"), dialect="vllm")  # vLLM serves /v1/messages itself
    sent = json.dumps(ASK).encode()
    r = httpx.post(c.url + "/v1/messages", content=sent, headers={"content-type": "application/json"})
    assert r.json()["target"] == "/v1/messages"  # the fake engine's catch-all echoes what arrived
    assert c.engines["a"].raw == [sent]
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    chat_sent = json.dumps(chat).encode()
    r = httpx.post(
        c.url + "/v1/chat/completions", content=chat_sent, headers={"content-type": "application/json"}
    )
    assert r.json() == TOOL_WHOLE  # relayed as the engine sent it: nothing translated
    assert c.engines["a"].raw[-1] == chat_sent


# -- Responses -----------------------------------------------------------------------------------------------

CODEX = {
    "model": "m",
    "instructions": "You are Codex.",
    "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list /"}]}],
    "tools": [{"type": "function", "name": "ls", "parameters": {"type": "object"}}],
    "store": False,
}


def test_a_responses_request_to_llama_cpp_is_translated_and_the_openai_sdk_reads_the_answer(
    gateway: Any,
) -> None:
    c = gateway(ChatOnly("a"), dialect="llamacpp")  # llama.cpp: no /v1/responses counted as native
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="k", max_retries=0)
    resp = client.responses.create(**CODEX)  # type: ignore[arg-type]
    engine = c.engines["a"]
    assert engine.paths == ["/v1/chat/completions"]
    assert engine.raw == [canonical_json(responses_translate.request(CODEX))]
    assert resp.output_text == "Looking"
    call = resp.output[1]
    assert call.type == "function_call" and (call.name, call.arguments, call.call_id) == (
        "ls",
        '{"path": "/"}',
        "call_1",
    )
    assert resp.usage is not None and resp.usage.input_tokens_details.cached_tokens == 16
    with client.responses.stream(**CODEX) as stream:  # type: ignore[arg-type]
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.reasoning_text.delta" in kinds and "response.function_call_arguments.delta" in kinds
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "Looking"
    fc = final.output[2]
    assert fc.type == "function_call" and fc.arguments == '{"path": "/"}'
    assert final.usage is not None and (final.usage.input_tokens, final.usage.output_tokens) == (40, 6)
    c.wait_idle()
    lines = httpx.get(c.url + "/metrics").text.splitlines()
    assert (
        'warmroute_prompt_tokens_total{backend="a",model="m"} 80.0' in lines
    )  # both, from the client's shape


def test_previous_response_id_cannot_reach_a_chat_engine(gateway: Any) -> None:
    c = gateway(ChatOnly("a"), dialect="llamacpp")
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="m", input="more", previous_response_id="resp_1")
    assert err.value.param == "previous_response_id"  # type: ignore[attr-defined]
    assert c.engines["a"].requests == []


# -- per attempt ---------------------------------------------------------------------------------------------


def test_a_backend_s_own_native_shapes_override_its_dialect_s(gateway: Any) -> None:
    """vLLM serves both shapes; one configured ``native_shapes: [chat, completions]`` gets them as chat."""
    plain, turned_off = ChatOnly("plain"), ChatOnly("off")
    c = gateway(
        plain,
        dialect="vllm",
        more=[(turned_off, {"dialect": "vllm", "native_shapes": ["chat", "completions"]})],
    )
    for n in range(2):  # two conversations: least-loaded puts the second on the other backend
        body = {**CODEX, "instructions": f"session {n}"}
        assert httpx.post(c.url + "/v1/responses", json=body).status_code == 200
    assert plain.paths == ["/v1/responses"]
    assert turned_off.paths == ["/v1/chat/completions"]


def test_a_retry_on_an_engine_serving_the_shape_sends_the_client_s_own_bytes(gateway: Any) -> None:
    first, second = sorted(["a", "b"], key=lambda name: tie_break("t:m:", name))  # the order they are tried
    failing = ChatOnly(first, refuse=(500, {"error": {"message": "overloaded"}}))
    native = ChatOnly(second)
    c = gateway(failing, dialect="openai", more=[(native, {"dialect": "vllm"})])
    sent = json.dumps({**ASK, "thinking": {"type": "enabled", "budget_tokens": 100}}).encode()
    r = httpx.post(c.url + "/v1/messages", content=sent, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert r.headers["x-warmroute-backend"] == second
    assert failing.paths == ["/v1/chat/completions"]  # the first attempt: translated for its engine
    assert "thinking_budget" not in failing.requests[0]  # nobody resolves it for this test shape: not sent
    assert native.paths == ["/v1/messages"] and native.raw == [sent]  # the retry: the client's own bytes


def test_a_translated_attempt_s_budget_is_spelled_for_chat_or_capped_by_the_gateway(
    gateway: Any,
) -> None:
    """A shape whose budget the endpoint resolves (here from ``thinking_budget``, as chat's): llama.cpp caps
    thinking natively, so the chat request carries its budget fields; a generic server gets the gateway's
    phase 1 (its token limit lowered to the budget) as chat. Two whole phases on the simulator:
    tests/gateway/test_budget_translated.py."""
    resolving = dataclasses.replace(MESSAGES, thinking=ThinkingUse.RESOLVE)
    capped, uncapped = ChatOnly("capped"), ChatOnly("uncapped")
    chat_only = ["chat", "completions"]  # llama.cpp serves /v1/messages itself: this build does not
    c = gateway(capped, dialect="llamacpp", shapes=(*SHAPES, resolving), native_shapes=chat_only)
    ask = {**ASK, "thinking_budget": 64, "thinking": {"type": "enabled", "budget_tokens": 64}}
    assert httpx.post(c.url + "/v1/messages", json=ask).status_code == 200
    sent = capped.requests[0]
    assert (sent["thinking_budget_tokens"], sent["reasoning_budget_tokens"]) == (
        64,
        64,
    )  # llama.cpp's spelling
    assert (
        "thinking_budget" not in sent and "thinking" not in sent
    )  # the gateway's field and Anthropic's: gone
    c = gateway(uncapped, dialect="openai", shapes=(*SHAPES, resolving))
    answered = httpx.post(c.url + "/v1/messages", json=ask)
    assert answered.status_code == 200, answered.text
    (phase1,) = uncapped.requests  # it stopped for a tool call, not at the budget: no phase 2
    assert uncapped.paths == ["/v1/chat/completions"] and phase1["max_tokens"] == 64
    assert "thinking_budget" not in phase1 and "thinking" not in phase1
    c.wait_idle()
    assert c.in_flight() == 0
