"""Responses ``custom`` tools (free-form text input) as chat function tools, and their calls back.

A custom tool whose ``format`` is ``text`` (or absent) takes one string the model writes freely. Chat has
no such tool, so it goes as a function whose one required parameter ``input`` is that string; a call of it
comes back as a ``custom_tool_call`` item whose ``input`` is the argument decoded (bare text, when the
engine sent arguments that are not that object, passes as it is). vLLM's own Responses server shims custom
tools the same way (its ``encode_custom_tool_input``, key ``input``).

A ``grammar`` format (lark or regex) constrains what the model may write; a chat function's arguments
cannot carry that constraint (vLLM's Responses server refuses it too), so it is refused with a 400.
"""

from __future__ import annotations

import json
from typing import Any

from gateway.translate.common import Treatment, Untranslated, refuse, string_at

INPUT_KEY = "input"
GRAMMAR = Untranslated(
    "tools[].format",
    Treatment.REFUSED,
    "a grammar-constrained custom tool (lark, regex) has no chat equivalent: a function's arguments cannot "
    "carry the grammar; free-form text custom tools are translated, as a function taking one string",
)
_PARAMETERS = {
    "type": "object",
    "properties": {INPUT_KEY: {"type": "string", "description": "the tool's input, as free-form text"}},
    "required": [INPUT_KEY],
    "additionalProperties": False,
}


def function_of(tool: dict[str, Any], where: str) -> dict[str, Any]:
    """The chat function tool standing for a custom tool, or a 400 naming its grammar format."""
    fmt = tool.get("format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") in (None, "text")):
        refuse(GRAMMAR, f"{where}.format")
    function: dict[str, Any] = {
        "name": string_at(tool.get("name"), f"{where}.name"),
        "parameters": _PARAMETERS,
    }
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def names(body: dict[str, Any]) -> frozenset[str]:
    """The names of the request's custom tools: their calls answer as ``custom_tool_call`` items."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return frozenset()
    return frozenset(
        t["name"]
        for t in tools
        if isinstance(t, dict) and t.get("type") == "custom" and isinstance(t.get("name"), str)
    )


def encode(text: str) -> str:
    """A custom call's input as the shim function's arguments."""
    return json.dumps({INPUT_KEY: text}, ensure_ascii=False)


def decode(arguments: str) -> str:
    """The shim function's arguments as the custom call's input (bare text passes as it is)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    value = parsed.get(INPUT_KEY) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


def call_item(iid: str, call_id: str, name: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": iid, "type": "custom_tool_call", "call_id": call_id, "name": name, "input": text,
            "status": status}  # fmt: skip
