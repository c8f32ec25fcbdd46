"""One request as it travels from the endpoint to the relay, and one attempt of it on one backend.

The endpoint fills in what it parsed (body, model, conversation key, policy) and its API shape; the proxy's
phases fill in the rest (decision, lease, upstream response, outcome). Shaping never mutates ``ctx.body``:
each attempt starts a ``Draft`` of the original, so a retry on an engine of another dialect starts from what
the client sent, and what a module decides for one attempt (the gateway enforces this budget here) is
written on that attempt.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from backends.registry import Backend, Lease
from gateway.identity import Identity
from gateway.images import VisionMemo
from gateway.observe import ResponseTap, RouteInfo, Usage
from gateway.outcomes import RequestOutcome
from gateway.shapes.base import ApiShape
from gateway.thinking import Thinking
from gateway.transport import TransportResponse
from routing.policies import Policy
from routing.types import Reason
from routing.volatile import VolatileRules


class Release(Protocol):
    def release(self) -> None: ...


@dataclass(slots=True)
class RequestContext:
    # -- from the endpoint ----------------------------------------------------------------------------
    method: str
    path: str  # upstream path, query included
    raw: bytes  # the client's body, forwarded as is unless a prepare step changes it
    body: dict[str, Any] | None  # parsed JSON object (None: no body, or not ours to read)
    model: str | None
    key: str  # conversation key as the endpoint computed it (or the path, for routes without conversations)
    policy: Policy
    headers: Sequence[tuple[bytes, bytes]]  # the client's request headers (lower-case names), as sent
    #: Each header's first value by name (``gateway.inbound.first_values(headers)``), built once: what the
    #: request path reads a header from.
    first: Mapping[bytes, bytes]
    shape: ApiShape  # the API shape of its route: what the phases read of its body and of its answers
    started_at: float = field(default_factory=time.monotonic)
    thinking: Thinking | None = None  # the validated thinking budget (gateway/budgets.py), if any
    identity: Identity | None = None  # the session source that keyed it (gateway/identity.py); None: its head
    client: str | None = None  # name of the client key that authenticated it (gateway/auth.py), if any
    peer: str | None = None  # the connection's remote address (host only), if the server told
    vision: VisionMemo | None = None  # the request's images and their encodings (gateway/vision.py)
    #: The stored /v1/responses id this request needs (its ``previous_response_id``, or the id in its
    #: path): only the engine that owns it can answer (gateway/ownership.py).
    owned_id: str | None = None
    # -- routing inputs, set by the modules' route hooks before routing ---------------------------------
    ineligible: frozenset[str] = frozenset()  # backends that cannot serve this request (``RouteFilter``)
    route_key: str | None = None  # the key routing pins, when a ``RouteInputs`` refines ``key``
    #: ``rules.may_hold(raw)`` once asked (the keying metric and the strip step ask the same rules).
    volatile_checked: tuple[VolatileRules, bool] | None = None
    # -- filled in by the proxy's phases --------------------------------------------------------------
    task: asyncio.Task[None] | None = None
    reason: Reason = Reason.NO_BACKEND
    pinned: str | None = None  # the conversation's pin after the routing phase
    lease: Lease | None = None  # the attempt in progress holds one (released before a retry)
    seats: tuple[Release, ...] = ()  # the attempt's room on its backend (gateway/admission.py)
    attempt: Attempt | None = None  # the attempt in progress (the one answered, once the relay runs)
    upstream: TransportResponse | None = None  # closed in ``finish``: that is what cancels the engine's work
    outcome: RequestOutcome = RequestOutcome.UPSTREAM_ERROR
    first_byte_at: float | None = None
    tap: ResponseTap | None = None  # what the relay saw, for the observers (gateway/observe.py)
    route: RouteInfo | None = None  # the ttft policy's plan of this request (gateway/learning.py)
    responded: bool = False  # the response head went to the client
    client_gone: bool = False
    finishing: bool = False  # the last body message is being sent: a disconnect now is normal

    def remaining(self, request_s: float) -> float:
        """Seconds left of the whole-request budget ``request_s`` (negative once it is spent)."""
        return request_s - (time.monotonic() - self.started_at)

    @property
    def requester(self) -> str:
        """Who sent it, to tell clients apart (a breaker counts 5xx answers per client: gateway/blame.py):
        the client key's name, else the peer's address; one shared "unknown" when neither is known."""
        if self.client is not None:
            return f"key:{self.client}"
        return "unknown" if self.peer is None else f"peer:{self.peer}"

    @property
    def backend(self) -> Backend | None:
        return None if self.lease is None else self.lease.backend

    @property
    def affinity_key(self) -> str:
        """The key routing pins and the store counts: ``route_key`` when a module refined it, else ``key``."""
        return self.key if self.route_key is None else self.route_key


@dataclass(slots=True)
class Attempt:
    """One try of the request on one backend: what was sent, and what the modules decided for it."""

    backend: Backend
    draft: Draft
    #: Where this attempt goes upstream: the request's own path, unless a prepare step sends it elsewhere
    #: (a shape the backend lacks is translated to chat: gateway/translation.py).
    path: str = ""
    #: The client shape this attempt's body was translated from (its name), None when sent as is: the
    #: engine answers in chat, and the translation's body filter gives the client its own shape back.
    translated: str | None = None
    #: The answer's usage when a body filter put it together (a stitched follow-up), for the observers:
    #: what the relayed bytes say otherwise (gateway/observe.py).
    usage: Usage | None = None
    #: A body filter ended this exchange before the engine did (admission paused the stream): the relay
    #: stops reading it, and the filter's follow-up goes on with the answer.
    cut: bool = False


class Draft:
    """The outbound body of one attempt: the original until a step asks to change it.

    ``edit()`` returns a shallow copy of the top-level object, made once per attempt: a step replaces the
    values it changes (top-level fields, or a rebuilt ``messages`` list) and never mutates nested objects of
    the original, which the next attempt reuses.
    """

    __slots__ = ("_copy", "_original", "enforced", "phase1_source")

    def __init__(self, original: dict[str, Any] | None) -> None:
        self._original = original
        self._copy: dict[str, Any] | None = None
        #: The thinking budget this attempt's engine cannot cap, so the gateway does (gateway/continuation).
        self.enforced: Thinking | None = None
        #: With ``enforced`` on an attempt translated to chat: its chat body before phase 1 was shaped, which
        #: phase 2 continues (the client's own body is not chat). None: phase 2 continues the client's body.
        self.phase1_source: dict[str, Any] | None = None

    def read(self) -> dict[str, Any] | None:
        return self._original if self._copy is None else self._copy

    def edit(self) -> dict[str, Any]:
        if self._original is None:
            raise ValueError("this request has no JSON body to shape")
        if self._copy is None:
            self._copy = dict(self._original)
        return self._copy

    @property
    def changed(self) -> bool:
        return self._copy is not None

    def payload(self, raw: bytes) -> bytes:
        """What goes upstream: the client's own bytes if nothing changed, else the shaped body, serialised
        deterministically (same body, same bytes: engines' prefix caches key on the prompt they render)."""
        if self._copy is None:
            return raw
        return canonical_json(self._copy)


def canonical_json(body: Any) -> bytes:
    """``body`` as compact JSON, UTF-8. A lone surrogate (valid JSON as an escape, not encodable as UTF-8)
    keeps its escape: the whole body is then written ASCII-escaped, still the same bytes for the same body."""
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    try:
        return text.encode()
    except UnicodeEncodeError:
        return json.dumps(body, separators=(",", ":")).encode()
