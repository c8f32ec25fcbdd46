"""OpenAI Responses <-> OpenAI chat completions, for engines that serve chat only. Pure, like
gateway/translate/messages.py.

Request: ``instructions`` becomes the first system message; ``input`` (a string, or items) becomes chat
messages: message items (``developer`` as ``system``; ``input_text``/``output_text`` parts as text,
``input_image`` as ``image_url``), consecutive ``function_call`` items one assistant message's
``tool_calls`` (joined to the assistant message before them), ``function_call_output`` items ``tool``
messages (an output list's text parts their text; its ``input_image`` parts, which a chat tool message
cannot hold, one user message after the run of tool messages), a ``reasoning`` item's text the next
assistant message's ``reasoning_content``. Function tools, ``tool_choice``, ``max_output_tokens``,
``reasoning.effort`` (the gateway's ``reasoning_effort``) and ``text.format`` (``response_format``) are
translated.

Answer: a ``response`` object whose output is a reasoning item (when the engine reasoned), a message item
(its text) and one ``function_call`` item per tool call; ``status`` ``incomplete`` with
``incomplete_details.reason: max_output_tokens`` when the engine stopped at its limit; usage with
``input_tokens_details.cached_tokens``. Streamed: ``response.created``, ``response.in_progress``, each
item's ``output_item.added``/``content_part.added``/deltas/``...done``/``output_item.done``, then
``response.completed`` (or ``response.incomplete``) with the whole response, every event numbered by
``sequence_number``. There is no ``[DONE]`` in this shape.

vLLM's own responses serving makes the same choices for item order (reasoning, message, calls) and for the
``incomplete`` status; it keeps state (``previous_response_id``, ``store``) that a chat engine cannot, so
those are refused here.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.errors import BadRequest, UpstreamError
from gateway.translate import custom_tools
from gateway.translate.common import (
    ChatUsage,
    Treatment,
    Untranslated,
    chunk_parts,
    copy_fields,
    first_choice,
    list_at,
    object_at,
    reasoning_of,
    refuse,
    refuse_fields,
    sse,
    stream_fields,
    string_at,
    text_of,
    tools_of,
)

_OUTPUT_PART = Untranslated(
    "input[].output[].type",
    Treatment.REFUSED,
    "a tool output's input_file parts and images by file_id have no chat part; input_text and input_image "
    "parts are translated",
)

#: Fields a chat engine cannot be asked for faithfully: refused with a 400 naming them, or dropped.
UNTRANSLATED: tuple[Untranslated, ...] = (
    Untranslated("previous_response_id", Treatment.REFUSED, "a chat engine keeps no responses; send the "
                 "whole conversation as input"),
    Untranslated("conversation", Treatment.REFUSED, "a chat engine keeps no conversations"),
    Untranslated("store", Treatment.REFUSED, "a chat engine stores nothing: 'store: true' cannot be honoured "
                 "(false, or leaving it out, is fine)"),
    Untranslated("background", Treatment.REFUSED, "background responses need a store"),
    Untranslated("prompt", Treatment.REFUSED, "prompt templates live on OpenAI's platform"),
    Untranslated("tools[].type", Treatment.REFUSED, "built-in tools (web_search, file_search, computer use, "
                 "code_interpreter, mcp, image_generation, local_shell) have no chat equivalent; "
                 "function tools and free-form custom tools are translated"),
    Untranslated("input[].type", Treatment.REFUSED, "item_reference and built-in tool call items need a "
                 "store or a built-in tool; message, function_call, function_call_output, "
                 "custom_tool_call, custom_tool_call_output and reasoning items are translated"),
    Untranslated("input[].content[].type", Treatment.REFUSED, "input_file parts and images by file_id have "
                 "no chat part"),
    Untranslated("tool_choice.type", Treatment.REFUSED, "allowed_tools and built-in tool choices have no "
                 "chat equivalent"),
    _OUTPUT_PART,
    custom_tools.GRAMMAR,
    Untranslated("include", Treatment.DROPPED, "extra output (encrypted reasoning, logprobs of built-in "
                 "tools) is not produced"),
    Untranslated("reasoning.summary", Treatment.DROPPED, "the engine's reasoning text is sent whole, as "
                 "reasoning_text"),
    Untranslated("input[].encrypted_content", Treatment.DROPPED, "encrypted reasoning means nothing to an "
                 "engine"),
    Untranslated("prompt_cache_key", Treatment.DROPPED, "the gateway routes by it; the engine caches "
                 "prefixes itself"),
    Untranslated("metadata", Treatment.DROPPED, "not the engine's"),
    Untranslated("safety_identifier", Treatment.DROPPED, "not the engine's"),
    Untranslated("user", Treatment.DROPPED, "not the engine's"),
    Untranslated("service_tier", Treatment.DROPPED, "an engine has one tier"),
    Untranslated("truncation", Treatment.DROPPED, "the engine is sent the whole input as given"),
    Untranslated("text.verbosity", Treatment.DROPPED, "no chat equivalent"),
    Untranslated("max_tool_calls", Treatment.DROPPED, "one chat completion makes one round of calls"),
)  # fmt: skip

_BUILT_IN = UNTRANSLATED[5]
_ITEM = UNTRANSLATED[6]
_PART = UNTRANSLATED[7]
_CHOICE = UNTRANSLATED[8]
_OUTPUTS = ("function_call_output", "custom_tool_call_output")
_COPIED = {"temperature": "temperature", "top_p": "top_p", "parallel_tool_calls": "parallel_tool_calls",
           "max_output_tokens": "max_tokens", "top_logprobs": "top_logprobs"}  # fmt: skip
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


# -- request ------------------------------------------------------------------------------------------------


def request(body: dict[str, Any]) -> dict[str, Any]:
    """The chat request asking what the Responses request asks, or a ``BadRequest`` naming the field."""
    refuse_fields(body, UNTRANSLATED)
    out: dict[str, Any] = {"model": body.get("model")}
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": text_of(instructions, "instructions", _TEXT_PARTS)})
    source = body.get("input")
    if isinstance(source, str):
        messages.append({"role": "user", "content": source})
    else:
        _items(list_at(source, "input"), messages)
    out["messages"] = messages
    copy_fields(body, out, _COPIED)
    stream_fields(body, out)
    tools_of(body, out, _tool)
    if body.get("tool_choice") is not None:
        out["tool_choice"] = _tool_choice(body["tool_choice"])
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and isinstance(reasoning.get("effort"), str):
        out["reasoning_effort"] = reasoning["effort"]
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict):
        fmt = _format(text["format"])
        if fmt is not None:
            out["response_format"] = fmt
    return out


def _items(items: list[Any], messages: list[dict[str, Any]]) -> None:
    reasoning: list[str] = []  # a reasoning item's text, for the assistant message after it
    images: list[dict[str, Any]] = []  # tool outputs' images, for a user message after their tool messages
    for i, item in enumerate(items):
        where = f"input[{i}]"
        item = object_at(item, where)
        kind = item.get("type", "message")
        if images and kind not in _OUTPUTS:
            messages.append({"role": "user", "content": images})
            images = []
        if kind == "message":
            msg = _message(item, where)
            if msg["role"] == "assistant" and reasoning:
                msg["reasoning_content"] = "".join(reasoning)
                reasoning = []
            messages.append(msg)
        elif kind in ("function_call", "custom_tool_call"):
            call = _call(item, where)
            last = messages[-1] if messages else None
            if last is None or last["role"] != "assistant":
                last = {"role": "assistant", "content": None}
                messages.append(last)
            if reasoning:
                last["reasoning_content"] = "".join(reasoning)
                reasoning = []
            last.setdefault("tool_calls", []).append(call)
        elif kind in _OUTPUTS:
            output = _output(item.get("output"), f"{where}.output", images)
            call_id = string_at(item.get("call_id"), f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            parts = item.get("content")
            for part in parts if isinstance(parts, list) else ():
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    reasoning.append(part["text"])
        else:
            refuse(_ITEM, f"{where}.type")
    if images:
        messages.append({"role": "user", "content": images})


def _output(output: Any, where: str, images: list[dict[str, Any]]) -> str:
    """A tool output's text; the ``input_image`` parts of an output list are appended to ``images``."""
    if not isinstance(output, list):
        return text_of(output, where, _TEXT_PARTS)
    texts: list[str] = []
    for k, part in enumerate(output):
        at = f"{where}[{k}]"
        part = object_at(part, at)
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            texts.append(string_at(part.get("text"), f"{at}.text"))
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            images.append(_image_part(part))
        else:
            refuse(_OUTPUT_PART, f"{at}.type")
    return "".join(texts)


