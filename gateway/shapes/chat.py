"""OpenAI chat completions (``POST /v1/chat/completions``): conversations keyed by their head, reasoning in
each choice's ``message``/``delta``, thinking budgets and images."""

from __future__ import annotations

from typing import Any

from config.settings import ReasoningFields, RoutingConfig
from gateway.errors import BadRequest
from gateway.inbound import check_common, check_content, check_text, require_model
from gateway.reasoning import normalise
from gateway.shapes.base import ApiShape, ThinkingUse
from routing.keys import chat_key
from routing.volatile import rules_for


def validate(body: dict[str, Any]) -> str:
    model = require_model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    in_head = True  # up to the first user message: what routing.keys hashes
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        role = msg.get("role")
        if not isinstance(role, str):
            raise BadRequest(f"messages[{i}].role must be a string", param=f"messages[{i}].role")
        if not role.isascii():  # the common role costs no call (and no parameter name built)
            check_text(role, f"messages[{i}].role")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(
                f"messages[{i}].content must be a string or an array of parts", param=f"messages[{i}].content"
            )
        if in_head:
            if type(content) is not str or not content.isascii():
                check_content(content, f"messages[{i}].content")
            in_head = role != "user"
    check_common(body)
    return model


def key(body: dict[str, Any], model: str, routing: RoutingConfig) -> str:
    """Model, tools and the conversation head (up to the first user message), volatile system text left
    out."""
    return chat_key(body, rules_for(routing.volatile_prefixes))


def reasoning(doc: dict[str, Any], fields: ReasoningFields, streamed: bool) -> None:
    """Each choice's ``delta`` (a stream chunk; a chunk of usage only has none) or ``message``."""
    if streamed:
        for choice in doc.get("choices") or ():
            choice["delta"] = normalise(choice.get("delta") or {}, fields)
        return
    for choice in doc["choices"]:
        choice["message"] = normalise(choice["message"], fields)


CHAT = ApiShape(
    name="chat",
    path="/v1/chat/completions",
    validate=validate,
    key=key,
    text_key=b'"content":',
    reasoning=reasoning,
    thinking=ThinkingUse.RESOLVE,
    vision=True,
)
