import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from backends.sim import SimConfig
from backends.sim.testing import asgi_client

pytestmark = pytest.mark.anyio


CFG = SimConfig(time_scale=0, reasoning_tokens=(40, 40), answer_tokens=(6, 6))


def chat(**extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "think about it"}], "max_tokens": 100, **extra}


THINK = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture
async def thinker() -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(CFG) as c:
        yield c


async def test_thinking_emits_reasoning_then_answer(thinker: httpx.AsyncClient) -> None:
    body = (await thinker.post("/v1/chat/completions", json=chat(**THINK))).json()
    message = body["choices"][0]["message"]
    assert len(message["reasoning"].split()) == 40
    assert message["reasoning_content"] == message["reasoning"]
    assert len(message["content"].split()) == 6
    assert body["usage"]["completion_tokens"] == 46
    assert body["choices"][0]["finish_reason"] == "stop"


async def test_budget_cuts_reasoning(thinker: httpx.AsyncClient) -> None:
    body = (await thinker.post("/v1/chat/completions", json=chat(thinking_token_budget=5, **THINK))).json()
    message = body["choices"][0]["message"]
    assert len(message["reasoning"].split()) == 5
    assert len(message["content"].split()) == 6
    assert body["usage"]["completion_tokens"] == 11
    zero = (await thinker.post("/v1/chat/completions", json=chat(thinking_token_budget=0, **THINK))).json()
    assert zero["choices"][0]["message"]["reasoning"] == ""


async def test_budget_cut_while_streaming(thinker: httpx.AsyncClient) -> None:
    r = await thinker.post("/v1/chat/completions", json=chat(stream=True, thinking_token_budget=3, **THINK))
    deltas = [json.loads(e[6:])["choices"][0]["delta"] for e in r.text.split("\n\n")[:-2]]
    reasoning = [d["reasoning"] for d in deltas if "reasoning" in d]
    assert len(reasoning) == 3 and all(
        d["reasoning_content"] == d["reasoning"] for d in deltas if "reasoning" in d
    )
    kinds = ["r" if "reasoning" in d else "c" for d in deltas if "reasoning" in d or d.get("content")]
    assert kinds == ["r"] * 3 + ["c"] * 6


async def test_thinking_can_eat_the_whole_output_budget(thinker: httpx.AsyncClient) -> None:
    body = (await thinker.post("/v1/chat/completions", json=chat(max_tokens=10, **THINK))).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["message"]["reasoning"].split()) == 10
    assert choice["message"]["content"] is None


@pytest.mark.parametrize(
    ("extra", "thinks"),
    [
        ({}, False),
        ({"reasoning_effort": "low"}, True),
        ({"reasoning_effort": "none"}, False),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"chat_template_kwargs": {"enable_thinking": True}, "reasoning_effort": "none"}, False),
    ],
)
async def test_what_turns_thinking_on(
    thinker: httpx.AsyncClient, extra: dict[str, Any], thinks: bool
) -> None:
    message = (await thinker.post("/v1/chat/completions", json=chat(**extra))).json()["choices"][0]["message"]
    assert ("reasoning" in message) is thinks


async def test_engine_default_reasoning_can_be_turned_off() -> None:
    async with asgi_client(SimConfig(time_scale=0, reasoning=True)) as c:
        on = (await c.post("/v1/chat/completions", json=chat())).json()["choices"][0]["message"]
        off = (await c.post("/v1/chat/completions", json=chat(reasoning_effort="none"))).json()
    assert "reasoning" in on
    assert "reasoning" not in off["choices"][0]["message"]


@pytest.mark.parametrize(
    "extra",
    [
        {"thinking_token_budget": -1},
        {"thinking_token_budget": 2.5},
        {"thinking_token_budget": "10"},
        {"thinking_token_budget": True},
        {"reasoning_effort": "extreme"},
        {"chat_template_kwargs": {"enable_thinking": "yes"}},
    ],
)
async def test_invalid_thinking_fields_are_rejected(
    thinker: httpx.AsyncClient, extra: dict[str, Any]
) -> None:
    r = await thinker.post("/v1/chat/completions", json=chat(**THINK | extra))
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
