"""Anthropic Messages <-> OpenAI chat completions, for engines that serve chat only. Pure: bodies in, bodies
out; the streamed answer through a small state machine fed one chat chunk at a time.

Request: ``system`` (a string or text blocks, joined by a newline) becomes the first system message; user and
assistant text and image blocks become chat content parts (an image's base64 source a ``data:`` URL);
``tool_use`` blocks become the assistant message's ``tool_calls`` (input serialised as JSON arguments) and
``tool_result`` blocks ``tool`` messages, placed before the user's other content (a result's images, which a
chat tool message cannot hold, open the user message after them: a screenshot a tool read); ``thinking``
blocks go back as ``reasoning_content``; ``tools`` become function tools; ``thinking`` becomes the gateway's
budget fields (``thinking_budget`` for ``enabled``/``disabled``, ``reasoning_effort`` from
``output_config.effort``).

Answer: text, thinking (from ``reasoning``/``reasoning_content``) and ``tool_use`` blocks (arguments parsed
back to an object), ``stop_reason`` from ``finish_reason``, usage in Anthropic's terms: ``input_tokens`` is
the uncached part of the prompt, ``cache_read_input_tokens`` the cached part (chat's ``prompt_tokens``
counts both). A stream's ``message_start`` cannot know the prompt's size yet (chat reports usage last), so
its ``input_tokens`` is 0 and the final ``message_delta`` carries the whole usage, as Anthropic's own
``message_delta`` may.

The same decisions as vLLM's own translator (vllm/entrypoints/anthropic) where they are sound: the stop
reason mapping, ``any`` -> ``required``, ``tool_choice`` ``auto`` when tools are given without one, usage
asked for in streams. Where this differs: tool results go before the user's text (chat wants them right after
the tool calls), tool-call fragments are followed by their chat ``index`` (most chunks carry no id), a vLLM
``stop_reason`` string is reported as the stop sequence that matched.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.errors import BadRequest, UpstreamError
from gateway.translate.common import (
    ChatUsage,
    Treatment,
    Untranslated,
    chunk_parts,
    copy_fields,
    first_choice,
    list_at,
    object_at,
    parse_arguments,
    reasoning_of,
    refuse,
    refuse_fields,
    sse,
    stream_fields,
    string_at,
    text_of,
    tools_of,
)

#: Fields a chat engine cannot be asked for faithfully: refused with a 400 naming them, or dropped.
UNTRANSLATED: tuple[Untranslated, ...] = (
    Untranslated("mcp_servers", Treatment.REFUSED, "MCP servers are run by Anthropic's API, not an engine"),
    Untranslated("container", Treatment.REFUSED, "code-execution containers exist only on Anthropic's API"),
    Untranslated("tools[].type", Treatment.REFUSED, "server and built-in tools (web search, bash, text "
                 "editor, computer use, code execution) have no chat equivalent; custom tools are "
                 "translated"),
    Untranslated("messages[].content[].type", Treatment.REFUSED, "document, search_result, server_tool_use "
                 "and other such blocks have no chat part; text, image, tool_use, tool_result and thinking "
                 "are translated"),
    Untranslated("messages[].content[].content[].type", Treatment.REFUSED, "a tool_result part other than "
                 "text or image (a document, a search result) has no chat part; its images go to a user "
                 "message right after the tool messages (a chat tool message holds text only)"),
    Untranslated("cache_control", Treatment.DROPPED, "prompt caching is the engine's own (automatic prefix "
                 "caching); the marker, top level or on any block, changes nothing"),
    Untranslated("messages[].content[].signature", Treatment.DROPPED, "thinking signatures are Anthropic's; "
                 "the reasoning text itself is sent back"),
    Untranslated("messages[].content[].is_error", Treatment.DROPPED, "a chat tool message has no error flag"),
    Untranslated("redacted_thinking", Treatment.DROPPED, "its encrypted content means nothing to an engine"),
    Untranslated("metadata", Treatment.DROPPED, "user ids are for the gateway's session identity, not the "
                 "engine"),
    Untranslated("service_tier", Treatment.DROPPED, "an engine has one tier"),
    Untranslated("context_management", Treatment.DROPPED, "the engine is sent the whole context as given"),
    Untranslated("output_config.task_budget", Treatment.DROPPED, "no chat equivalent"),
)  # fmt: skip

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "function_call": "tool_use", "content_filter": "refusal"}  # fmt: skip
_BUILT_IN = UNTRANSLATED[2]
_BLOCK = UNTRANSLATED[3]
_TOOL_PART = UNTRANSLATED[4]
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "stop_sequences": "stop",
             "max_tokens": "max_tokens"}  # fmt: skip
_ANTHROPIC_EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "xhigh", "max": "max"}


# -- request ------------------------------------------------------------------------------------------------


def request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request asking what the Messages request asks, or a ``BadRequest`` naming the field."""
    refuse_fields(body, UNTRANSLATED)
    out: dict[str, Any] = {"model": body.get("model")}
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None and system != "" and system != []:
        messages.append({"role": "system", "content": _system(system)})
    for i, msg in enumerate(list_at(body.get("messages"), "messages")):
        messages.extend(_message(object_at(msg, f"messages[{i}]"), f"messages[{i}]"))
    out["messages"] = messages
    copy_fields(body, out, _SAMPLING)
    stream_fields(body, out)
    tools_of(body, out, _tool)
    _tool_choice(body.get("tool_choice"), out)
    _thinking(body, out)
    return out


