import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import httpx2
import openai
import pytest
from openai.types.responses import Response

from backends.sim import SimConfig, create_sim_app
from backends.sim.testing import asgi_client

pytestmark = pytest.mark.anyio

CFG = SimConfig(name="r", time_scale=0, answer_tokens=(5, 5), reasoning_tokens=(7, 7))
INSTRUCTIONS = " ".join(f"ins{i}" for i in range(100))
TOOLS = [{"type": "function", "name": "shell", "parameters": {"type": "object"}}]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(CFG) as c:
        yield c


def body(input_: Any, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "instructions": INSTRUCTIONS, "tools": TOOLS, "input": input_, **extra}


def user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def assistant(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}


def events(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.split("\n\n")[:-1]:
        name_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name_line.removeprefix("event: ")
        out.append(data)
    return out


def reply_text(response: dict[str, Any]) -> str:
    message = [item for item in response["output"] if item["type"] == "message"][-1]
    return str(message["content"][0]["text"])


async def test_json_response_is_the_sdk_response_with_cached_tokens(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/responses", json=body("hello there"))
    assert r.status_code == 200 and r.headers["x-sim-name"] == "r"
    response = Response.model_validate(r.json())
    assert (
        response.object == "response" and response.status == "completed" and response.id.startswith("resp_")
    )
    assert response.output_text and len(response.output_text.split()) == 5
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens == 0
    again = (await client.post("/v1/responses", json=body("hello there"))).json()["usage"]
    assert again["input_tokens"] == response.usage.input_tokens
    assert again["input_tokens_details"]["cached_tokens"] == (again["input_tokens"] - 1) // 16 * 16 > 0
    assert again["output_tokens"] == 5 and again["total_tokens"] == again["input_tokens"] + 5


async def test_stream_events_numbered_in_order(client: httpx.AsyncClient) -> None:
    got = events((await client.post("/v1/responses", json=body("stream me", stream=True))).text)
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    assert [e["type"] for e in got] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 5,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert got[0]["response"]["status"] == "in_progress" and got[0]["response"]["output"] == []
    deltas = "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta")
    assert got[-4]["text"] == deltas == reply_text(got[-1]["response"])
    assert {e["item_id"] for e in got if "item_id" in e} == {got[2]["item"]["id"]}
    final = Response.model_validate(got[-1]["response"])
    assert final.usage is not None and final.usage.output_tokens == 5


async def test_reasoning_effort_adds_a_reasoning_item_first(client: httpx.AsyncClient) -> None:
    got = events(
        (
            await client.post("/v1/responses", json=body("think", stream=True, reasoning={"effort": "low"}))
        ).text
    )
    added = [e["item"]["type"] for e in got if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    assert sum(e["type"] == "response.reasoning_text.delta" for e in got) == 7
    final = got[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["reasoning", "message"]
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 7
    off = (await client.post("/v1/responses", json=body("think", reasoning={"effort": "none"}))).json()
    assert [i["type"] for i in off["output"]] == ["message"]


async def test_previous_response_id_renders_as_the_full_input_would(client: httpx.AsyncClient) -> None:
    task = "fix it " + " ".join(f"w{i}" for i in range(80))
    first = (await client.post("/v1/responses", json=body(task))).json()
    chained = (
        await client.post("/v1/responses", json=body("now the tests", previous_response_id=first["id"]))
    ).json()
    assert chained["previous_response_id"] == first["id"]
    full_input = [user(task), assistant(reply_text(first)), user("now the tests")]
    codex = (await client.post("/v1/responses", json=body(full_input, store=False))).json()
    assert chained["usage"]["input_tokens"] == codex["usage"]["input_tokens"]
    assert reply_text(chained) == reply_text(codex)  # same prompt, same words
    cached = chained["usage"]["input_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["input_tokens"] // 16 * 16 > 0
    assert (
        codex["usage"]["input_tokens_details"]["cached_tokens"]
        == (codex["usage"]["input_tokens"] - 1) // 16 * 16
    )


async def test_previous_response_id_works_only_on_the_process_that_made_it(client: httpx.AsyncClient) -> None:
    first = (await client.post("/v1/responses", json=body("hello"))).json()
    for cfg in (SimConfig(name="other", time_scale=0), SimConfig(time_scale=0, responses_store=False)):
        async with asgi_client(cfg) as other:
            r = await other.post("/v1/responses", json=body("again", previous_response_id=first["id"]))
            assert r.status_code == 404
            message = f"Response with id '{first['id']}' not found."
            error = {"message": message, "type": "invalid_request_error", "param": "response_id", "code": 404}
            assert r.json() == {"error": error}
            assert (await other.get(f"/v1/responses/{first['id']}")).status_code == 404


async def test_get_input_items_cancel_and_delete_a_stored_response(client: httpx.AsyncClient) -> None:
    made = (await client.post("/v1/responses", json=body([user("one"), user("two")]))).json()
    rid = made["id"]
    assert (await client.get(f"/v1/responses/{rid}")).json() == made
    items = (await client.get(f"/v1/responses/{rid}/input_items")).json()
    assert items["object"] == "list" and items["has_more"] is False
    assert [i["content"][0]["text"] for i in items["data"]] == ["two", "one"]  # newest first, as OpenAI
    asc = (await client.get(f"/v1/responses/{rid}/input_items", params={"order": "asc", "limit": 1})).json()
    assert [i["content"][0]["text"] for i in asc["data"]] == ["one"] and asc["has_more"] is True
    assert asc["first_id"] == asc["last_id"] == asc["data"][0]["id"]
    cancel = await client.post(f"/v1/responses/{rid}/cancel")
    assert (
        cancel.status_code == 400
        and cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
    )
    deleted = await client.delete(f"/v1/responses/{rid}")
    assert deleted.json() == {"id": rid, "object": "response", "deleted": True}
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/cancel"), ("GET", "/input_items")):
        assert (await client.request(method, f"/v1/responses/{rid}{path}")).status_code == 404
    stats = (await client.get("/sim/stats")).json()["paths"]
    assert stats["/v1/responses"] == 1 and stats["/v1/responses/{response_id}"] == 9


async def test_store_false_keeps_nothing(client: httpx.AsyncClient) -> None:
    made = (await client.post("/v1/responses", json=body("x", store=False))).json()
    assert made["store"] is False
    assert (await client.get(f"/v1/responses/{made['id']}")).status_code == 404
    streamed = events((await client.post("/v1/responses", json=body("x", stream=True))).text)[-1]["response"]
    assert (await client.get(f"/v1/responses/{streamed['id']}")).json()["usage"] == streamed["usage"]


@pytest.mark.parametrize(
    "payload",
    [
        b"[]",
        json.dumps({"model": "sim-model"}).encode(),
        json.dumps(body([])).encode(),
        json.dumps(body([{"type": "computer_call"}])).encode(),
        json.dumps(body([{"role": "robot", "content": "x"}])).encode(),
        json.dumps(body("x", instructions=3)).encode(),
        json.dumps(body("x", reasoning={"effort": "galaxy"})).encode(),
        json.dumps(body("x", max_output_tokens=0)).encode(),
        json.dumps(body("x", tools="all")).encode(),
    ],
)
async def test_bad_requests_get_openai_errors(client: httpx.AsyncClient, payload: bytes) -> None:
    r = await client.post("/v1/responses", content=payload)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["message"]


async def test_turned_off_responses_api_answers_404() -> None:
    async with asgi_client(SimConfig(time_scale=0, responses_api=False)) as c:
        assert (await c.post("/v1/responses", json=body("x"))).status_code == 404
        assert (await c.get("/v1/responses/resp_1")).status_code == 404
        assert (
            await c.post(
                "/v1/messages", json={"max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}
            )
        ).status_code == 200


async def test_the_openai_sdk_reads_both_forms_and_chains() -> None:
    http_client = openai.DefaultAsyncHttpxClient(transport=httpx2.ASGITransport(app=create_sim_app(CFG)))
    async with openai.AsyncOpenAI(api_key="k", base_url="http://sim/v1", http_client=http_client) as sdk:
        first = await sdk.responses.create(model="sim-model", input="hi", instructions=INSTRUCTIONS)
        stream = await sdk.responses.create(
            model="sim-model", input="and more", previous_response_id=first.id, stream=True
        )
        kinds = [event.type async for event in stream]
        fetched = await sdk.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError):
            await sdk.responses.create(model="sim-model", input="x", previous_response_id="resp_nope")
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert fetched.output_text == first.output_text