def _image_part(part: dict[str, Any]) -> dict[str, Any]:
    """An ``input_image`` part with a URL as chat's ``image_url`` part (its ``detail`` kept)."""
    image: dict[str, Any] = {"url": part["image_url"]}
    if isinstance(part.get("detail"), str):
        image["detail"] = part["detail"]
    return {"type": "image_url", "image_url": image}


def _call(item: dict[str, Any], where: str) -> dict[str, Any]:
    """A function or custom tool call item as a chat tool call (a custom one's input as its shim's
    arguments, gateway/translate/custom_tools.py)."""
    if item.get("type") == "custom_tool_call":
        arguments = custom_tools.encode(string_at(item.get("input", ""), f"{where}.input"))
    else:
        arguments = string_at(item.get("arguments", ""), f"{where}.arguments")
    function = {"name": string_at(item.get("name"), f"{where}.name"), "arguments": arguments}
    return {
        "id": string_at(item.get("call_id"), f"{where}.call_id"),
        "type": "function",
        "function": function,
    }


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    given = item.get("role")
    role = _ROLES.get(given) if isinstance(given, str) else None
    if role is None:
        raise BadRequest(
            f"'{where}.role' must be user, assistant, system or developer", param=f"{where}.role"
        )
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(list_at(content, f"{where}.content")):
        at = f"{where}.content[{j}]"
        part = object_at(part, at)
        kind = part.get("type")
        if kind in _TEXT_PARTS:
            parts.append({"type": "text", "text": string_at(part.get("text"), f"{at}.text")})
        elif kind == "refusal":
            parts.append({"type": "text", "text": string_at(part.get("refusal"), f"{at}.refusal")})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            parts.append(_image_part(part))
        else:
            refuse(_PART, f"{at}.type")
    if all(p["type"] == "text" for p in parts):
        return {"role": role, "content": "".join(p["text"] for p in parts)}
    return {"role": role, "content": parts}


