"""Volatile prefixes: system text a client changes on every request, kept out of conversation keys.

Claude Code (2.1.36 and later) sends ``x-anthropic-billing-header: cc_version=…; cc_entrypoint=…;
cch=<nonce>;`` as its first system block, with a new nonce each request. A key hashed over it changes
every turn, and an engine that keeps it in the prompt misses its prefix cache from token 0.
``VolatileRules`` names such blocks by the prefix their text starts with; ``drop`` removes them from a list
of system blocks (an Anthropic ``system`` array, or a chat system message's content parts), ``drop_text``
from a plain system string.

Pure: no I/O, and nothing given is mutated (a new list or string is returned when something is removed, the
same object otherwise, so a caller can tell by identity).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

#: Claude Code's billing block (vLLM's Anthropic endpoint drops a block starting with this, too).
BILLING_PREFIX = "x-anthropic-billing-header:"
DEFAULT_PREFIXES = (BILLING_PREFIX,)
#: The roles whose content is a chat conversation's system text.
SYSTEM_ROLES = frozenset({"system", "developer"})


@dataclass(frozen=True, slots=True)
class VolatileRules:
    """Text blocks starting with one of ``prefixes`` are volatile. No prefixes: nothing ever is."""

    prefixes: tuple[str, ...] = DEFAULT_PREFIXES

    def __bool__(self) -> bool:
        return bool(self.prefixes)

    def matches(self, text: str) -> bool:
        return bool(self.prefixes) and text.startswith(self.prefixes)

    def may_hold(self, raw: bytes) -> bool:
        """Whether a JSON body's bytes may hold volatile text: a prefix as written (JSON-escaped, UTF-8), or
        any ``\\u`` escape (which could spell one). False means none can be there: the parsed body need not
        be walked (the common request pays two byte searches)."""
        if not self.prefixes:
            return False
        # A backslash first: one byte is a memchr; a two-byte search walks every byte of a long body.
        if raw.find(b"\\") >= 0 and raw.find(b"\\u") >= 0:
            return True
        found = False
        for prefix in _escaped(self.prefixes):  # not ``any()``: a generator per request
            found = found or prefix in raw
        return found

    def volatile_block(self, block: Any) -> bool:
        """A text block (``{"type": "text", "text": ...}``) whose text is volatile."""
        if not isinstance(block, dict) or block.get("type") != "text":
            return False
        text = block.get("text")
        return isinstance(text, str) and self.matches(text)

    def drop(self, blocks: list[Any]) -> list[Any]:
        """``blocks`` without its volatile text blocks (``blocks`` itself when it has none)."""
        if not self.prefixes or not any(self.volatile_block(b) for b in blocks):
            return blocks
        return [b for b in blocks if not self.volatile_block(b)]

    def drop_text(self, text: str) -> str:
        """A plain system string without a volatile first line (``text`` itself when it has none).

        A string is one block's worth of text: a volatile one loses its first line (the billing block is
        one line), or everything when it is a single line."""
        if not self.matches(text):
            return text
        _, newline, rest = text.partition("\n")
        return rest if newline else ""

    def drop_content(self, content: Any) -> Any:
        """A system message's content (a string or a list of parts) without its volatile text."""
        if isinstance(content, str):
            return self.drop_text(content)
        if isinstance(content, list):
            return self.drop(content)
        return content

    def without(self, prefixes: Sequence[str]) -> VolatileRules:
        """These rules less ``prefixes`` (what an engine drops itself need not be stripped for it)."""
        return rules_for(tuple(p for p in self.prefixes if p not in prefixes))

    def present(self, body: Mapping[str, Any]) -> bool:
        """Whether a request body holds volatile system text: in an Anthropic top-level ``system`` (a string
        or blocks), or in the leading system/developer messages of a chat ``messages`` list."""
        if not self.prefixes:
            return False
        system = body.get("system")
        if system is not None and self.drop_content(system) is not system:
            return True
        messages = body.get("messages")
        if isinstance(messages, list):
            for msg in messages:
                if not isinstance(msg, dict) or msg.get("role") not in SYSTEM_ROLES:
                    break
                content = msg.get("content")
                if self.drop_content(content) is not content:
                    return True
        return False


@lru_cache(maxsize=16)
def _escaped(prefixes: tuple[str, ...]) -> tuple[bytes, ...]:
    """Each prefix as it appears inside a JSON string (quotes and backslashes escaped), UTF-8."""
    return tuple(json.dumps(p, ensure_ascii=False)[1:-1].encode() for p in prefixes)


@lru_cache(maxsize=16)
def rules_for(prefixes: tuple[str, ...]) -> VolatileRules:
    """One ``VolatileRules`` per configured tuple of prefixes (a key function is called per request)."""
    return VolatileRules(prefixes)


NO_RULES = VolatileRules(())
