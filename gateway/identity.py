"""Session identity: which conversation a request belongs to, when its client says so.

Coding agents name their sessions (Claude Code ``x-claude-code-session-id`` and ``metadata.user_id``, Codex
``session_id`` and ``prompt_cache_key``, OpenCode ``x-session-affinity``). Many sessions of one agent share
an identical head (system prompt, tools, often the first instruction), so only such a name tells them apart
on their first turn. ``SessionIdentity`` reads the configured sources in order (``routing.session_sources``,
parsed by ``routing.sessions``); the first one present keys the conversation instead of its head, and a
subagent's own id (``routing.subagent_header``) splits it from its session.

A value is bounded and free of control characters, else the request is a 400 naming the source. Values are
never logged at INFO and never metric labels: what is recorded (``Identity``) is the source's configured
spelling.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from config.settings import RoutingConfig
from gateway.errors import BadRequest
from routing.keys import session_key, subagent_key
from routing.sessions import (
    SessionSource,
    SourceKind,
    body_value,
    parse_sources,
    problem,
    user_id_session,
)

log = logging.getLogger("warmroute.identity")

#: The ``source`` label of a conversation keyed by its head (no identity found).
HEAD = "head"


@dataclass(frozen=True, slots=True)
class Identity:
    """What keyed a request's conversation: a source's configured spelling, and whether a subagent id split
    it from its session. Never the value itself."""

    source: str
    subagent: bool = False


class KeyingMetrics(Protocol):
    """The counters an endpoint records what keyed each conversation in (gateway/metrics.py)."""

    def session_keyed(self, source: str, subagent: bool) -> None: ...

    def volatile_normalised(self, where: str) -> None: ...


class SessionIdentity:
    """The configured sources, in order; ``identify`` is called once per request with a conversation."""

    __slots__ = ("_roots", "agent_header", "agent_label", "body_roots", "names", "sources")

    def __init__(self, sources: Sequence[SessionSource], subagent_header: str | None = None) -> None:
        self.sources = tuple(sources)
        name = None if subagent_header is None else subagent_header.lower()
        self.agent_header = None if name is None else name.encode("latin-1")
        self.agent_label = f"header:{name}"
        #: Every header name read: one pass over a request's headers finds them all.
        wanted = [s.header for s in self.sources if s.kind is SourceKind.HEADER]
        self.names = frozenset(wanted + ([self.agent_header] if self.agent_header else []))
        #: The top-level body fields a body source starts at.
        self.body_roots = tuple(
            dict.fromkeys(s.path[0] for s in self.sources if s.kind is not SourceKind.HEADER)
        )
        self._roots = frozenset(self.body_roots)

    @classmethod
    def from_config(cls, routing: RoutingConfig) -> SessionIdentity:
        sources = parse_sources(routing.session_sources, routing.session_header)
        return cls(sources, routing.subagent_header)

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(s.label for s in self.sources)

    def identify(
        self, headers: Mapping[bytes, bytes], body: Mapping[str, Any] | None, model: str
    ) -> tuple[str, Identity] | None:
        """The session key and what keyed it, from the first source present; None: key by the head.
        ``headers``: each request header's first value (``gateway.inbound.first_values``).

        Raises ``BadRequest`` (naming the source) for a value that is too long or holds control characters.
        """
        if self.names.isdisjoint(headers) and (body is None or self._roots.isdisjoint(body)):
            return None  # the common request: no source can be present (one set lookup per name sent)
        for source in self.sources:
            value = self._value(source, headers, body)
            if not value:
                continue
            _check(value, source.label)
            key = session_key(model, value, None if source.legacy else source.label)
            agent = self._agent(headers)
            if agent is None:
                return key, Identity(source.label)
            return subagent_key(key, agent), Identity(source.label, subagent=True)
        return None

    def _value(
        self, source: SessionSource, found: Mapping[bytes, bytes], body: Mapping[str, Any] | None
    ) -> str | None:
        if source.kind is SourceKind.HEADER:
            raw = found.get(source.header)
            return None if raw is None else bytes(raw).decode("latin-1")
        if body is None:
            return None
        value = body_value(body, source.path)
        if not isinstance(value, str):
            return None  # absent, or not ours to judge: the engine gets the field as sent
        return user_id_session(value) if source.kind is SourceKind.BODY_SESSION else value

    def _agent(self, found: Mapping[bytes, bytes]) -> str | None:
        raw = None if self.agent_header is None else found.get(self.agent_header)
        if not raw:
            return None
        agent = bytes(raw).decode("latin-1")
        _check(agent, self.agent_label)
        return agent


def _check(value: str, label: str) -> None:
    why = problem(value)
    if why is not None:
        err = BadRequest(f"session identity from {label} {why}", param=label)
        log.info("rejected a request: %s", err.message)  # the value itself is never logged
        raise err
