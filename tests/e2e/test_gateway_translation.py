"""Translation on real vLLM engines: engines configured to serve chat only (``native_shapes``), a gateway
serving minimal Messages and Responses shapes in front, and the official ``anthropic`` and ``openai`` SDKs
as callers, streaming and not. What the engines' real chat answers become is what the SDKs read."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from config.settings import RoutingConfig, load_settings
from gateway.app import create_app
from gateway.errors import BadRequest, GatewayError
from gateway.shapes.base import ApiShape, ErrorShape
from gateway.shapes.table import SHAPES

from .engines import VllmEngine
from .gateways import FAST_HEALTH, MODEL, RunningGateway
from upstreams import serve


def _validate(body: dict[str, Any]) -> str:
    if not isinstance(body.get("model"), str):
        raise BadRequest("'model' is required", param="model")
    return str(body["model"])


def _key(body: dict[str, Any], model: str, routing: RoutingConfig) -> str:
    return f"e2e:{model}:{json.dumps(body.get('system') or body.get('instructions'))}"


def _anthropic_error(err: GatewayError) -> bytes:
    kind = "invalid_request_error" if err.status < 500 else "api_error"
    return json.dumps({"type": "error", "error": {"type": kind, "message": err.message}}).encode()


MESSAGES = ApiShape(
    "messages",
    "/v1/messages",
    _validate,
    _key,
    errors=ErrorShape(_anthropic_error, lambda e: b"event: error\ndata: " + _anthropic_error(e) + b"\n\n"),
)
RESPONSES = ApiShape("responses", "/v1/responses", _validate, _key)


def _said(blocks: list[Any]) -> str:
    return "".join(getattr(b, "text", None) or getattr(b, "thinking", None) or "" for b in blocks)


def _said_items(items: list[Any]) -> str:
    parts = [p for item in items for p in (getattr(item, "content", None) or [])]
    return "".join(getattr(p, "text", "") for p in parts)


@pytest.fixture(scope="module")
def chat_only_gateway(vllm_engines: list[VllmEngine]) -> Iterator[RunningGateway]:
    backends = [
        {"id": e.name, "url": e.base_url, "models": [e.config.served_model_name], "dialect": "vllm",
         "native_shapes": ["chat", "completions"]}
        for e in vllm_engines
    ]  # fmt: skip
    settings = load_settings(None, backends=backends, health=FAST_HEALTH)
    app = create_app(settings, shapes=(*SHAPES, MESSAGES, RESPONSES))
    with serve(app) as (url, _server):
        yield RunningGateway(url, "affinity", app.state.gateway)


def test_the_anthropic_sdk_through_translation(chat_only_gateway: RunningGateway) -> None:
    client = anthropic.Anthropic(base_url=chat_only_gateway.url, api_key="k", max_retries=0)
    ask: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 8,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Say hello."}],
    }
    msg = client.messages.create(**ask)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert _said(msg.content)  # the tiny model may spend its 8 tokens thinking: a thinking block, or text
    assert msg.stop_reason in ("max_tokens", "end_turn")
    assert msg.usage.input_tokens > 0 and 1 <= msg.usage.output_tokens <= 8
    with client.messages.stream(**ask) as stream:
        final = stream.get_final_message()
    assert _said(final.content)
    assert final.stop_reason in ("max_tokens", "end_turn") and 1 <= final.usage.output_tokens <= 8
    with pytest.raises(anthropic.BadRequestError):  # vLLM's own 400 (a prompt too long), in Anthropic's shape
        client.messages.create(**{**ask, "max_tokens": 20_000}, timeout=60)  # past max_model_len 8192
    assert chat_only_gateway.wait_idle() == 0


def test_the_openai_responses_client_through_translation(chat_only_gateway: RunningGateway) -> None:
    client = chat_only_gateway.client()
    ask: dict[str, Any] = {"model": MODEL, "instructions": "Be brief.", "input": "Say hello.",
                           "max_output_tokens": 8, "temperature": 0, "store": False}  # fmt: skip
    resp = client.responses.create(**ask)
    assert resp.object == "response" and _said_items(resp.output)
    assert resp.status in ("completed", "incomplete")
    assert resp.usage is not None and resp.usage.input_tokens > 0 and 1 <= resp.usage.output_tokens <= 8
    with client.responses.stream(**ask) as stream:
        kinds = {e.type for e in stream}
    assert kinds & {"response.output_text.delta", "response.reasoning_text.delta"}
    assert kinds & {"response.completed", "response.incomplete"}
    assert chat_only_gateway.wait_idle() == 0
