"""Thinking budgets on real vLLM (`--reasoning-parser qwen3`, a template that opens `<think>`).

Reasoning tokens are counted with the model's own tokenizer (the engine's /tokenize). The native path sends
`thinking_token_budget`; the gateway-enforced path is the same engine configured as dialect `openai`, where
the gateway stops phase 1 at the budget and continues on the same engine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from config.settings import load_settings
from gateway.app import create_app

from .engines import VllmEngine
from .gateways import FAST_HEALTH, MODEL, RunningGateway
from upstreams import serve

BUDGET = 8
MSGS = [{"role": "user", "content": "Think about the routing of tokens, then answer."}]
# ignore_eos: the random-weight model then always generates max_tokens tokens, so an answer is always there.
BODY: dict[str, Any] = {
    "model": MODEL,
    "messages": MSGS,
    "max_tokens": 40,
    "temperature": 0,
    "ignore_eos": True,
}


@contextlib.contextmanager
def _gateway(engine: VllmEngine, dialect: str) -> Iterator[RunningGateway]:
    backends = [{"id": engine.name, "url": engine.base_url, "models": [MODEL], "dialect": dialect}]
    app = create_app(load_settings(None, backends=backends, health=FAST_HEALTH))
    with serve(app) as (url, _server):
        yield RunningGateway(url, "affinity", app.state.gateway)


@pytest.fixture(scope="module")
def native(vllm_engines: list[VllmEngine]) -> Iterator[RunningGateway]:
    with _gateway(vllm_engines[0], "vllm") as gw:
        yield gw


@pytest.fixture(scope="module")
def enforced(vllm_engines: list[VllmEngine]) -> Iterator[RunningGateway]:
    with _gateway(vllm_engines[0], "openai") as gw:
        yield gw


def _tokens(engine: VllmEngine, text: str) -> int:
    body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
    r = httpx.post(f"{engine.base_url}/tokenize", json=body, timeout=30)
    r.raise_for_status()
    return int(r.json()["count"])


def _post(gw: RunningGateway, **fields: Any) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", json={**BODY, **fields}, timeout=120)


def test_native_budget_caps_reasoning(native: RunningGateway, vllm_engines: list[VllmEngine]) -> None:
    unlimited = _post(native).json()["choices"][0]["message"]
    assert _tokens(vllm_engines[0], unlimited["reasoning"] or "") > BUDGET  # without a cap it thinks on
    r = _post(native, thinking_budget=BUDGET)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert 0 < _tokens(vllm_engines[0], message["reasoning"]) <= BUDGET
    assert message["reasoning_content"] == message["reasoning"]  # default: both fields
    assert message["content"]


def test_gateway_enforced_budget_caps_reasoning(
    enforced: RunningGateway, vllm_engines: list[VllmEngine]
) -> None:
    r = _post(enforced, thinking_budget=BUDGET)
    assert r.status_code == 200, r.text
    out = r.json()
    message = out["choices"][0]["message"]
    assert 0 < _tokens(vllm_engines[0], message["reasoning"]) <= BUDGET
    assert message["content"]
    assert out["usage"]["completion_tokens"] == 40  # both phases: max_tokens is the client's, not per phase
    assert enforced.gateway.metrics.tally.truncations >= 1
    assert enforced.wait_idle() == 0


def test_bad_effort_is_refused_by_the_gateway(native: RunningGateway) -> None:
    r = _post(native, reasoning_effort="enormous")
    assert r.status_code == 400
    err = r.json()["error"]
    assert (
        err["param"] == "reasoning_effort"
        and "none, minimal, low, medium, high, xhigh, max" in err["message"]
    )
    assert "x-warmroute-backend" not in r.headers  # answered at the edge, no engine chosen


@pytest.mark.parametrize("fields", [{"thinking_budget": 0}, {"reasoning_effort": "none"}])
def test_budget_zero_means_no_reasoning(native: RunningGateway, fields: dict[str, Any]) -> None:
    r = _post(native, **fields)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert not message.get("reasoning") and not message.get("reasoning_content")
    assert message["content"]


def test_openai_client_reads_the_stitched_stream(
    enforced: RunningGateway, vllm_engines: list[VllmEngine]
) -> None:
    client = enforced.client()
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MSGS,  # type: ignore[arg-type]
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"thinking_budget": BUDGET, "ignore_eos": True},
    )
    ids, reasoning, content, finishes, usage = set(), [], [], [], None
    for chunk in stream:
        ids.add(chunk.id)
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            reasoning.append(extra.get("reasoning") or "")
            content.append(choice.delta.content or "")
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert len(ids) == 1 and finishes == ["length"]
    assert 0 < _tokens(vllm_engines[0], "".join(reasoning)) <= BUDGET
    assert "".join(content)
    assert usage is not None and usage.completion_tokens == 40
