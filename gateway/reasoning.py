"""Reasoning output in the field(s) the client expects: vLLM writes ``reasoning``, SGLang, llama.cpp and older
vLLM ``reasoning_content``; either is read, and what ``thinking.reasoning_fields`` names is written."""

from __future__ import annotations

from typing import Any

from config.settings import ReasoningFields

FIELDS = ("reasoning", "reasoning_content")


def reasoning_of(part: dict[str, Any]) -> str | None:
    """The reasoning text of one message or delta, whichever field the engine used."""
    for name in FIELDS:
        value = part.get(name)
        if isinstance(value, str):
            return value
    return None


def write_reasoning(part: dict[str, Any], text: str | None, fields: ReasoningFields) -> None:
    """Replace the reasoning fields of ``part`` (a message or delta dict of our own) with ``text``."""
    for name in FIELDS:
        part.pop(name, None)
    if text is None:
        return
    if fields is not ReasoningFields.REASONING_CONTENT:
        part["reasoning"] = text
    if fields is not ReasoningFields.REASONING:
        part["reasoning_content"] = text


def normalise(part: dict[str, Any], fields: ReasoningFields) -> dict[str, Any]:
    """A copy of ``part`` with its reasoning (if any) in the configured fields; ``part`` itself unchanged."""
    text = reasoning_of(part)
    if text is None:
        return part
    out = dict(part)
    write_reasoning(out, text, fields)
    return out
