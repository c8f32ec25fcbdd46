"""Reading and validating what clients send: body size, JSON, and the few fields the gateway owns.

Everything else in a request body is forwarded untouched (as the original bytes).

Hostile bodies are 400s at this edge, not 500s further in: nesting past the parser's recursion limit,
integers past Python's digit limit, and lone UTF-16 surrogates (``"\ud800"``: valid JSON grammar, but not
text; the key hashing cannot encode it and neither can an engine's tokenizer). Surrogates are rejected in
the strings the gateway reads itself: ``model``, every ``role``, the content of the conversation head (what
the key hashes) and ``prompt``. Later turns are forwarded as the client's bytes for the engine to judge,
which keeps the common path at one ``json.loads``: an ASCII string is never scanned (``str.isascii`` is a
flag), another costs one UTF-8 encode, and only in the head.
"""

from __future__ import annotations

import json
import logging
import sys
from types import FrameType
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


log = logging.getLogger("warmroute.inbound")


def parse_object(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        depth = sys.getrecursionlimit() - _stack_depth()
        raise _hostile(
            InvalidJSON(f"request body is not valid JSON: nesting deeper than {depth} levels")
        ) from None
    except ValueError as exc:  # only int() raises a bare ValueError in json.loads: the digit limit
        digits = sys.get_int_max_str_digits()
        msg = f"integer literal too long (over {digits} digits)" if "integer string" in str(exc) else str(exc)
        raise _hostile(InvalidJSON(f"request body is not valid JSON: {msg}")) from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, not {type(body).__name__}")
    return body


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise BadRequest("'model' is required", param="model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    _check_text(model, "model")
    return model


def validate_chat(body: dict[str, Any]) -> str:
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
        _check_text(role, f"messages[{i}].role")
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(
                f"messages[{i}].content must be a string or an array of parts", param=f"messages[{i}].content"
            )
        if in_head:
            _check_content(content, f"messages[{i}].content")
            in_head = role != "user"
    _check_common(body)
    return model


def validate_completion(body: dict[str, Any]) -> str:
    model = require_model(body)
    prompt = body.get("prompt")
    if not isinstance(prompt, (str, list)):
        raise BadRequest("'prompt' must be a string or an array", param="prompt")
    if isinstance(prompt, str):
        _check_text(prompt, "prompt")
    else:
        for i, item in enumerate(prompt):
            if isinstance(item, str):
                _check_text(item, f"prompt[{i}]")
    _check_common(body)
    return model


def _check_common(body: dict[str, Any]) -> None:
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", param="tools")


def _check_content(content: Any, param: str) -> None:
    """Surrogates in what the key hashes of one message: its text, text parts and image URLs."""
    if isinstance(content, str):
        _check_text(content, param)
        return
    for j, part in enumerate(content or ()):
        if not isinstance(part, dict):
            continue  # hashed as JSON, which escapes surrogates
        text = part.get("text")
        if isinstance(text, str):
            _check_text(text, f"{param}[{j}].text")
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if isinstance(url, str):
            _check_text(url, f"{param}[{j}].image_url" + (".url" if isinstance(image, dict) else ""))


def _check_text(value: str, param: str) -> None:
    if value.isascii():  # O(1): CPython keeps a flag
        return
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        char = f"\\u{ord(value[exc.start]):04x}"
        raise _hostile(
            BadRequest(f"invalid unicode: lone surrogate {char} in {param}", param=param)
        ) from None


def _hostile(err: BadRequest) -> BadRequest:
    """Log a hostile body's rejection: one line, no traceback (an ordinary 400 logs nothing)."""
    log.info("rejected a request body: %s", err.message)
    return err


def _stack_depth() -> int:
    frame: FrameType | None = sys._getframe()
    depth = 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth
