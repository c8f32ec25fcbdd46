"""Conversation keys: the same chat gets the same key on turn 1 and turn N, with no client help.

The key is xxh3-128 over the model and the conversation's stable head: tool definitions, the leading
system/developer messages and the first user message. Later turns only append, so the head — and the key —
stay put. An explicit session id, when the client sends one, replaces all of that.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import xxhash

from routing.volatile import NO_RULES, SYSTEM_ROLES, VolatileRules

_SEP = b"\x1f"  # unit separator between fields; lengths are hashed too, so no two inputs collide by framing


def session_key(model: str, session_id: str, source: str | None = None) -> str:
    """Key of a conversation the client names: model, where the name came from, the name.

    ``source`` None is the legacy ``routing.session_header`` (its keys stay what they were, so pins in a
    shared store survive an upgrade); any other source is hashed in, so one value sent by two sources
    (a header and a body field of different clients) names two conversations.
    """
    if source is None:
        return _digest([b"session", model.encode(), session_id.encode()])
    return _digest([b"session", model.encode(), source.encode(), session_id.encode()])


def subagent_key(session: str, agent_id: str) -> str:
    """Key of a subagent's conversation: its session's key and its own id (each agent of one session has
    its own prompt, so its own prefix)."""
    return _digest([b"subagent", session.encode(), agent_id.encode()])


def chat_key(body: Mapping[str, Any], volatile: VolatileRules = NO_RULES) -> str:
    """Key of a chat-completions body. ``body`` must already be validated (model str, messages list).
    System text ``volatile`` names (a per-request nonce) is left out."""
    fields = [b"chat", str(body["model"]).encode()]
    tools = body.get("tools")
    if tools:
        fields.append(json.dumps(tools, sort_keys=True, separators=(",", ":")).encode())
    for msg in head_messages(body["messages"]):
        role = msg.get("role", "")
        content = msg.get("content")
        if isinstance(role, str) and role in SYSTEM_ROLES:
            content = volatile.drop_content(content)
        fields.append(str(role).encode())
        if type(content) is str:  # the common message: ``canonical_parts``'s first case, without the call
            fields.append(b"t" + content.encode())
        else:
            fields.extend(canonical_parts(content))
    return _digest(fields)


def responses_key(body: Mapping[str, Any]) -> str:
    """Key of a Responses body (``POST /v1/responses``), validated: model, tools, ``instructions`` and the
    input items up to the first user item. A string ``input`` is one user message."""
    fields = [b"responses", str(body["model"]).encode()]
    tools = body.get("tools")
    if tools:
        fields.append(json.dumps(tools, sort_keys=True, separators=(",", ":")).encode())
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        fields.append(b"s" + instructions.encode())
    items = body["input"]
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    for item in head_items(items):
        role = item.get("role")
        if role is None:  # not a message (a function call, its output, a reasoning item): as JSON
            fields.append(b"j" + json.dumps(item, sort_keys=True).encode())
            continue
        fields.append(str(role).encode())
        fields.extend(canonical_parts(_as_text_parts(item.get("content"))))
    return _digest(fields)


def head_items(items: list[Any]) -> list[Mapping[str, Any]]:
    """A Responses input's leading items through its first user message."""
    return head_messages(items)


def _as_text_parts(content: Any) -> Any:
    """Responses' parts as chat's: ``input_text``/``output_text`` as ``text`` (a plain string hashes as one
    of them), ``input_image`` as ``image_url`` (inline data hashed, not kept)."""
    if not isinstance(content, list):
        return content
    return [_as_chat_part(p) for p in content]


def _as_chat_part(part: Any) -> Any:
    if not isinstance(part, dict):
        return part
    kind = part.get("type")
    if kind in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    if kind == "input_image" and isinstance(part.get("image_url"), str):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    return part


def messages_key(body: Mapping[str, Any], volatile: VolatileRules = NO_RULES) -> str:
    """Key of an Anthropic Messages body (validated: model str, messages list): model, tools, ``system`` and
    the messages through the first user message. A system string and one text block hash alike (as chat's
    parts do); ``cache_control`` marks, which clients move from turn to turn, are not hashed. System blocks
    ``volatile`` names (Claude Code's per-request billing block) are left out."""
    fields = [b"messages", str(body["model"]).encode()]
    tools = body.get("tools")
    if tools:
        fields.append(json.dumps(tools, sort_keys=True, separators=(",", ":")).encode())
    system = volatile.drop_content(body.get("system"))
    fields.append(b"s")
    fields.extend(block_parts(system))
    for msg in head_messages(body["messages"]):
        fields.append(str(msg.get("role", "")).encode())
        fields.extend(block_parts(msg.get("content")))
    return _digest(fields)


def block_parts(content: Any) -> list[bytes]:
    """Anthropic content (a string or content blocks) as hashable parts: text as chat's text parts, images
    by source (inline data by its hash), any other block as JSON without its ``cache_control``."""
    if not isinstance(content, list):
        return canonical_parts(content)
    parts: list[bytes] = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") == "text":
            parts.extend(canonical_parts([block]))
        elif block.get("type") == "image":
            parts.append(b"i" + _source_identity(block.get("source")))
        else:
            kept = {k: v for k, v in block.items() if k != "cache_control"}
            parts.append(b"j" + json.dumps(kept, sort_keys=True).encode())
    return parts


