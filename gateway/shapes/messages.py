"""Anthropic Messages (``POST /v1/messages``) and its token count (``POST /v1/messages/count_tokens``).

What the gateway reads (everything else goes upstream as the client's bytes): ``model``, ``max_tokens``
(an integer >= 1; the count has none), ``messages`` (user/assistant turns, content a string or blocks),
``system`` (a string or text blocks), ``tools``, ``stream``, ``metadata``, ``thinking`` and
``output_config.effort``. The conversation key is model + tools + system + the messages through the first
user message (``routing.keys.messages_key``); the count keys alike, so it goes where its conversation would,
but it never creates or moves a pin (``pins=False``).

Answers: usage is split in a stream (``message_start`` has ``input_tokens`` and the cache fields, the last
``message_delta`` has ``output_tokens``; vLLM repeats all of them there), so the tap keeps the stream's head
too. ``input_tokens`` is the uncached part: prompt tokens = input + cache read + cache creation. The reply's
text is in ``text`` (``text_delta`` events, ``content[].text`` of a whole body); ``stop_reason`` says why it
ended.

Thinking budgets: ``thinking: {type: enabled, budget_tokens: N}`` (N >= 1024 and < ``max_tokens``, as
Anthropic's API requires), ``{type: adaptive}`` with ``output_config.effort``, ``{type: disabled}``. The
client's fields go to the engine as sent: vLLM's and llama.cpp's Messages routes cap ``budget_tokens``
themselves. A budget the gateway derives (an effort table, a model default) is written as ``thinking``.
"""

from __future__ import annotations

import json
from typing import Any

from config.settings import RoutingConfig
from gateway.errors import BadRequest
from gateway.images import ImagePart, content_parts
from gateway.inbound import check_common, check_text, require_model
from gateway.observe import ReplyText, Usage
from gateway.quota_windows import RateLimitStyle
from gateway.shapes.anthropic_errors import ANTHROPIC_ERRORS
from gateway.shapes.base import ApiShape, FinishKey, ThinkingUse
from gateway.thinking import BudgetAsk, Thinking
from routing.keys import messages_key
from routing.shape import messages_shape
from routing.volatile import rules_for

ROLES = ("user", "assistant")
#: ``output_config.effort`` values (Anthropic's, and vLLM's Messages route accepts the same).
EFFORTS = ("low", "medium", "high", "xhigh", "max")
MIN_BUDGET = 1024  # Anthropic's smallest ``budget_tokens``; vLLM's Messages route refuses less too
#: Bytes of a stream's beginning kept for its usage: ``message_start`` is its first event.
USAGE_HEAD = 4096

#: ``stop_reason`` as the guard's bounded metric labels (OpenAI's names, so one alert reads every shape).
STOP_REASONS = FinishKey(
    b'"stop_reason":',
    {
        "end_turn": "stop",
        "stop_sequence": "stop",
        "max_tokens": "length",
        "tool_use": "tool_calls",
        "refusal": "content_filter",
    },
)
_USAGE = b'"usage"'
_DECODER = json.JSONDecoder()


# -- requests -----------------------------------------------------------------------------------------------


def validate(body: dict[str, Any]) -> str:
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise BadRequest("'max_tokens' is required", param="max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be an integer >= 1, got {max_tokens!r}", param="max_tokens")
    return validate_count(body)


def validate_count(body: dict[str, Any]) -> str:
    """A token count's body: a message's, without ``max_tokens``."""
    model = require_model(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", param="messages")
    in_head = True  # up to the first user message: what routing.keys hashes
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise BadRequest(f"{where} must be an object", param=where)
        role = msg.get("role")
        if role not in ROLES:
            raise BadRequest(f"{where}.role must be 'user' or 'assistant'", param=f"{where}.role")
        _check_blocks(msg.get("content"), f"{where}.content", head=in_head)
        in_head = in_head and role != "user"
    system = body.get("system")
    if system is not None:
        _check_blocks(system, "system", head=True, text_only=True)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise BadRequest("'metadata' must be an object", param="metadata")
    check_common(body)
    thinking_ask(body)  # a bad budget is a 400 on the count too
    return model


def _check_blocks(content: Any, where: str, *, head: bool, text_only: bool = False) -> None:
    """A string, or an array of blocks (objects with a string ``type``); in the head, no lone surrogates in
    what the key hashes."""
    if isinstance(content, str):
        if head:
            check_text(content, where)
        return
    if not isinstance(content, list):
        kinds = "text blocks" if text_only else "content blocks"
        raise BadRequest(f"'{where}' must be a string or an array of {kinds}", param=where)
    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise BadRequest(f"'{at}' must be an object with a string 'type'", param=at)
        kind = block["type"]
        if text_only and kind != "text":
            raise BadRequest(f"'{at}' must be a text block, not {kind[:40]!r}", param=at)
        if kind == "text":
            text = block.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"'{at}.text' must be a string", param=f"{at}.text")
            if head:
                check_text(text, f"{at}.text")
        elif kind == "image" and head and isinstance(block.get("source"), dict):
            for name, value in block["source"].items():  # the key hashes the URL or the data
                if isinstance(value, str):
                    check_text(value, f"{at}.source.{name}"[:200])