def _system(system: Any) -> str:
    if isinstance(system, str):
        return system
    blocks = list_at(system, "system")
    texts = []
    for i, block in enumerate(blocks):
        block = object_at(block, f"system[{i}]")
        if block.get("type") != "text":
            raise BadRequest(f"'system[{i}]' must be a text block", param=f"system[{i}]")
        texts.append(string_at(block.get("text"), f"system[{i}].text"))
    return "\n".join(texts)


def _message(msg: dict[str, Any], where: str) -> list[dict[str, Any]]:
    role = msg.get("role")
    if role not in ("user", "assistant"):
        raise BadRequest(f"'{where}.role' must be 'user' or 'assistant'", param=f"{where}.role")
    content = msg.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    blocks = list_at(content, f"{where}.content")
    parts: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []  # a user's tool results, or an assistant's tool calls
    images: list[dict[str, Any]] = []  # the tool results' images: chat tool messages hold text only
    reasoning: list[str] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        block = object_at(block, at)
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": string_at(block.get("text"), f"{at}.text")})
        elif kind == "image":
            parts.append(_image(object_at(block.get("source"), f"{at}.source"), f"{at}.source"))
        elif kind == "tool_use" and role == "assistant":
            tools.append(_tool_call(block, at))
        elif kind == "tool_result" and role == "user":
            tools.append(_tool_result(block, at, images))
        elif kind == "thinking" and role == "assistant":
            reasoning.append(string_at(block.get("thinking"), f"{at}.thinking"))
        elif kind == "redacted_thinking":
            continue
        else:
            refuse(_BLOCK, f"{at}.type")
    if role == "user":
        parts = images + parts
        return [*tools, *([{"role": "user", "content": _content(parts)}] if parts else [])]
    out: dict[str, Any] = {"role": "assistant", "content": _content(parts) if parts else None}
    if tools:
        out["tool_calls"] = tools
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    return [out]


