"""A request's shape in characters, for the cost model: the whole head and the tail since the last reply.

Characters, not tokens: the gateway does not tokenize. It converts with a learned characters-per-token
ratio (``gateway.learning``). Images count ``IMAGE_CHARS`` each (an image costs hundreds of tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

IMAGE_CHARS = 2000


class Shape(NamedTuple):
    head_chars: int  # system/developer messages and the first user message
    tail_chars: int  # messages after the last assistant message (all of them on turn 1)
    turn: int  # assistant messages seen + 1


def chat_shape(messages: list[Any]) -> Shape:
    return chat_turns(messages)[0]


def chat_turns(messages: list[Any]) -> tuple[Shape, Mapping[str, Any] | None]:
    """``turns_shape(messages, message_chars)`` and the first assistant message after a user message (the
    first reply: ``routing.keys.first_reply`` reads its text), in one walk. Once per routed chat request, so
    it measures only what the shape needs: the head, then what follows the latest reply (an assistant
    message's own size is never needed), the common message (text, no tool calls) inline."""
    head = cut = replies = 0  # the tail within the head: what follows its latest reply (``head - cut``)
    rest = iter(messages)
    for msg in rest:  # the head: up to and with the first user message (no reply comes before one)
        if not isinstance(msg, dict):
            continue
        content = msg.get("content")
        head += len(content) if type(content) is str and "tool_calls" not in msg else message_chars(msg)
        role = msg.get("role")
        if role == "user":
            break
        if role == "assistant":
            replies += 1
            cut = head
    tail = head - cut
    for msg in rest:  # to the first reply
        if not isinstance(msg, dict):
            continue
        if msg.get("role") == "assistant":
            reply = msg
            break
        content = msg.get("content")
        tail += len(content) if type(content) is str and "tool_calls" not in msg else message_chars(msg)
    else:
        return Shape(head, tail, replies + 1), None
    replies += 1
    tail = 0
    for msg in rest:  # after it: the tail since the latest reply
        if not isinstance(msg, dict):
            continue
        if msg.get("role") == "assistant":
            replies += 1
            tail = 0
        else:
            content = msg.get("content")
            tail += len(content) if type(content) is str and "tool_calls" not in msg else message_chars(msg)
    return Shape(head, tail, replies + 1), reply


def turns_shape(messages: Iterable[Any], chars: Callable[[Mapping[str, Any]], int], system: int = 0) -> Shape:
    """The shape of a list of turns, each message measured by ``chars``; ``system``: characters that stand
    before the messages (in the head, and in the tail until the first reply)."""
    head = tail = system
    replies = 0
    in_head = True
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        n = chars(msg)
        role = msg.get("role")
        if in_head:
            head += n
            in_head = role != "user"
        if role == "assistant":
            replies += 1
            tail = 0
        else:
            tail += n
    return Shape(head, tail, replies + 1)


def message_chars(msg: Mapping[str, Any]) -> int:
    content = msg.get("content")
    if type(content) is str and "tool_calls" not in msg:
        return len(content)  # the common message: text, no tool calls
    n = 0
    if isinstance(content, str):
        n = len(content)
    elif isinstance(content, list):
        for part in content:
            if isinstance(part, dict):
                text = part.get("text")
                n += len(text) if isinstance(text, str) else IMAGE_CHARS
    calls = msg.get("tool_calls")
    if isinstance(calls, list):
        for call in calls:
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict):
                n += len(str(function.get("arguments") or ""))
    return n


def messages_shape(body: Mapping[str, Any]) -> Shape:
    """An Anthropic Messages body: ``system`` counts in the head, content blocks by their text (tool input
    and results by their JSON or text; images ``IMAGE_CHARS``)."""
    return turns_shape(body.get("messages") or (), _content_chars, block_chars(body.get("system")))


def _content_chars(msg: Mapping[str, Any]) -> int:
    return block_chars(msg.get("content"))


def block_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    n = 0
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "image":
            n += IMAGE_CHARS
        elif kind == "tool_use":
            n += len(str(block.get("input") or ""))
        elif kind == "tool_result":
            n += block_chars(block.get("content"))
        else:
            text = block.get("text", block.get("thinking"))
            n += len(text) if isinstance(text, str) else 0
    return n