def _tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type") == "custom":
        return custom_tools.function_of(tool, where)
    if tool.get("type") != "function":
        refuse(_BUILT_IN, f"{where}.type")
    function: dict[str, Any] = {"name": string_at(tool.get("name"), f"{where}.name")}
    for name in ("description", "parameters", "strict"):
        if tool.get(name) is not None:
            function[name] = tool[name]
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        return {"type": "function", "function": {"name": string_at(choice.get("name"), "tool_choice.name")}}
    refuse(_CHOICE)
    return None  # unreachable: refuse raises


def _format(fmt: dict[str, Any]) -> dict[str, Any] | None:
    kind = fmt.get("type")
    if kind == "json_schema":
        schema: dict[str, Any] = {"name": fmt.get("name") or "output",
                                  "schema": object_at(fmt.get("schema"), "text.format.schema")}  # fmt: skip
        for name in ("strict", "description"):
            if fmt.get(name) is not None:
                schema[name] = fmt[name]
        return {"type": "json_schema", "json_schema": schema}
    if kind == "json_object":
        return {"type": "json_object"}
    return None  # "text": chat's default


# -- whole answer -------------------------------------------------------------------------------------------


def usage(chat: ChatUsage | None) -> dict[str, Any] | None:
    if chat is None:
        return None
    return {
        "input_tokens": chat.prompt,
        "input_tokens_details": {"cached_tokens": chat.cached or 0, "cache_write_tokens": 0},
        "output_tokens": chat.completion,
        "output_tokens_details": {"reasoning_tokens": chat.reasoning or 0},
        "total_tokens": chat.prompt + chat.completion,
    }


def response_id(chat_id: Any) -> str:
    text = chat_id if isinstance(chat_id, str) and chat_id else "0"
    return text if text.startswith("resp_") else f"resp_{text}"