def _source_identity(source: Any) -> bytes:
    if not isinstance(source, dict):
        return b"j" + json.dumps(source, sort_keys=True).encode()
    if source.get("type") == "url":
        return b"u" + str(source.get("url", "")).encode()
    return b"d" + xxhash.xxh3_128_digest(str(source.get("data", "")).encode())


def completion_key(model: str, prompt: Any, chars: int) -> str:
    """Key of a completions body: the prompt's leading ``chars`` characters (or ``chars // 4`` token ids).

    Prompts shorter than the block are keyed whole, so a short first turn and its longer follow-up can key
    differently; short prompts are cheap to prefill, so little is lost.
    """
    fields = [b"completion", model.encode()]
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: key by its first prompt
    if isinstance(prompt, str):
        fields.append(prompt[:chars].encode())
    elif isinstance(prompt, list):
        fields.append(",".join(str(t) for t in prompt[: max(1, chars // 4)]).encode())
    return _digest(fields)


def head_messages(messages: list[Any]) -> list[Mapping[str, Any]]:
    """The leading system/developer messages and the first user message (everything up to it)."""
    head: list[Mapping[str, Any]] = []
    for msg in messages:
        if not isinstance(msg, dict):  # parsed JSON: dict, and much cheaper to test than an ABC
            continue
        head.append(msg)
        if msg.get("role") == "user":
            break
    return head


def canonical_parts(content: Any) -> list[bytes]:
    """Content as hashable parts: a plain string and a single text part hash alike; images by URL/data."""
    if content is None:
        return []
    if isinstance(content, str):
        return [b"t" + content.encode()]
    if not isinstance(content, list):
        return [b"j" + json.dumps(content, sort_keys=True).encode()]
    parts: list[bytes] = []
    for part in content:
        if not isinstance(part, dict):
            parts.append(b"j" + json.dumps(part, sort_keys=True).encode())
            continue
        kind = part.get("type")
        if kind == "text":
            parts.append(b"t" + str(part.get("text", "")).encode())
        elif kind == "image_url":
            parts.append(b"i" + _image_identity(part.get("image_url")))
        else:
            parts.append(b"j" + json.dumps(part, sort_keys=True).encode())
    return parts


def _image_identity(image_url: Any) -> bytes:
    url = image_url.get("url", "") if isinstance(image_url, dict) else str(image_url or "")
    if url.startswith("data:"):
        # Inline images can be megabytes: hash the payload, don't keep it around.
        return b"d" + xxhash.xxh3_128_digest(url.encode())
    return b"u" + url.encode()


#: ``n.to_bytes(8, "little")`` of the short lengths, made once: a field's frame is a list index, not a call.
_LENGTHS = [n.to_bytes(8, "little") for n in range(1024)]


def _digest(fields: list[bytes]) -> str:
    """xxh3-128 of the fields, each framed as its 8-byte length, the bytes, a separator: one call into the
    hash over one buffer (the same digest as feeding the framed fields one by one)."""
    framed: list[bytes] = []
    lengths = _LENGTHS
    for data in fields:
        n = len(data)
        framed += (lengths[n] if n < 1024 else n.to_bytes(8, "little"), data, _SEP)
    return xxhash.xxh3_128_hexdigest(b"".join(framed))


# -- identical heads told apart ---------------------------------------------------------------------------

#: Characters of the first reply that tell twins apart (sampled replies differ within a few tokens).
REPLY_CHARS = 64
_REPLY_FIELD = len(b"reply").to_bytes(8, "little") + b"reply" + _SEP


def reply_key(key: str, reply: str) -> str:
    """The key of turns >= 2: the head's key extended with the beginning of the first assistant reply.

    The gateway computes the same value from the reply as it streams past (``gateway.observe``), so each of
    several conversations sharing one head follows the backend that produced its own first reply.
    """
    # A reply is a later turn's text, not validated (the engine judges it): a lone surrogate hashes as is.
    # ``_digest([b"reply", key, reply])`` framed here at once (the first field's frame is a constant): it
    # runs on every later turn.
    # The lengths from ``_LENGTHS`` (a reply's 64 characters are at most 256 bytes), and the plain encoding
    # first (the same bytes: only a surrogate needs the error handler).
    k, r = key.encode(), reply[:REPLY_CHARS]
    try:
        b = r.encode()
    except UnicodeEncodeError:
        b = r.encode("utf-8", "surrogatepass")
    n = len(k)
    length = _LENGTHS[n] if n < 1024 else n.to_bytes(8, "little")
    framed = (_REPLY_FIELD, length, k, _SEP, _LENGTHS[len(b)], b, _SEP)
    return xxhash.xxh3_128_hexdigest(b"".join(framed))


def first_reply(messages: list[Any]) -> str | None:
    """The beginning of the first assistant message after the first user message, or None (turn 1)."""
    seen_user = False
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        role = msg.get("role")
        if role == "user":
            seen_user = True
        elif role == "assistant" and seen_user:
            return reply_text(msg)
    return None


def reply_text(msg: Mapping[str, Any]) -> str:
    """A reply's text (content, else its first tool call's arguments), cut to ``REPLY_CHARS``."""
    content = msg.get("content")
    text = ""
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(
            str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"
        )
    if not text:
        calls = msg.get("tool_calls")
        if isinstance(calls, list) and calls and isinstance(calls[0], dict):
            function = calls[0].get("function")
            if isinstance(function, dict):
                text = str(function.get("arguments") or "")
    return text[:REPLY_CHARS]
