"""What the chat translators share: the table of fields they do not translate, the chat request's common
fields (stream, tools), SSE encoding, chat usage, and one streamed chat chunk read into its parts (usage,
reasoning, text, tool-call fragments, finish). Pure: no I/O, nothing from the request path but the error
hierarchy."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gateway.errors import BadRequest, UpstreamError


class Treatment(StrEnum):
    REFUSED = "refused"  # a 400 naming the field: the chat engine cannot do what it asks
    DROPPED = "dropped"  # left out of the chat request: harmless to the answer


@dataclass(frozen=True, slots=True)
class Untranslated:
    """One field of a client shape that a chat engine cannot be asked for faithfully."""

    field: str  # as the client spells it (a dotted path; ``[]`` for every item of an array)
    treatment: Treatment
    why: str


def refuse_fields(body: dict[str, Any], table: tuple[Untranslated, ...]) -> None:
    """A 400 for the first top-level field of ``table`` (refused ones) that the body sets to a value."""
    for entry in table:
        if entry.treatment is Treatment.REFUSED and "." not in entry.field and "[" not in entry.field:
            value = body.get(entry.field)
            if value is not None and value is not False:
                refuse(entry)


def refuse(entry: Untranslated, where: str | None = None) -> None:
    param = where or entry.field
    raise BadRequest(f"'{param}' cannot be translated for a chat-only engine: {entry.why}", param=param)


#: One encoder, made once: ``json.dumps`` with any non-default argument builds a new one on every call,
#: which was most of the translation's CPU per streamed event.
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def sse(name: str | None, data: dict[str, Any]) -> bytes:
    """One SSE event: an ``event:`` line when named, the compact JSON ``data:`` line, a blank line."""
    payload = _encode(data).encode()
    if name is None:
        return b"data: " + payload + b"\n\n"
    return b"event: " + name.encode() + b"\ndata: " + payload + b"\n\n"


@dataclass(slots=True)
class ChatUsage:
    prompt: int = 0
    completion: int = 0
    cached: int | None = None  # prompt_tokens_details.cached_tokens, when reported
    reasoning: int | None = None  # completion_tokens_details.reasoning_tokens, when reported

    @classmethod
    def of(cls, usage: Any) -> ChatUsage | None:
        if not isinstance(usage, dict):
            return None
        return cls(
            _count(usage.get("prompt_tokens")),
            _count(usage.get("completion_tokens")),
            _detail(usage.get("prompt_tokens_details"), "cached_tokens"),
            _detail(usage.get("completion_tokens_details"), "reasoning_tokens"),
        )


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _detail(details: Any, name: str) -> int | None:
    if not isinstance(details, dict):
        return None
    value = details.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def reasoning_of(delta: dict[str, Any]) -> str | None:
    """A chat message's or delta's reasoning text, in whichever field the engine writes it."""
    for name in ("reasoning", "reasoning_content"):
        value = delta.get(name)
        if isinstance(value, str) and value:
            return value
    return None


def parse_arguments(arguments: Any) -> Any:
    """A tool call's JSON arguments as an object; text that is not JSON is kept whole, never lost."""
    if not isinstance(arguments, str) or not arguments.strip():
        return {}
    try:
        return json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}


def text_of(content: Any, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A string, or the text of an array of text parts (``kinds``), joined; anything else is a 400."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if not isinstance(content, list):
        raise BadRequest(f"'{where}' must be a string or an array of text blocks", param=where)
    texts = []
    for i, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or part.get("type") not in kinds
            or not isinstance(part.get("text"), str)
        ):
            raise BadRequest(f"'{where}[{i}]' must be a text block", param=f"{where}[{i}]")
        texts.append(part["text"])
    return "".join(texts)


def object_at(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BadRequest(f"'{where}' must be an object", param=where)
    return value


def list_at(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise BadRequest(f"'{where}' must be an array", param=where)
    return value


def string_at(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise BadRequest(f"'{where}' must be a string", param=where)
    return value


def copy_fields(src: dict[str, Any], dst: dict[str, Any], names: dict[str, str]) -> None:
    """Copy each of ``names`` (client name -> chat name) that ``src`` sets."""
    for name, chat_name in names.items():
        value = src.get(name)
        if value is not None:
            dst[chat_name] = value


@dataclass(slots=True)
class ToolCallParts:
    """One streamed chat tool call, put together from its fragments (split anywhere by the engine)."""

    index: int
    id: str = ""
    name: str = ""
    arguments: str = ""


def tool_fragments(delta: dict[str, Any]) -> list[tuple[int, str | None, str | None, str]]:
    """(index, id, name, arguments fragment) of each tool-call fragment of a chat delta."""
    out: list[Fragment] = []
    calls = delta.get("tool_calls")
    if not isinstance(calls, list):
        return out
    for position, call in enumerate(calls):
        if not isinstance(call, dict):
            continue
        index = call.get("index")
        function = call["function"] if isinstance(call.get("function"), dict) else {}
        call_id, name, arguments = call.get("id"), function.get("name"), function.get("arguments")
        out.append((
            index if isinstance(index, int) and not isinstance(index, bool) else position,
            call_id if isinstance(call_id, str) and call_id else None,
            name if isinstance(name, str) and name else None,
            arguments if isinstance(arguments, str) else "",
        ))  # fmt: skip
    return out


def first_choice(doc: dict[str, Any]) -> dict[str, Any] | None:
    choices = doc.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        return choices[0]
    return None


# -- the chat request's common fields ---------------------------------------------------------------------


def stream_fields(body: dict[str, Any], out: dict[str, Any]) -> None:
    """A streamed request streams as chat with its usage asked for (chat reports it only when asked)."""
    if body.get("stream") is True:
        out["stream"] = True
        out["stream_options"] = {"include_usage": True}


def tools_of(
    body: dict[str, Any], out: dict[str, Any], one: Callable[[dict[str, Any], str], dict[str, Any]]
) -> None:
    """The body's ``tools``, each through ``one`` (the client shape's tool -> a chat tool, or a 400)."""
    tools = body.get("tools")
    if tools:
        out["tools"] = [
            one(object_at(t, f"tools[{i}]"), f"tools[{i}]") for i, t in enumerate(list_at(tools, "tools"))
        ]


# -- one streamed chat chunk ------------------------------------------------------------------------------


Fragment = tuple[int, str | None, str | None, str]


@dataclass(frozen=True, slots=True)
class ChunkParts:
    """What one chat chunk says, in the order a translator emits it."""

    usage: ChatUsage | None
    reasoning: str | None
    text: str | None  # None or non-empty
    tools: list[Fragment]
    finish: dict[str, Any] | None  # the choice, when it carries a ``finish_reason``


def chunk_parts(doc: dict[str, Any]) -> ChunkParts:
    """One chat chunk's parts; an engine's error event mid-stream is an ``UpstreamError``."""
    if "error" in doc:
        error = doc["error"]
        message = error.get("message") if isinstance(error, dict) else error
        raise UpstreamError(f"the engine failed mid-stream: {message}")
    used = ChatUsage.of(doc.get("usage"))
    choice = first_choice(doc)
    delta = choice.get("delta") if choice is not None else None
    if not isinstance(delta, dict):
        delta = {}
    text = delta.get("content")
    finished = choice is not None and choice.get("finish_reason") is not None
    return ChunkParts(
        used,
        reasoning_of(delta) if delta else None,
        text if isinstance(text, str) and text else None,
        tool_fragments(delta) if delta else [],
        choice if finished else None,
    )
