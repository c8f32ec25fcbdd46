"""The request path's named phases, and the hooks a feature module implements to take part in them.

A feature is a module: an object implementing the hooks it needs, each a small Protocol below. The app builds
ONE ordered tuple of modules and hands it to the ``Proxy``; ``Phases.of`` sorts it into one tuple per phase,
once, at construction (nothing on the hot path asks a module what it implements). In request order:

- admission (``Admission``): before routing; a request for an on-demand engine waits (gateway/waiting.py);
- route filter (``RouteFilter``): backends the request cannot use at all (gateway/vision.py);
- route inputs (``RouteInputs``): the routing policy's candidates and request, and the key it pins under
  (``ctx.route_key``; the endpoint's ``ctx.key`` is never rewritten) (gateway/learning.py);
- backend admission (``BackendAdmission``): after routing, per attempt: the request waits for room on the
  backend chosen (gateway/admission.py);
- upstream request filter (``PrepareStep``): per attempt, shapes that attempt's ``Draft`` and writes what it
  decided on the attempt, never on the inbound request (gateway/budgets.py, gateway/vision.py, the engine
  priority of gateway/admission.py);
- response and body filter (``BodyFilters``): per attempt, a ``BodyFilter`` fed the response's events (or its
  body), in module order: the output guard, reasoning fields, continuation stitching (gateway/relay.py runs
  them); a filter may ask for a follow-up exchange on the same lease (the gateway-enforced thinking budget);
- logging (``Observer``): once the request is finished, what it looked like (metrics, learning).

Module order is the order of the tuple: one list, no prepend-or-append.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from starlette.types import Send

from backends.registry import Backend, Lease
from gateway.context import Attempt, Draft, Release, RequestContext
from gateway.observe import Observation
from gateway.sse import Piece, Pieces
from routing.types import Decision, RouteRequest


@runtime_checkable
class Admission(Protocol):
    """Before routing: ``wrap`` the client's ``send`` (a waiting stream may answer its head early), then
    ``enter``: wait until the request may be routed; the returned claim is released when it is finished."""

    def wrap(self, ctx: RequestContext, send: Send) -> Send: ...

    async def enter(self, ctx: RequestContext, send: Send) -> Release | None: ...


@runtime_checkable
class BackendAdmission(Protocol):
    """After routing, before each attempt: wait until ``backend`` may take the request (``send`` is the one
    ``Admission.wrap`` made); the seat returned is released when the attempt is abandoned or the request is
    finished. Raise a ``GatewayError`` to refuse it (answered as is, no retry)."""

    async def seat(self, ctx: RequestContext, backend: str, send: Send) -> Release: ...


@runtime_checkable
class RouteFilter(Protocol):
    """Names the backends that cannot serve a request at all (a text-only engine for an image request...).

    Asked once per request before routing; routing then sees those backends as absent, so a pin on one moves
    and a retry never lands there. Raise a ``GatewayError`` when no backend could ever serve it (a 400).
    """

    def ineligible(self, ctx: RequestContext) -> frozenset[str]: ...


@runtime_checkable
class RouteInputs(Protocol):
    """The routing policy's inputs for a request, and what it learns from one being sent (one per proxy)."""

    def plan(self, ctx: RequestContext) -> None: ...

    def conversations(self) -> Mapping[str, int]:
        """Active conversations per backend, the candidates' load term under this policy."""
        ...

    def request(self, ctx: RequestContext, pinned: str | None, exclude: frozenset[str]) -> RouteRequest: ...

    def settle(self, ctx: RequestContext, pinned: str | None, decision: Decision) -> Decision: ...

    def sent(self, ctx: RequestContext, lease: Lease, uncached_tokens: int) -> None: ...


@runtime_checkable
class PrepareStep(Protocol):
    """Shapes one attempt for the backend chosen (thinking budget per dialect, images to embeddings, ...).

    Runs after routing, once per attempt, in module order. Raise a ``GatewayError`` to refuse the request
    for this backend (it is answered as is; no retry).
    """

    async def prepare(self, ctx: RequestContext, backend: Backend, draft: Draft) -> None: ...


class BodyFilter(Protocol):
    """One attempt's view of its response body (``BodyFilterBase`` has the do-nothing default of each).

    ``events``: the SSE pieces of one read of a stream (one splitter per response feeds them), returned as
    they should go on (changed, dropped, or as they came): a ``Whole`` read (gateway/sse.py) is not a list;
    take its ``raw`` bytes, or its ``events()``, and return it unchanged or a new list; ``body``: a
    non-streamed body (whole when any filter ``holds`` it, else each chunk). A ``GatewayError`` raised here
    ends the answer with it (the engine answered: no failure of its health). ``follow_up``: after the engine's
    body ended, the body of a second exchange on the same lease, or None; ``before_follow_up`` is awaited once
    the ended exchange is closed and before the follow-up is sent (a paused stream waits for its seat again);
    ``continued`` tells every filter one starts. A filter that sets ``attempt.cut`` ends the exchange after
    the read it is given.
    ``end``: pieces to send after the last one; ``close``: the attempt's relay is over, however it ended.
    """

    holds: bool  # a non-streamed body is read whole (bounded) before it is given to ``body``
    rewrites: bool  # it may change what is sent (else the engine's reads go on as they came)
    # Whether it has its own ``follow_up``, ``continued``, ``end``, ``close``: the relay calls only those
    # (``BodyFilterBase`` sets them per class; most filters have none of the four).
    own_follow_up: bool
    own_continued: bool
    own_end: bool
    own_close: bool

    def events(self, pieces: Pieces) -> Pieces: ...

    def body(self, data: bytes) -> bytes: ...

    def follow_up(self) -> dict[str, Any] | None: ...

    async def before_follow_up(self) -> None: ...

    def continued(self) -> None: ...

    def end(self) -> list[Piece]: ...

    def close(self) -> None: ...


_OPTIONAL_HOOKS = ("follow_up", "continued", "end", "close")


class BodyFilterBase:
    """Each hook's do-nothing default: a filter overrides what it needs (``own_*`` say which it did)."""

    holds = False
    rewrites = False
    own_follow_up = own_continued = own_end = own_close = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for hook in _OPTIONAL_HOOKS:
            setattr(cls, f"own_{hook}", getattr(cls, hook) is not getattr(BodyFilterBase, hook))

    def events(self, pieces: Pieces) -> Pieces:
        return pieces

    def body(self, data: bytes) -> bytes:
        return data

    def follow_up(self) -> dict[str, Any] | None:
        return None

    async def before_follow_up(self) -> None:
        return None

    def continued(self) -> None:
        return None

    def end(self) -> list[Piece]:
        return []

    def close(self) -> None:
        return None


@runtime_checkable
class BodyFilters(Protocol):
    """The response filter: given an attempt's response head, its ``BodyFilter`` (None: not interested)."""

    def body_filter(
        self, ctx: RequestContext, attempt: Attempt, status: int, sse: bool
    ) -> BodyFilter | None: ...


@runtime_checkable
class Observer(Protocol):
    """Logging: told what each request that reached a backend looked like, once it is finished. Synchronous,
    no I/O (it runs in the request's ``finally``)."""

    def observe(self, obs: Observation) -> None: ...


@dataclass(frozen=True, slots=True)
class Phases:
    """The modules sorted by phase, in their order; built once per proxy."""

    admission: tuple[Admission, ...] = ()
    seating: tuple[BackendAdmission, ...] = ()
    route_filters: tuple[RouteFilter, ...] = ()
    route_inputs: RouteInputs | None = None
    prepare: tuple[PrepareStep, ...] = ()
    body_filters: tuple[BodyFilters, ...] = ()
    observers: tuple[Observer, ...] = ()

    @classmethod
    def of(cls, modules: Sequence[object]) -> Phases:
        inputs = [m for m in modules if isinstance(m, RouteInputs)]
        if len(inputs) > 1:
            raise ValueError(f"one module may give the routing inputs, got {len(inputs)}")
        return cls(
            admission=tuple(m for m in modules if isinstance(m, Admission)),
            seating=tuple(m for m in modules if isinstance(m, BackendAdmission)),
            route_filters=tuple(m for m in modules if isinstance(m, RouteFilter)),
            route_inputs=inputs[0] if inputs else None,
            prepare=tuple(m for m in modules if isinstance(m, PrepareStep)),
            body_filters=tuple(m for m in modules if isinstance(m, BodyFilters)),
            observers=tuple(m for m in modules if isinstance(m, Observer)),
        )
