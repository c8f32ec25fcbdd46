"""Shaping reads the backend's dialect entry: continuation arguments, who enforces a budget, embeds."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from config.settings import DEFAULT_EARLY_STOP, BudgetEnforcement, Dialect, load_settings
from gateway.app import create_app
from gateway.budgets import Thinking, gateway_enforces
from gateway.context import canonical_json

from clusters import ClusterFactory
from upstreams import serve

MSGS = [{"role": "user", "content": "why is the sky blue"}]


class PhaseEngine:
    """Thinks until the token limit on its first chat request, answers on the second; keeps the raw bodies."""

    def __init__(self) -> None:
        self.raw: list[bytes] = []

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", lambda _r: Response()),
                Route("/v1/models", lambda _r: JSONResponse({"object": "list", "data": [{"id": "m"}]})),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
            ]
        )

    async def _chat(self, request: Request) -> Response:
        self.raw.append(await request.body())
        first = len(self.raw) == 1
        message = {"role": "assistant", "reasoning_content": "rayleigh", "content": None}
        if not first:
            message = {"role": "assistant", "content": "scattering"}
        choice = {"index": 0, "message": message, "finish_reason": "length" if first else "stop"}
        usage = {"prompt_tokens": 7, "completion_tokens": 5 if first else 1, "total_tokens": 0}
        return JSONResponse({"id": "c1", "object": "chat.completion", "choices": [choice], "usage": usage})


CONTINUATION = {
    Dialect.VLLM: {"continue_final_message": True, "add_generation_prompt": False},
    Dialect.SGLANG: {"continue_final_message": True},
    Dialect.LLAMACPP: {},  # llama.cpp continues a trailing assistant message by itself
    Dialect.OPENAI: {"continue_final_message": True, "add_generation_prompt": False},
}


@pytest.mark.parametrize("dialect", list(Dialect))
def test_phase_two_carries_the_dialects_continuation_arguments(dialect: Dialect) -> None:
    engine = PhaseEngine()
    with serve(engine.app()) as (engine_url, _):
        backend = {"id": "a", "url": engine_url, "models": ["m"], "dialect": dialect.value}
        settings = load_settings(
            None, backends=[{**backend, "budget_enforcement": "gateway"}], canary={"enabled": False}
        )
        with serve(create_app(settings)) as (url, _):
            body = {"model": "m", "messages": MSGS, "thinking_budget": 5, "max_tokens": 100}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "scattering"
    assert len(engine.raw) == 2
    prefix = "<think>\nrayleigh" + DEFAULT_EARLY_STOP
    expected = {
        "model": "m",
        "messages": [*MSGS, {"role": "assistant", "content": prefix}],
        "max_tokens": 95,
        **CONTINUATION[dialect],
        "chat_template_kwargs": {"enable_thinking": False},
        "stream": False,
    }
    assert engine.raw[1] == canonical_json(expected)


@pytest.mark.parametrize("dialect", list(Dialect))
def test_auto_enforcement_is_the_gateways_only_where_the_engine_has_no_native_cap(dialect: Dialect) -> None:
    capped = Thinking(budget=100, effort=None, explicit=True)
    assert gateway_enforces(BudgetEnforcement.AUTO, dialect, capped) is (dialect is Dialect.OPENAI)
    assert gateway_enforces(BudgetEnforcement.NATIVE, dialect, capped) is False
    assert gateway_enforces(BudgetEnforcement.GATEWAY, dialect, capped) is True


def _embeds_backend(dialect: str) -> dict[str, Any]:
    return {"id": "e", "url": "http://127.0.0.1:9", "models": ["m"], "dialect": dialect, "vision": "embeds"}


@pytest.mark.parametrize("dialect", ["sglang", "llamacpp"])
def test_an_engine_without_image_embeds_cannot_be_an_embeds_backend(dialect: str) -> None:
    settings = load_settings(None, backends=[_embeds_backend(dialect)], sidecar={"url": "http://127.0.0.1:9"})
    with pytest.raises(ValueError, match=f"backend e: dialect {dialect} takes no image embeddings"):
        create_app(settings)


@pytest.mark.parametrize("dialect", ["vllm", "openai"])
def test_engines_with_image_embeds_can_be_embeds_backends(dialect: str) -> None:
    settings = load_settings(None, backends=[_embeds_backend(dialect)], sidecar={"url": "http://127.0.0.1:9"})
    assert create_app(settings).state.gateway.encoder is not None


def test_the_admin_api_refuses_an_embeds_backend_on_an_engine_without_them(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    r = httpx.post(c.url + "/admin/backends", json=_embeds_backend("sglang"), timeout=10)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["param"] == "vision"
    assert "dialect sglang takes no image embeddings" in error["message"]
    assert httpx.get(c.url + "/admin/backends/e", timeout=10).status_code == 404  # nothing was added
