"""OpenAI Responses (``POST /v1/responses``): conversations keyed by their head (instructions, tools, the
input through its first user item), answers as named SSE events (``response.created`` ...
``response.completed``) or one ``response`` object, usage in ``input_tokens``/``output_tokens``.

Only the fields the gateway reads are checked; everything else goes to the engine as the client's bytes.
``previous_response_id`` names state one engine process holds: gateway/ownership.py routes such a request
to that engine only. A stream that breaks after its head ends with Responses' own ``error`` event
(``{"type": "error", "code", "message", "param", "sequence_number"}``, what the openai SDK parses as a
``ResponseErrorEvent``); Responses streams have no ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from config.settings import Effort, RoutingConfig
from gateway.errors import BadRequest, GatewayError
from gateway.images import ImagePart, content_parts
from gateway.inbound import check_common, check_content, check_text, require_model
from gateway.observe import ReplyText, Usage, last_object, usage_counts
from gateway.shapes.base import ApiShape, ErrorShape, ThinkingUse, openai_body
from routing.keys import responses_key

log = logging.getLogger("warmroute.inbound")

PATH = "/v1/responses"
#: What a response id may look like (OpenAI's and vLLM's are ``resp_`` + hex): anything else is refused
#: before it reaches a store key, a log line or an engine's path.
RESPONSE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}")
EFFORTS = tuple(e.value for e in Effort)
_OPTIONAL_STRINGS = ("instructions", "prompt_cache_key")
_OPTIONAL_BOOLS = ("store",)
_USAGE = b'"usage"'
#: What vLLM (and the simulator) stream as soon as a request arrives, before its prefill: the events name
#: themselves on their ``event:`` line, or in the ``type`` of their data.
_OPENING = (b"response.created", b"response.in_progress")
_EVENT_TYPE = re.compile(
    rb'"type": ?"(response\.[a-z_.]+)"'
)  # an event's own (its objects' are not response.*)


def validate(body: dict[str, Any]) -> str:
    model = require_model(body)
    _check_input(body.get("input"))
    for name in _OPTIONAL_STRINGS:
        value = body.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise BadRequest(f"'{name}' must be a string", param=name)
            check_text(value, name)
    for name in _OPTIONAL_BOOLS:
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise BadRequest(f"'{name}' must be a boolean", param=name)
    previous = body.get("previous_response_id")
    if previous is not None:
        check_response_id(previous, "previous_response_id")
    effort(body)
    check_common(body)
    return model


def check_response_id(value: Any, param: str) -> str:
    """``value`` if it is a response id, else a 400 naming ``param``."""
    if not isinstance(value, str) or RESPONSE_ID.fullmatch(value) is None:
        shown = repr(value)[:80]  # escaped: a control character never reaches a log line as itself
        if isinstance(value, str):  # a path or store key in disguise: one line, as for hostile bodies
            log.info("rejected a response id in %s: %s", param, shown)
        raise BadRequest(
            f"'{param}' must be a response id (letters, digits, '_', '-', '.', ':'; at most 200), "
            f"got {shown}",
            param=param,
        )
    return value


def effort(body: dict[str, Any]) -> str | None:
    """``reasoning.effort`` (``"none"``: no reasoning), validated; None when not asked."""
    reasoning = body.get("reasoning")
    if reasoning is None:
        return None
    if not isinstance(reasoning, dict):
        raise BadRequest("'reasoning' must be an object", param="reasoning")
    value = reasoning.get("effort")
    if value is None:
        return None
    if not isinstance(value, str) or value not in EFFORTS:
        raise BadRequest(
            f"'reasoning.effort' must be one of {', '.join(EFFORTS)}, got {repr(value)[:80]}",
            param="reasoning.effort",
        )
    return value


def _check_input(items: Any) -> None:
    if isinstance(items, str):
        check_text(items, "input")
        return
    if not isinstance(items, list):
        raise BadRequest("'input' must be a string or an array of input items", param="input")
    in_head = True  # up to the first user item: what routing.keys hashes
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise BadRequest(f"input[{i}] must be an object", param=f"input[{i}]")
        role = item.get("role")
        if role is not None and not isinstance(role, str):
            raise BadRequest(f"input[{i}].role must be a string", param=f"input[{i}].role")
        content = item.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(
                f"input[{i}].content must be a string or an array of parts", param=f"input[{i}].content"
            )
        if in_head:
            if isinstance(role, str):
                check_text(role, f"input[{i}].role")
            check_content(content, f"input[{i}].content")
            in_head = role != "user"


def key(body: dict[str, Any], model: str, routing: RoutingConfig) -> str:
    """Model, tools, instructions and the input through its first user item."""
    return responses_key(body)


def usage(tail: bytes) -> Usage | None:
    """The last well-formed Responses usage object in ``tail`` (a body, or ``response.completed``'s)."""
    return last_object(tail, _USAGE, _responses_usage)


def _responses_usage(value: dict[str, Any]) -> Usage | None:
    return usage_counts(value, "input_tokens", "output_tokens", "input_tokens_details")


def conversation(body: dict[str, Any]) -> list[Any] | None:
    """The turns as chat messages, for the routing feedback: instructions as a system message, a string
    input as one user message, function calls as assistant tool calls, their outputs as tool messages
    (reasoning items carry no turn). None with ``previous_response_id``: the earlier turns are the
    engine's, and the request is routed to it whatever its shape."""
    if body.get("previous_response_id") is not None:
        return None
    out: list[Any] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        out.append({"role": "system", "content": instructions})
    items = body["input"]
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    for item in items:
        if not isinstance(item, dict):
            continue
        if isinstance(item.get("role"), str):
            out.append({"role": item["role"], "content": _chat_content(item.get("content"))})
        elif item.get("type") == "function_call":
            out.append(
                {"role": "assistant", "tool_calls": [{"function": {"arguments": item.get("arguments")}}]}
            )
        elif item.get("type") == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "content": output if isinstance(output, str) else json.dumps(output)})
    return out


