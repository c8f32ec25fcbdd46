import json
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx
import httpx2
import pytest
from anthropic.types import Message

from backends.sim import SimConfig, create_sim_app
from backends.sim.testing import asgi_client

pytestmark = pytest.mark.anyio

CFG = SimConfig(name="m", time_scale=0, answer_tokens=(6, 6), reasoning_tokens=(9, 9))
SYSTEM = " ".join(f"sys{i}" for i in range(120))
TOOLS = [{"name": "read_file", "description": "read one file", "input_schema": {"type": "object"}}]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(CFG) as c:
        yield c


def body(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "max_tokens": 50,
        "system": SYSTEM,
        "tools": TOOLS,
        "messages": messages,
        **extra,
    }


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) per SSE event; asserts each event names the type its data carries."""
    out = []
    for block in text.split("\n\n")[:-1]:
        name_line, data_line = block.split("\n")
        name, data = name_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        out.append((name, data))
    return out


async def test_json_message_is_the_sdk_message_with_vllm_usage(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/messages", json=body([user("hello there")]))
    assert r.status_code == 200 and r.headers["x-sim-name"] == "m"
    message = Message.model_validate(r.json())
    assert message.type == "message" and message.role == "assistant" and message.model == "sim-model"
    assert [b.type for b in message.content] == ["text"]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    counted = (await client.post("/v1/messages/count_tokens", json=body([user("hello there")]))).json()
    usage = r.json()["usage"]
    assert usage["cache_read_input_tokens"] == 0  # a cold engine
    # vLLM's arithmetic: input = prompt - cache read - cache creation; creation = full blocks now cached
    assert usage["cache_creation_input_tokens"] == counted["input_tokens"] // 16 * 16
    assert usage["input_tokens"] == counted["input_tokens"] % 16
    assert usage["output_tokens"] == 6
    assert counted == {
        "input_tokens": counted["input_tokens"],
        "context_management": {"original_input_tokens": counted["input_tokens"]},
    }


async def test_stream_events_in_anthropic_order_with_cache_fields_in_message_delta(
    client: httpx.AsyncClient,
) -> None:
    r = await client.post("/v1/messages", json=body([user("stream me")], stream=True))
    assert r.headers["content-type"].startswith("text/event-stream")
    got = events(r.text)
    names = [n for n, _ in got]
    assert names == ["message_start", "content_block_start", "ping", *["content_block_delta"] * 6,
                     "content_block_stop", "message_delta", "message_stop"]  # fmt: skip
    start = got[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert set(start["usage"]) == {"input_tokens", "output_tokens"} and start["usage"]["output_tokens"] == 0
    assert got[1][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    text = "".join(d["delta"]["text"] for n, d in got if n == "content_block_delta")
    assert {d["delta"]["type"] for n, d in got if n == "content_block_delta"} == {"text_delta"}
    delta = got[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert set(delta["usage"]) == {"input_tokens", "output_tokens", "cache_read_input_tokens",
                                   "cache_creation_input_tokens"}  # fmt: skip
    assert sum(delta["usage"][k] for k in ("input_tokens", "cache_read_input_tokens",
               "cache_creation_input_tokens")) == start["usage"]["input_tokens"]  # fmt: skip
    plain = (await client.post("/v1/messages", json=body([user("stream me")]))).json()
    assert plain["content"][0]["text"] == text


async def test_thinking_streams_a_thinking_block_then_text_and_budget_cuts_it(
    client: httpx.AsyncClient,
) -> None:
    thinking = {"type": "enabled", "budget_tokens": 4}
    got = events(
        (await client.post("/v1/messages", json=body([user("think")], stream=True, thinking=thinking))).text
    )
    starts = [d for n, d in got if n == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "thinking"), (1, "text")]
    deltas = [(d["index"], d["delta"]["type"]) for n, d in got if n == "content_block_delta"]
    assert deltas == [(0, "thinking_delta")] * 4 + [(1, "text_delta")] * 6
    assert [d["index"] for n, d in got if n == "content_block_stop"] == [0, 1]
    assert [n for n, _ in got].index("ping") == 2
    full = (
        await client.post("/v1/messages", json=body([user("think")], thinking={"type": "enabled"}))
    ).json()
    assert [b["type"] for b in full["content"]] == ["thinking", "text"]
    assert len(full["content"][0]["thinking"].split()) == 9 and full["content"][0]["signature"]
    off = (
        await client.post("/v1/messages", json=body([user("think")], thinking={"type": "disabled"}))
    ).json()
    assert [b["type"] for b in off["content"]] == ["text"]


async def test_next_turn_of_a_session_reads_the_cache(client: httpx.AsyncClient) -> None:
    turn1 = [user("fix the bug in " + " ".join(f"w{i}" for i in range(100)))]
    r1 = (await client.post("/v1/messages", json=body(turn1))).json()
    turn2 = [*turn1, {"role": "assistant", "content": r1["content"]}, user("the test passes now")]
    r2 = (await client.post("/v1/messages", json=body(turn2))).json()
    prompt1 = sum(r1["usage"][k] for k in ("input_tokens", "cache_creation_input_tokens"))
    # turn 1's prompt and reply were cached: turn 2 reads at least turn 1's full prompt blocks
    assert r2["usage"]["cache_read_input_tokens"] >= prompt1 // 16 * 16 > 0
    call = {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "a.py"}}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "print(1)"}
    tool_turn = [*turn2, {"role": "assistant", "content": [call]}, {"role": "user", "content": [result]}]
    r3 = await client.post("/v1/messages", json=body(tool_turn))
    assert r3.status_code == 200 and r3.json()["usage"]["cache_read_input_tokens"] > 0


async def test_billing_block_is_dropped_as_vllm_does_unless_the_engine_keeps_it() -> None:
    def billing(nonce: str) -> dict[str, Any]:
        header = f"x-anthropic-billing-header: cc_version=2.1.37; cc_entrypoint=cli; cch={nonce};"
        system = [{"type": "text", "text": header}, {"type": "text", "text": SYSTEM}]
        return body([user("same task")], system=system)

    for keep, expect_hit in ((False, True), (True, False)):
        async with asgi_client(SimConfig(time_scale=0, keep_billing_block=keep)) as c:
            await c.post("/v1/messages", json=billing("aaaa"))
            second = (await c.post("/v1/messages", json=billing("bbbb"))).json()["usage"]
            assert (second["cache_read_input_tokens"] > 100) is expect_hit
            assert (second["cache_read_input_tokens"] == 0) is not expect_hit


async def test_tools_and_system_come_first_in_the_prompt(client: httpx.AsyncClient) -> None:
    async def count(**extra: Any) -> int:
        r = await client.post("/v1/messages/count_tokens", json=body([user("a b c")], **extra))
        return int(r.json()["input_tokens"])

    plain = await count(tools=None, system=None)
    assert plain == 3 + 3 + 2  # one message (3 + 3 tokens) and the generation prompt
    assert await count(tools=None) == plain + 3 + 120
    assert await count() > await count(tools=None)


@pytest.mark.parametrize(
    ("payload", "status", "kind"),
    [
        (b"{nope", 400, "invalid_request_error"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(), 400, "invalid_request_error"),
        (json.dumps(body([user("x")], model="nope")).encode(), 404, "not_found_error"),
        (json.dumps(body([{"role": "robot", "content": "x"}])).encode(), 400, "invalid_request_error"),
        (
            json.dumps(body([user("x")], thinking={"type": "sometimes"})).encode(),
            400,
            "invalid_request_error",
        ),
        (
            json.dumps(body([{"role": "user", "content": [{"type": "audio"}]}])).encode(),
            400,
            "invalid_request_error",
        ),
        (json.dumps(body([user("x")], max_tokens=200_000)).encode(), 400, "invalid_request_error"),
    ],
)
async def test_bad_requests_get_anthropic_errors(
    client: httpx.AsyncClient, payload: bytes, status: int, kind: str
) -> None:
    r = await client.post("/v1/messages", content=payload)
    assert r.status_code == status
    doc = r.json()
    assert doc["type"] == "error" and doc["error"]["type"] == kind and doc["error"]["message"]


async def test_injected_failure_is_an_anthropic_api_error() -> None:
    async with asgi_client(SimConfig(time_scale=0)) as c:
        await c.post("/sim/faults", json={"fail_next": 1})
        r = await c.post("/v1/messages", json=body([user("x")]))
        assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"


async def test_turned_off_messages_api_answers_404_like_an_engine_without_it() -> None:
    async with asgi_client(SimConfig(time_scale=0, messages_api=False)) as c:
        assert (await c.post("/v1/messages", json=body([user("x")]))).status_code == 404
        assert (await c.post("/v1/messages/count_tokens", json=body([user("x")]))).status_code == 404
        assert (await c.post("/v1/chat/completions", json={"messages": [user("x")]})).status_code == 200


async def test_the_anthropic_sdk_reads_both_forms() -> None:
    transport = httpx2.ASGITransport(app=create_sim_app(CFG))
    http_client = anthropic.DefaultAsyncHttpxClient(transport=transport)
    async with anthropic.AsyncAnthropic(api_key="k", base_url="http://sim", http_client=http_client) as sdk:
        kwargs: Any = {"model": "sim-model", "max_tokens": 50, "messages": [user("hi")], "system": SYSTEM}
        message = await sdk.messages.create(**kwargs)
        async with sdk.messages.stream(**kwargs) as stream:
            final = await stream.get_final_message()
        counted = await sdk.messages.count_tokens(model="sim-model", messages=[user("hi")], system=SYSTEM)
    assert [b.type for b in final.content] == ["text"]
    assert final.content[0].text == message.content[0].text  # type: ignore[union-attr]
    assert final.usage.cache_read_input_tokens == counted.input_tokens // 16 * 16
    assert final.usage.output_tokens == 6
