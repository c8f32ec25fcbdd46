"""OpenAI (legacy) completions (``POST /v1/completions``): conversations keyed by the prompt's beginning,
text in ``choices[].text``, no reasoning, a thinking budget refused."""

from __future__ import annotations

from typing import Any

from config.settings import RoutingConfig
from gateway.errors import BadRequest
from gateway.inbound import check_common, check_text, require_model
from gateway.shapes.base import ApiShape, ThinkingUse
from routing.keys import completion_key


def validate(body: dict[str, Any]) -> str:
    model = require_model(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, (str, list)):
        raise BadRequest("'prompt' must be a string or an array", param="prompt")
    if isinstance(prompt, str):
        check_text(prompt, "prompt")
    else:
        for i, item in enumerate(prompt):
            if isinstance(item, str):
                check_text(item, f"prompt[{i}]")
    check_common(body)
    return model


def key(body: dict[str, Any], model: str, routing: RoutingConfig) -> str:
    """Model and the prompt's leading ``routing.completion_key_chars`` characters."""
    return completion_key(model, body["prompt"], routing.completion_key_chars)


COMPLETIONS = ApiShape(
    name="completions",
    path="/v1/completions",
    validate=validate,
    key=key,
    text_key=b'"text":',
    thinking=ThinkingUse.REFUSE,
)