def key(body: dict[str, Any], model: str, routing: RoutingConfig) -> str:
    """Model, tools, system and the messages through the first user message."""
    return messages_key(body, rules_for(routing.volatile_prefixes))


# -- thinking -----------------------------------------------------------------------------------------------


def thinking_ask(body: dict[str, Any]) -> BudgetAsk:
    """(budget, effort) of ``thinking`` and ``output_config.effort``: enabled -> its budget, adaptive -> no
    cap (the effort, if any), disabled -> 0. A bad value is a 400 naming the field."""
    effort = _effort(body.get("output_config"))
    thinking = body.get("thinking")
    param = "thinking.budget_tokens"
    if thinking is None:
        return BudgetAsk(None, effort, param)
    if not isinstance(thinking, dict):
        raise BadRequest("'thinking' must be an object", param="thinking")
    kind = thinking.get("type")
    if kind == "disabled":
        return BudgetAsk(0, None, param)
    if kind == "adaptive":
        return BudgetAsk(None, effort, param)
    if kind != "enabled":
        raise BadRequest(
            f"'thinking.type' must be one of enabled, adaptive, disabled, got {kind!r}"[:200],
            param="thinking.type",
        )
    budget = thinking.get("budget_tokens")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < MIN_BUDGET:
        raise BadRequest(f"'{param}' must be an integer >= {MIN_BUDGET}, got {budget!r}"[:200], param=param)
    limit = body.get("max_tokens")
    if isinstance(limit, int) and not isinstance(limit, bool) and budget >= limit:
        raise BadRequest(f"'{param}' ({budget}) must be less than 'max_tokens' ({limit})", param=param)
    return BudgetAsk(budget, effort, param)


def _effort(config: Any) -> str | None:
    if config is None:
        return None
    if not isinstance(config, dict):
        raise BadRequest("'output_config' must be an object", param="output_config")
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise BadRequest(
            f"'output_config.effort' must be one of {', '.join(EFFORTS)}, got {effort!r}"[:200],
            param="output_config.effort",
        )
    return effort


def spell_thinking(body: dict[str, Any], thinking: Thinking) -> tuple[str, Any] | None:
    """A budget the gateway derived (the client asked none) as the top-level field to write, where
    Anthropic's rules allow it (off; or N >= 1024 below ``max_tokens``); None: the body stays as sent. The
    client's own ``thinking`` is never changed."""
    if thinking.explicit or "thinking" in body or thinking.budget is None:
        return None
    if thinking.off:
        return "thinking", {"type": "disabled"}
    limit = body.get("max_tokens")
    if thinking.budget >= MIN_BUDGET and isinstance(limit, int) and thinking.budget < limit:
        return "thinking", {"type": "enabled", "budget_tokens": thinking.budget}
    return None


# -- images -------------------------------------------------------------------------------------------------


def images(body: dict[str, Any]) -> tuple[ImagePart, ...]:
    """The ``image`` blocks of the messages and of their ``tool_result`` blocks, as URLs (inline data as a
    ``data:`` URI), in order."""
    found: list[ImagePart] = []
    for i, j, block in content_parts(body.get("messages")):
        at = f"messages[{i}].content[{j}]"
        if block.get("type") == "image":
            found.append(ImagePart(i, j, _source_url(block.get("source"), at), f"{at}.source"))
        elif block.get("type") == "tool_result" and isinstance(block.get("content"), list):
            found += _result_images(block["content"], i, j, at)
    return tuple(found)


def _result_images(content: list[Any], i: int, j: int, at: str) -> list[ImagePart]:
    found: list[ImagePart] = []
    for k, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") == "image":
            where = f"{at}.content[{k}]"
            found.append(ImagePart(i, j, _source_url(part.get("source"), where), f"{where}.source"))
    return found


