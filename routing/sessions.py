"""Session identity sources: where a client names its session, and what a named session's value may be.

A source is spelled as configured (``routing.session_sources``): ``header:NAME``, ``body:PATH`` (a dotted
path to a string field), ``body-session:PATH`` (the session part of a Claude Code user id at PATH), or
``session_header`` (``header:`` + ``routing.session_header``, the one source whose keys predate the others).
The spelling is the source's ``label``: bounded (it comes from configuration), so it may be a metric label;
a value never is.

Pure: parsing and checking only; the gateway reads headers and bodies (gateway/identity.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

#: Longest identity value accepted (a UUID is 36; Claude Code's user id about 160).
MAX_VALUE_CHARS = 256
#: A JSON-encoded user id longer than this is not parsed (it holds no session, and parsing is not free).
MAX_JSON_USER_ID = 4096
#: What an identity value must not hold: C0 and C1 controls, DEL, lone surrogates (no UTF-8 encoding).
_FORBIDDEN = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_SESSION_PART = "_session_"
LEGACY = "session_header"


class SourceKind(StrEnum):
    HEADER = "header"
    BODY = "body"
    BODY_SESSION = "body-session"  # the session part of a user id


@dataclass(frozen=True, slots=True)
class SessionSource:
    kind: SourceKind
    name: str  # a lower-case header name, or a dotted body path
    label: str  # the spelling: metric label and error parameter
    legacy: bool = False  # routing.session_header: hashed as before (``routing.keys.session_key``)
    # Derived once (read per request): the body path's segments, the header name as it arrives.
    path: tuple[str, ...] = field(init=False, compare=False, repr=False)
    header: bytes = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", tuple(self.name.split(".")))
        object.__setattr__(self, "header", self.name.encode("latin-1"))


def parse_source(spec: str, session_header: str) -> SessionSource:
    """One configured spelling as a source (``ValueError`` for an unknown one)."""
    if spec == LEGACY:
        name = session_header.lower()
        return SessionSource(SourceKind.HEADER, name, f"header:{name}", legacy=True)
    kind, sep, name = spec.partition(":")
    try:
        source_kind = SourceKind(kind)
    except ValueError:
        raise ValueError(f"unknown session source {spec!r}") from None
    if not sep or not name:
        raise ValueError(f"session source {spec!r} names nothing")
    if source_kind is SourceKind.HEADER:
        name = name.lower()
        return SessionSource(source_kind, name, f"header:{name}")
    if any(not part for part in name.split(".")):
        raise ValueError(f"session source {spec!r} has an empty path segment")
    return SessionSource(source_kind, name, spec)


def parse_sources(specs: Iterable[str], session_header: str) -> tuple[SessionSource, ...]:
    """The configured sources in order; a source named twice (e.g. ``session_header`` set to a header
    listed before it) counts where it comes first."""
    seen: dict[tuple[SourceKind, str], SessionSource] = {}
    for spec in specs:
        source = parse_source(spec, session_header)
        seen.setdefault((source.kind, source.name), source)
    return tuple(seen.values())


def body_value(body: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    """The value at ``path`` in nested objects, or None where the path leads nowhere."""
    value: Any = body
    for part in path:
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def user_id_session(user_id: str) -> str | None:
    """The session part of a Claude Code ``metadata.user_id``, or None when it names none.

    Two forms are known: ``user_<hash>_account_<uuid>_session_<uuid>``, and (newer builds) a JSON object
    in a string with a ``session_id`` field. Anything else names a user, not a session: None, never an
    error (the engine gets the field as sent).
    """
    text = user_id.strip()
    if text.startswith("{"):
        if len(text) > MAX_JSON_USER_ID:
            return None
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError):
            return None
        session = doc.get("session_id") if isinstance(doc, dict) else None
        return session if isinstance(session, str) and session else None
    _, sep, session = text.rpartition(_SESSION_PART)
    return session if sep and session else None


def problem(value: str) -> str | None:
    """Why ``value`` cannot be an identity (too long, control characters), or None if it can."""
    if len(value) > MAX_VALUE_CHARS:
        return f"is longer than {MAX_VALUE_CHARS} characters"
    found = _FORBIDDEN.search(value)
    if found is not None:
        return f"holds \\u{ord(found.group()):04x} (no control characters or lone surrogates)"
    return None
