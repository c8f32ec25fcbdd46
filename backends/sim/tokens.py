"""The simulator's tokenizer and chat template.

Token rule (deterministic, documented so tests and benchmarks can count by hand):

- a special marker ``<|...|>`` (letters, digits, underscore inside) is one token;
- every other maximal run of non-whitespace characters is one token (``"Hello, world!"`` → 2 tokens).

Chat template (ChatML-like, so turn N+1 renders as turn N's prompt plus more text and shares its prefix)::

    <|im_start|>{role}\\n{content}<|im_end|>\\n      # 3 tokens + content tokens per message
    <|im_start|>assistant\\n                         # generation prompt: 2 tokens

Tools (the request's ``tools``, when present) render as one ``tools`` message holding their sorted JSON, right
after a leading system message (or first): system, then tools, then the conversation, as chat templates do.

Content is a string or a list of parts: text parts are joined by newlines; any other part (``image_url``,
``image_embeds``, ``input_audio``, ...) becomes ``media_token_count`` distinct ``<|media_<hash>_<i>|>``
tokens, where the hash is taken over the part's payload (the URL for ``image_url``) — so the same image gives
the same tokens, and a different image gives different ones.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

MEDIA_TOKENS_MIN = 64
MEDIA_TOKENS_SPREAD = 192  # a media part costs 64..255 tokens, fixed per payload

_SPECIAL = r"<\|[A-Za-z0-9_]+\|>"
_TOKEN_RE = re.compile(rf"{_SPECIAL}|(?:(?!{_SPECIAL})\S)+")


class TemplateError(ValueError):
    """The messages cannot be rendered (wrong shape)."""


def tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    for run in text.split():  # the regex is only needed where a marker may hide inside a run
        if "<|" in run:
            tokens.extend(_TOKEN_RE.findall(run))
        else:
            tokens.append(run)
    return tokens


def _payload_digest(part: Mapping[str, Any]) -> bytes:
    kind = part.get("type")
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, Mapping) else image
        payload = str(url)
    else:
        payload = json.dumps(part.get(str(kind), part), sort_keys=True, default=str)
    return hashlib.blake2b(payload.encode(), digest_size=8).digest()


def media_token_count(part: Mapping[str, Any]) -> int:
    return MEDIA_TOKENS_MIN + int.from_bytes(_payload_digest(part), "big") % MEDIA_TOKENS_SPREAD


def render_media(part: Mapping[str, Any]) -> str:
    tag = _payload_digest(part).hex()
    return " ".join(f"<|media_{tag}_{i}|>" for i in range(media_token_count(part)))


def render_content(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TemplateError("message content must be a string, a list of parts or null")
    pieces: list[str] = []
    for part in content:
        if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
            raise TemplateError("each content part must be an object with a string 'type'")
        if part["type"] == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise TemplateError("a text part needs a string 'text'")
            pieces.append(text)
        else:
            pieces.append(render_media(part))
    return "\n".join(pieces)


def _render_message(message: Any) -> tuple[str, str]:
    if not isinstance(message, Mapping):
        raise TemplateError("each message must be an object")
    role = message.get("role")
    if not isinstance(role, str) or not role.isidentifier():
        raise TemplateError("each message needs a 'role' made of letters, digits or '_'")
    body = render_content(message.get("content"))
    tool_calls = message.get("tool_calls")
    if tool_calls:
        body = f"{body}\n{json.dumps(tool_calls, sort_keys=True)}" if body else json.dumps(tool_calls)
    return role, body


def render_chat(
    messages: Sequence[Any],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Sequence[Any] | None = None,
) -> str:
    """Render messages to the prompt string. With ``continue_final_message`` the last (assistant) message
    stays open, so generation continues it (Qwen's thinking-budget trick relies on this)."""
    if not messages:
        raise TemplateError("messages must not be empty")
    rendered = [_render_message(m) for m in messages]
    if tools:
        at = 1 if rendered[0][0] == "system" else 0
        rendered.insert(at, ("tools", json.dumps(list(tools), sort_keys=True, default=str)))
    out: list[str] = []
    for index, (role, body) in enumerate(rendered):
        is_open = continue_final_message and index == len(rendered) - 1
        out.append(f"<|im_start|>{role}\n{body}" + ("" if is_open else "<|im_end|>\n"))
    if add_generation_prompt and not continue_final_message:
        out.append("<|im_start|>assistant\n")
    return "".join(out)