def _content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text alone as one string (every chat template reads that), else the parts."""
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _image(source: dict[str, Any], where: str) -> dict[str, Any]:
    kind = source.get("type")
    if kind == "base64":
        media = string_at(source.get("media_type"), f"{where}.media_type")
        data = string_at(source.get("data"), f"{where}.data")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url":
        return {"type": "image_url", "image_url": {"url": string_at(source.get("url"), f"{where}.url")}}
    raise BadRequest(
        f"'{where}.type' must be 'base64' or 'url' (files are not translated)", param=f"{where}.type"
    )


def _tool_call(block: dict[str, Any], where: str) -> dict[str, Any]:
    arguments = json.dumps(block.get("input") or {}, ensure_ascii=False, separators=(",", ":"))
    return {
        "id": string_at(block.get("id"), f"{where}.id"),
        "type": "function",
        "function": {"name": string_at(block.get("name"), f"{where}.name"), "arguments": arguments},
    }


def _tool_result(block: dict[str, Any], where: str, images: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``tool`` message with the result's text; its images are appended to ``images``."""
    content = block.get("content")
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            at = f"{where}.content[{k}]"
            part = object_at(part, at)
            if part.get("type") == "text":
                texts.append({"type": "text", "text": string_at(part.get("text"), f"{at}.text")})
            elif part.get("type") == "image":
                images.append(_image(object_at(part.get("source"), f"{at}.source"), f"{at}.source"))
            else:
                refuse(_TOOL_PART, f"{at}.type")
        content = texts
    text = text_of(content, f"{where}.content")
    return {
        "role": "tool",
        "tool_call_id": string_at(block.get("tool_use_id"), f"{where}.tool_use_id"),
        "content": text,
    }


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom"):
        refuse(_BUILT_IN, f"{where}.type")
    function: dict[str, Any] = {"name": string_at(tool.get("name"), f"{where}.name")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    function["parameters"] = object_at(tool.get("input_schema"), f"{where}.input_schema")
    return {"type": "function", "function": function}


def _tool_choice(choice: Any, out: dict[str, Any]) -> None:
    if choice is None:
        if "tools" in out:
            out["tool_choice"] = "auto"
        return
    choice = object_at(choice, "tool_choice")
    kind = choice.get("type")
    if kind == "auto":
        out["tool_choice"] = "auto"
    elif kind == "any":
        out["tool_choice"] = "required"
    elif kind == "none":
        out["tool_choice"] = "none"
    elif kind == "tool":
        name = string_at(choice.get("name"), "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise BadRequest("'tool_choice.type' must be auto, any, tool or none", param="tool_choice.type")
    if choice.get("disable_parallel_tool_use") is True:
        out["parallel_tool_calls"] = False


def _thinking(body: dict[str, Any], out: dict[str, Any]) -> None:
    """Anthropic's thinking controls as the gateway's own budget fields (gateway/budgets.py reads them)."""
    thinking = body.get("thinking")
    if isinstance(thinking, dict):
        kind = thinking.get("type")
        if kind == "enabled" and isinstance(thinking.get("budget_tokens"), int):
            out["thinking_budget"] = thinking["budget_tokens"]
        elif kind == "disabled":
            out["thinking_budget"] = 0
    config = body.get("output_config")
    if isinstance(config, dict):
        effort = config.get("effort")
        if isinstance(effort, str) and effort in _ANTHROPIC_EFFORTS and out.get("thinking_budget") != 0:
            out["reasoning_effort"] = _ANTHROPIC_EFFORTS[effort]
        fmt = config.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            schema = object_at(fmt.get("schema"), "output_config.format.schema")
            out["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": schema},
            }


# -- whole answer -------------------------------------------------------------------------------------------


def message_id(chat_id: Any) -> str:
    text = chat_id if isinstance(chat_id, str) and chat_id else "0"
    return text if text.startswith("msg_") else f"msg_{text}"


def usage(chat: ChatUsage | None) -> dict[str, int]:
    if chat is None:
        return {"input_tokens": 0, "output_tokens": 0}
    cached = chat.cached or 0
    out = {"input_tokens": max(chat.prompt - cached, 0), "output_tokens": chat.completion}
    if chat.cached is not None:
        out["cache_read_input_tokens"] = cached
        out["cache_creation_input_tokens"] = 0
    return out


def stop_of(choice: dict[str, Any]) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a chat choice that finished."""
    finish = choice.get("finish_reason")
    if not isinstance(finish, str):
        return None, None
    matched = choice.get("stop_reason")  # vLLM: the stop string that matched, when one did
    if finish == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return STOP_REASONS.get(finish, "end_turn"), None


def response(doc: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The Messages answer of a whole chat completion (``ValueError``/``LookupError``: not one)."""
    choice = first_choice(doc)
    if choice is None:
        raise ValueError("a chat completion without choices")
    message = choice["message"]
    content: list[dict[str, Any]] = []
    if (reasoning := reasoning_of(message)) is not None:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if isinstance(message.get("content"), str) and message["content"]:
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        content.append({
            "type": "tool_use", "id": call.get("id") or "", "name": function.get("name") or "",
            "input": parse_arguments(function.get("arguments")),
        })  # fmt: skip
    stop_reason, stop_sequence = stop_of(choice)
    return {
        "id": message_id(doc.get("id")),
        "type": "message",
        "role": "assistant",
        "model": doc.get("model") or model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage(ChatUsage.of(doc.get("usage"))),
    }


# -- streamed answer ----------------------------------------------------------------------------------------


class MessagesStream:
    """Fed a chat stream's chunks (``chunk``) and its end (``finish``, at ``[DONE]`` or the stream's end),
    gives the Anthropic events, SSE-encoded: ``message_start``, then per block ``content_block_start``,
    its deltas (``thinking_delta``, ``text_delta``, ``input_json_delta``) and ``content_block_stop``, then
    ``message_delta`` (stop reason, usage) and ``message_stop``.

    Blocks are sequential, as Anthropic's are: a block stops when another kind of output starts. A chat
    tool call is followed by its ``index``; fragments of a tool call already stopped (an engine interleaving
    parallel calls) cannot be sent on and end the stream with an error.
    """

    __slots__ = ("_block", "_finish", "_index", "_model", "_started", "_stopped", "_tool", "_usage", "done")

    def __init__(self, model: str | None) -> None:
        self._model = model
        self._started = False
        self._index = -1  # the block open (or last opened)
        self._block: str | None = None  # its kind: thinking, text, tool_use
        self._tool: int | None = None  # the chat index of the tool call whose block is open
        self._stopped: set[int] = set()  # chat indexes of tool calls whose block has stopped
        self._finish: tuple[str | None, str | None] = (None, None)
        self._usage: ChatUsage | None = None
        self.done = False

    def chunk(self, doc: dict[str, Any]) -> list[bytes]:
        parts = chunk_parts(doc)
        out: list[bytes] = [] if self._started else [self._start(doc)]
        if parts.usage is not None:
            self._usage = parts.usage
        if parts.reasoning is not None:
            out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": parts.reasoning}))
        if parts.text is not None:
            out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": parts.text}))
        for index, call_id, name, arguments in parts.tools:
            out += self._tool_fragment(index, call_id, name, arguments)
        if parts.finish is not None:
            self._finish = stop_of(parts.finish)
        return out

    def finish(self) -> list[bytes]:
        if self.done:
            return []
        self.done = True
        out = [] if self._started else [self._start({})]
        out += self._close()
        stop_reason, stop_sequence = self._finish
        delta = {"stop_reason": stop_reason or "end_turn", "stop_sequence": stop_sequence}
        out.append(
            sse("message_delta", {"type": "message_delta", "delta": delta, "usage": usage(self._usage)})
        )
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out

    def _start(self, doc: dict[str, Any]) -> bytes:
        self._started = True
        message: dict[str, Any] = {
            "id": message_id(doc.get("id")), "type": "message", "role": "assistant",
            "model": doc.get("model") or self._model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0},
        }  # fmt: skip
        return sse("message_start", {"type": "message_start", "message": message})

    def _tool_fragment(
        self, index: int, call_id: str | None, name: str | None, arguments: str
    ) -> list[bytes]:
        out: list[bytes] = []
        if index != self._tool:
            if index in self._stopped:
                raise UpstreamError(
                    "the engine interleaved parallel tool calls; they cannot be streamed as blocks"
                )
            block = {"type": "tool_use", "id": call_id or f"toolu_{index}", "name": name or "", "input": {}}
            out += self._open("tool_use", block, force=True)
            self._tool = index
        if arguments:
            out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return out

    def _open(self, kind: str, block: dict[str, Any], *, force: bool = False) -> list[bytes]:
        if self._block == kind and not force:
            return []
        out = self._close()
        self._index += 1
        self._block = kind
        start = {"type": "content_block_start", "index": self._index, "content_block": block}
        out.append(sse("content_block_start", start))
        return out

    def _close(self) -> list[bytes]:
        if self._block is None:
            return []
        if self._tool is not None:
            self._stopped.add(self._tool)
            self._tool = None
        self._block = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self._index})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return sse(
            "content_block_delta", {"type": "content_block_delta", "index": self._index, "delta": delta}
        )