def _chat_content(content: Any) -> Any:
    if not isinstance(content, list):
        return content
    return [
        {"type": "text", "text": p.get("text")}
        if isinstance(p, dict) and p.get("type") in ("input_text", "output_text")
        else p
        for p in content
    ]


def images(body: dict[str, Any]) -> tuple[ImagePart, ...]:
    """The ``input_image`` parts of the input items' ``content`` and of tool outputs' ``output`` lists (a
    screenshot a tool returned), in order: their ``image_url`` (an http(s) URL or a ``data:`` URL), or
    ``file_id:<id>`` for an image by file id (only a ``vision: native`` engine can read that; the
    translation to chat refuses it with a 400 naming the part)."""
    found: list[ImagePart] = []
    items = body.get("input")
    for where in ("content", "output"):
        for i, j, part in content_parts(items, where):
            if part.get("type") == "input_image":
                at = f"input[{i}].{where}[{j}]"
                found.append(ImagePart(i, j, _image_url(part, at), f"{at}.image_url"))
    found.sort(key=lambda image: (image.message, image.part))  # an item has content or an output, not both
    return tuple(found)


def _image_url(part: dict[str, Any], at: str) -> str:
    url, file_id = part.get("image_url"), part.get("file_id")
    if isinstance(url, str) and url:
        check_text(url, f"{at}.image_url")
        return url
    if isinstance(file_id, str) and file_id:
        check_text(file_id, f"{at}.file_id")
        return f"file_id:{file_id}"
    raise BadRequest(f"'{at}' must have a non-empty string 'image_url' or 'file_id'", param=f"{at}.image_url")


def reply_text(doc: Any) -> str | None:
    """A whole response's reply: its first message item's output text, else its first function call's
    arguments."""
    output = doc.get("output") if isinstance(doc, dict) else None
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, dict):
            continue
        if item.get("type") == "message":
            parts = item.get("content")
            texts = [
                p.get("text") for p in parts or () if isinstance(p, dict) and p.get("type") == "output_text"
            ]
            return "".join(t for t in texts if isinstance(t, str))
        if item.get("type") == "function_call":
            arguments = item.get("arguments")
            return arguments if isinstance(arguments, str) else None
    return None


def stream_end(err: GatewayError) -> bytes:
    """Responses' ``error`` event (no ``[DONE]``: Responses streams end with their last event). Its
    ``sequence_number`` is 0: the gateway does not count the engine's events."""
    event = {
        "type": "error",
        "code": err.code,
        "message": err.message,
        "param": err.param,
        "sequence_number": 0,
    }
    return b"event: error\ndata: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


#: OpenAI's error object for whole responses; Responses' ``error`` event at the end of a broken stream.
RESPONSES_ERRORS = ErrorShape(openai_body, stream_end)


def opening(chunk: bytes) -> bool:
    """Whether a streamed read holds only opening events (``response.created``/``response.in_progress``):
    False as soon as one of its events names another kind, by its ``event:`` line or (an event without
    one) its data's ``type``, or names none. The rest of an event a read cut, which began in an opening
    read (once the first byte is stamped this is not asked again), counts as opening unless it names
    another kind, and so does a cut name that may still become an opening one."""
    for piece in chunk.split(b"\n\n"):
        head = piece.lstrip()
        if head.startswith(b"event:"):
            name = head[6:].split(b"\n", 1)[0].strip()
            if not any(o.startswith(name) for o in _OPENING):
                return False
        elif head.startswith(b"data:"):  # an event without its name line: by its own type
            types = [found.group(1) for found in _EVENT_TYPE.finditer(piece)]
            if not types or any(t not in _OPENING for t in types):
                return False  # a chat engine's chunk (a translated answer) included
        else:
            for found in _EVENT_TYPE.finditer(piece):
                if found.group(1) not in _OPENING:
                    return False
    return True


RESPONSES = ApiShape(
    name="responses",
    path=PATH,
    validate=validate,
    key=key,
    errors=RESPONSES_ERRORS,
    usage=usage,
    text_key=b'"delta":',  # response.output_text.delta's text (reasoning and argument deltas too)
    thinking=ThinkingUse.EFFORT,
    effort_path=("reasoning", "effort"),
    conversation=conversation,
    reply=ReplyText(marker=b'"response.output_text.delta"', key=b'"delta"', body=reply_text),
    vision=True,
    images=images,
    # vLLM's Responses input parts are OpenAI's closed list (input_text, input_image, input_file): an
    # attempt with images on an embeds backend goes as chat (gateway/translation.py), which takes them.
    embeds=False,
    embeds_via_chat=True,
    terminal=(b"event: response.completed", b"event: response.incomplete"),
    opening=opening,
)