def envelope(req: dict[str, Any], rid: str, model: Any, created: int) -> dict[str, Any]:
    """The response object's fields that echo the request (the SDK's ``Response`` reads them all)."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "instructions": req.get("instructions"),
        "max_output_tokens": req.get("max_output_tokens"),
        "model": model or req.get("model"),
        "output": [],
        "parallel_tool_calls": req.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "reasoning": req.get("reasoning"),
        "store": False,
        "temperature": req.get("temperature"),
        "text": req.get("text") or {"format": {"type": "text"}},
        "tool_choice": req.get("tool_choice", "auto"),
        "tools": req.get("tools") or [],
        "top_p": req.get("top_p"),
        "truncation": "disabled",
        "metadata": req.get("metadata") or {},
        "usage": None,  # last: a reader of the stream's tail finds it there
    }


def finished(resp: dict[str, Any], finish: Any) -> None:
    resp["status"] = "incomplete" if finish == "length" else "completed"
    if finish == "length":
        resp["incomplete_details"] = {"reason": "max_output_tokens"}
    elif finish == "content_filter":
        resp["status"], resp["incomplete_details"] = "incomplete", {"reason": "content_filter"}


def reasoning_item(iid: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    return {"id": iid, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(iid: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"id": iid, "type": "message", "role": "assistant", "status": status, "content": content}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(iid: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": iid, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def response(doc: dict[str, Any], req: dict[str, Any], created: int | None = None) -> dict[str, Any]:
    """The Responses answer of a whole chat completion (``ValueError``/``LookupError``: not one)."""
    choice = first_choice(doc)
    if choice is None:
        raise ValueError("a chat completion without choices")
    message = choice["message"]
    rid = response_id(doc.get("id"))
    resp = envelope(req, rid, doc.get("model"), int(time.time()) if created is None else created)
    output: list[dict[str, Any]] = []
    if (reasoning := reasoning_of(message)) is not None:
        output.append(reasoning_item(f"rs_{rid}", reasoning))
    if isinstance(message.get("content"), str) and message["content"]:
        output.append(message_item(f"msg_{rid}", message["content"]))
    custom = custom_tools.names(req)
    for n, call in enumerate(message.get("tool_calls") or ()):
        function = call.get("function") or {}
        call_id, name, arguments = (
            call.get("id") or f"call_{n}",
            function.get("name") or "",
            function.get("arguments") or "",
        )
        if name in custom:
            output.append(
                custom_tools.call_item(f"ctc_{call_id}", call_id, name, custom_tools.decode(arguments))
            )
        else:
            output.append(call_item(f"fc_{call_id}", call_id, name, arguments))
    resp["output"] = output
    finished(resp, choice.get("finish_reason"))
    resp["usage"] = usage(ChatUsage.of(doc.get("usage")))
    return resp


# -- streamed answer ----------------------------------------------------------------------------------------


class ResponsesStream:
    """Fed a chat stream's chunks (``chunk``) and its end (``finish``), gives the Responses events,
    SSE-encoded and numbered. One output item is open at a time (reasoning, message, or a function call):
    a different kind of output closes it (its ``...done`` events and ``output_item.done``). As for
    Messages, fragments of a tool call already closed end the stream with an error."""

    __slots__ = ("_created", "_custom", "_finish", "_item", "_req", "_resp", "_seq", "_stopped", "_text",
                 "_tool", "_usage", "done")  # fmt: skip

    def __init__(self, req: dict[str, Any], created: int | None = None) -> None:
        self._req = req
        self._custom = custom_tools.names(req)
        self._created = int(time.time()) if created is None else created
        self._resp: dict[str, Any] | None = None
        self._seq = 0
        self._item: dict[str, Any] | None = None  # the output item open
        self._text: list[str] = []  # its text (or arguments) so far
        self._tool: int | None = None  # the chat index of the open function call
        self._stopped: set[int] = set()
        self._finish: Any = None
        self._usage: ChatUsage | None = None
        self.done = False

    def chunk(self, doc: dict[str, Any]) -> list[bytes]:
        parts = chunk_parts(doc)
        out = [] if self._resp is not None else self._start(doc)
        if parts.usage is not None:
            self._usage = parts.usage
        if parts.reasoning is not None:
            out += self._reasoning(parts.reasoning)
        if parts.text is not None:
            out += self._content(parts.text)
        for index, call_id, name, arguments in parts.tools:
            out += self._call(index, call_id, name, arguments)
        if parts.finish is not None:
            self._finish = parts.finish["finish_reason"]
        return out

    def finish(self) -> list[bytes]:
        if self.done:
            return []
        self.done = True
        out = [] if self._resp is not None else self._start({})
        out += self._close()
        resp = self._snapshot()
        finished(resp, self._finish)
        resp["usage"] = usage(self._usage)
        kind = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
        out.append(self._event(kind, {"response": resp}))
        return out

    # -- the events ---------------------------------------------------------------------------------------

    def _event(self, kind: str, fields: dict[str, Any]) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return sse(kind, data)

    def _start(self, doc: dict[str, Any]) -> list[bytes]:
        rid = response_id(doc.get("id"))
        self._resp = envelope(self._req, rid, doc.get("model"), self._created)
        return [
            self._event("response.created", {"response": self._snapshot()}),
            self._event("response.in_progress", {"response": self._snapshot()}),
        ]

    def _snapshot(self) -> dict[str, Any]:
        assert self._resp is not None
        return {**self._resp, "output": list(self._resp["output"])}

    @property
    def _at(self) -> dict[str, Any]:
        """The open item's place, as every event of it names it."""
        assert self._resp is not None and self._item is not None
        return {"item_id": self._item["id"], "output_index": len(self._resp["output"])}

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        out = self._close()
        assert self._resp is not None
        self._item, self._text = item, []
        out.append(
            self._event(
                "response.output_item.added", {"output_index": len(self._resp["output"]), "item": item}
            )
        )
        return out

    def _reasoning(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self._item is None or self._item["type"] != "reasoning":
            out += self._close()  # first: an item's id holds its output index
            out += self._open(reasoning_item(f"rs_{self._rid}_{self._index()}", "", "in_progress"))
            part = {"type": "reasoning_text", "text": ""}
            out.append(
                self._event("response.content_part.added", {**self._at, "content_index": 0, "part": part})
            )
        self._text.append(text)
        out.append(
            self._event("response.reasoning_text.delta", {**self._at, "content_index": 0, "delta": text})
        )
        return out

    def _content(self, text: str) -> list[bytes]:
        out: list[bytes] = []
        if self._item is None or self._item["type"] != "message":
            out += self._close()
            out += self._open(message_item(f"msg_{self._rid}_{self._index()}", None, "in_progress"))
            part = output_text("")
            out.append(
                self._event("response.content_part.added", {**self._at, "content_index": 0, "part": part})
            )
        self._text.append(text)
        delta = {**self._at, "content_index": 0, "delta": text, "logprobs": []}
        out.append(self._event("response.output_text.delta", delta))
        return out

    def _call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[bytes]:
        out: list[bytes] = []
        if index != self._tool:
            if index in self._stopped:
                raise UpstreamError(
                    "the engine interleaved parallel tool calls; they cannot be streamed as items"
                )
            cid = call_id or f"call_{index}"
            if name is not None and name in self._custom:
                out += self._open(custom_tools.call_item(f"ctc_{cid}", cid, name, "", "in_progress"))
            else:
                out += self._open(call_item(f"fc_{cid}", cid, name or "", "", "in_progress"))
            self._tool = index
        if arguments and self._item is not None and self._item["type"] == "custom_tool_call":
            self._text.append(arguments)  # the shim's JSON: its decoded input is sent whole at the close
        elif arguments:
            self._text.append(arguments)
            out.append(
                self._event("response.function_call_arguments.delta", {**self._at, "delta": arguments})
            )
        return out

    @property
    def _rid(self) -> str:
        assert self._resp is not None
        return str(self._resp["id"]).removeprefix("resp_")

    def _index(self) -> int:
        assert self._resp is not None
        return len(self._resp["output"])

    def _close(self) -> list[bytes]:
        item = self._item
        if item is None:
            return []
        assert self._resp is not None
        at, text = self._at, "".join(self._text)
        out: list[bytes] = []
        if item["type"] == "reasoning":
            done = reasoning_item(item["id"], text)
            out.append(self._event("response.reasoning_text.done", {**at, "content_index": 0, "text": text}))
            part = {"type": "reasoning_text", "text": text}
            out.append(self._event("response.content_part.done", {**at, "content_index": 0, "part": part}))
        elif item["type"] == "message":
            done = message_item(item["id"], text)
            out.append(
                self._event(
                    "response.output_text.done", {**at, "content_index": 0, "text": text, "logprobs": []}
                )
            )
            out.append(
                self._event(
                    "response.content_part.done", {**at, "content_index": 0, "part": output_text(text)}
                )
            )
        elif item["type"] == "custom_tool_call":
            given = custom_tools.decode(text)
            done = custom_tools.call_item(item["id"], item["call_id"], item["name"], given)
            out.append(self._event("response.custom_tool_call_input.delta", {**at, "delta": given}))
            out.append(self._event("response.custom_tool_call_input.done", {**at, "input": given}))
        else:
            done = call_item(item["id"], item["call_id"], item["name"], text)
            args = {**at, "arguments": text, "name": item["name"]}
            out.append(self._event("response.function_call_arguments.done", args))
        if item["type"] in ("function_call", "custom_tool_call") and self._tool is not None:
            self._stopped.add(self._tool)
            self._tool = None
        out.append(
            self._event("response.output_item.done", {"output_index": at["output_index"], "item": done})
        )
        self._resp["output"].append(done)
        self._item, self._text = None, []
        return out
