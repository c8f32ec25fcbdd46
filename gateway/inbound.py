"""Reading and validating what clients send: body size, JSON, and the few fields the gateway owns.

Everything else in a request body is forwarded untouched (as the original bytes).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import Receive, Scope

from gateway.errors import BadRequest, InvalidJSON, PayloadTooLarge


def header(scope: Scope, name: bytes) -> bytes | None:
    """First value of a (lower-case) request header."""
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v)
    return None


async def read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, or PayloadTooLarge as soon as it is known to exceed ``limit``."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {int(declared)} bytes; the limit is {limit}")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class ClientGone(Exception):
    """The client disconnected before we answered."""


def parse_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(body).__name__}")
    return body


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise BadRequest("'model' is required", param="model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    return model


def validate_chat(body: dict[str, Any]) -> str:
    model = require_model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise BadRequest(f"messages[{i}] must be an object", param=f"messages[{i}]")
        if not isinstance(msg.get("role"), str):
            raise BadRequest(f"messages[{i}].role must be a string", param=f"messages[{i}].role")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(
                f"messages[{i}].content must be a string or an array of parts", param=f"messages[{i}].content"
            )
    _check_common(body)
    return model


def validate_completion(body: dict[str, Any]) -> str:
    model = require_model(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, (str, list)):
        raise BadRequest("'prompt' must be a string or an array", param="prompt")
    _check_common(body)
    return model


def _check_common(body: dict[str, Any]) -> None:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", param="tools")