def _source_url(source: Any, where: str) -> str:
    param = f"{where}.source"
    if not isinstance(source, dict):
        raise BadRequest(f"'{param}' must be an object", param=param)
    if source.get("type") == "url":
        url = source.get("url")
        if not isinstance(url, str) or not url:
            raise BadRequest(f"'{param}.url' must be a non-empty string", param=f"{param}.url")
        check_text(url, f"{param}.url")
        return url
    data, media = source.get("data"), source.get("media_type")
    if source.get("type") != "base64" or not isinstance(data, str) or not isinstance(media, str):
        raise BadRequest(
            f"'{param}' must be {{type: url, url}} or {{type: base64, media_type, data}}", param=param
        )
    check_text(media, f"{param}.media_type")
    return f"data:{media};base64,{data}"


# -- answers ------------------------------------------------------------------------------------------------


def usage(data: bytes) -> Usage | None:
    """The usage of a body (its last ``usage``) or a stream (``message_start``'s, each field overridden by
    the last ``message_delta``'s where it reports one). ``data``: the answer's head, then its tail."""
    first = _usage_object(data, data.find(_USAGE), forward=True)
    last = _usage_object(data, data.rfind(_USAGE), forward=False)
    if first is None and last is None:
        return None
    merged = {k: v for obj in (first, last) if obj is not None for k, v in obj.items() if _count(v)}
    if "input_tokens" not in merged or "output_tokens" not in merged:
        return None
    read, created = merged.get("cache_read_input_tokens"), merged.get("cache_creation_input_tokens")
    prompt = merged["input_tokens"] + (read or 0) + (created or 0)
    cached = read if read is not None else (0 if created is not None else None)
    return Usage(prompt, merged["output_tokens"], cached)


def _usage_object(data: bytes, at: int, *, forward: bool) -> dict[str, Any] | None:
    """The first (``forward``) or last well-formed ``"usage": {...}`` object from ``at`` on."""
    while at >= 0:
        text = data[at + len(_USAGE) : at + len(_USAGE) + 2048].decode("utf-8", "replace").lstrip()
        if text.startswith(":"):
            try:
                value, _ = _DECODER.raw_decode(text[1:].lstrip())
            except ValueError:
                value = None
            if isinstance(value, dict):
                return value
        at = data.find(_USAGE, at + 1) if forward else data.rfind(_USAGE, 0, at)
    return None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def reply_text(doc: Any) -> str | None:
    """A whole Message's reply text: its text blocks, joined."""
    content = doc.get("content") if isinstance(doc, dict) else None
    if not isinstance(content, list):
        return None
    text = "".join(str(b.get("text", "")) for b in content if isinstance(b, dict) and b.get("type") == "text")
    return text or None


MESSAGES = ApiShape(
    name="messages",
    path="/v1/messages",
    validate=validate,
    key=key,
    errors=ANTHROPIC_ERRORS,
    usage=usage,
    text_key=b'"text":',
    thinking=ThinkingUse.RESOLVE,
    vision=True,
    usage_head=USAGE_HEAD,
    reply=ReplyText(marker=b'"text_delta"', key=b'"text"', body=reply_text),
    finish=STOP_REASONS,
    terminal=(b"event: message_stop",),
    turns=messages_shape,
    thinking_ask=thinking_ask,
    thinking_spell=spell_thinking,
    images=images,
    # vLLM's Messages route has no image_embeds block (its content blocks are a closed list): an attempt
    # with images on an embeds backend goes as chat (gateway/translation.py), which takes them.
    embeds=False,
    embeds_via_chat=True,
    ratelimit=RateLimitStyle.ANTHROPIC,
)

#: Routed where its conversation is pinned, without pinning; its answer (``{"input_tokens": N}``) has no
#: usage, text or stop reason, and it generates nothing, so no budget is spelled. Its candidates are its
#: turn's (gateway/vision.py): image blocks never go to ``vision: none`` backends, and ``embeds`` ones are
#: eligible as for the Message. The count itself always goes as the client's bytes: there is no translation
#: of a count to chat, and counting needs no image embeddings, so the sidecar is never asked.
COUNT_TOKENS = ApiShape(
    name="count_tokens",
    path="/v1/messages/count_tokens",
    validate=validate_count,
    key=key,
    errors=ANTHROPIC_ERRORS,
    usage=lambda _data: None,
    vision=True,
    pins=False,
    turns=messages_shape,
    images=images,
    embeds=False,
    embeds_via_chat=True,  # the routing of its turn; no translator exists for it (gateway/translation.py)
    ratelimit=RateLimitStyle.ANTHROPIC,
)
