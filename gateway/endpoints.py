"""The endpoints as pure ASGI apps, one per API shape (gateway/shapes/): read and validate what the shape
owns, key the conversation, hand a ``RequestContext`` to the proxy."""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote

from starlette.types import Receive, Scope, Send

from config.settings import RoutingConfig
from gateway.auth import client_of
from gateway.budgets import BudgetPolicy
from gateway.context import RequestContext
from gateway.errors import BadRequest, GatewayError, MethodNotAllowed
from gateway.identity import HEAD, Identity, KeyingMetrics, SessionIdentity
from gateway.inbound import (
    MAX_JSON_VALUES,
    BodyBudget,
    Charge,
    ClientGone,
    first_values,
    parse_object,
    read_body,
)
from gateway.proxy import Proxy
from gateway.shapes.base import ApiShape, ErrorShape, ThinkingUse
from gateway.shapes.responses import check_response_id
from routing.policies import Policy
from routing.volatile import rules_for

# The members ``Endpoint.context`` compares per request as module constants: on Python 3.11 every
# ``ThinkingUse.X`` is a class attribute load through ``EnumType.__getattr__``'s slow hook (~0.25 us each).
_REFUSE, _RESOLVE, _EFFORT = ThinkingUse.REFUSE, ThinkingUse.RESOLVE, ThinkingUse.EFFORT

log = logging.getLogger("warmroute.endpoints")

#: Methods forwarded on other /v1 routes (the OpenAI API uses these; TRACE, PROPFIND... are refused).
FORWARDED_METHODS = frozenset({"GET", "HEAD", "POST", "DELETE"})
# After one percent-decoding: a dot segment, an (encoded) backslash, a control character, or what would
# still decode into one of those on an engine or front proxy that decodes again.
_UNSAFE = re.compile(r"(^|/)\.{1,2}(/|$)|\\|[\x00-\x1f\x7f]|%(2e|2f|5c|00)", re.IGNORECASE)
_FRAMING = re.compile(r"[\x00-\x20\x7f]")  # would split or corrupt the request line upstream


class Endpoint:
    """Read the body, build the context, forward: one per API shape, which it holds (``ctx.shape``)."""

    def __init__(
        self,
        shape: ApiShape,
        proxy: Proxy,
        routing: RoutingConfig,
        max_body: int,
        policy: Policy,
        budgets: BudgetPolicy | None = None,
        max_json_values: int = MAX_JSON_VALUES,
        body_budget: BodyBudget | None = None,
        *,
        identity: SessionIdentity | None = None,
        keying: KeyingMetrics | None = None,
    ) -> None:
        """``identity``: the session sources (default: read from ``routing``); ``keying``: where what keyed
        each conversation is counted (None: nowhere)."""
        self.shape = shape
        self.proxy = proxy
        self.budgets = budgets
        self.routing = routing
        self.max_body = max_body
        self.max_json_values = max_json_values
        self.body_budget = body_budget
        self.policy = policy
        self.identity = identity or SessionIdentity.from_config(routing)
        self.volatile = rules_for(routing.volatile_prefixes)
        self.keying = keying

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        charge = Charge(self.body_budget)  # held until the request ends: the raw body is forwarded
        try:
            try:
                first = first_values(scope["headers"])  # each header's first value, once per request
                raw = await read_body(first, receive, self.max_body, charge)
                ctx = self.context(scope, raw, first)
                self.record(ctx)
            except GatewayError as err:
                await self.proxy.reject(send, err, self.errors_for(scope))
                return
            except ClientGone:
                return
            except Exception as exc:  # a defect of ours: one log line with the trace, a shaped 500
                log.exception("unexpected error reading %s %s", scope["method"], scope["path"], exc_info=exc)
                internal = GatewayError("internal error in the gateway; see its log")
                await self.proxy.reject(send, internal, self.errors_for(scope))
                return
            await self.proxy.forward(receive, send, ctx)
        finally:
            charge.release()

    def errors_for(self, scope: Scope) -> ErrorShape:
        """The error shape a refusal of this request is answered in."""
        return self.shape.errors

    def context(self, scope: Scope, raw: bytes, first: Mapping[bytes, bytes]) -> RequestContext:
        """The shape's own fields validated, its conversation keyed (a session identity wins), its budget
        read. ``first``: each request header's first value (``gateway.inbound.first_values``)."""
        shape = self.shape
        body = parse_object(raw, self.max_json_values)
        model = shape.validate(body)
        if shape.thinking is _REFUSE and self.budgets is not None:
            self.budgets.refuse(body, first, shape.name, shape.path)
        key = shape.path
        identity: Identity | None = None
        if shape.key is not None:
            named = self.identity.identify(first, body, model)
            if named is None:
                key = shape.key(body, model, self.routing)
            else:
                key, identity = named
        ctx = self.make(scope, first, shape.path, raw, body, model, key)
        ctx.identity = identity
        if shape.thinking is _RESOLVE and self.budgets is not None:
            if shape.thinking_ask is not None:  # the shape's own fields (validated by ``shape.validate``)
                ctx.thinking = self.budgets.decide(shape.thinking_ask(body), model)
            else:
                ctx.thinking = self.budgets.resolve(body, first, model)  # a bad value: a 400
        elif shape.thinking is _EFFORT and self.budgets is not None:
            self.budgets.refuse_budget(body, first, shape.path, shape.effort_path)
            ctx.thinking = self.budgets.resolve_effort(body, shape.effort_path, first, model)
        return ctx

    def record(self, ctx: RequestContext) -> None:
        """Count what keyed a conversation (a session source, or its head, volatile text left out)."""
        if self.keying is None or self.shape.key is None:
            return
        identity = ctx.identity
        if identity is not None:
            self.keying.session_keyed(identity.source, identity.subagent)
            return
        self.keying.session_keyed(HEAD, False)
        if ctx.body is None:
            return
        possible = self.volatile.may_hold(ctx.raw)
        ctx.volatile_checked = (self.volatile, possible)
        if possible and self.volatile.present(ctx.body):
            self.keying.volatile_normalised("key")

    def make(
        self,
        scope: Scope,
        first: Mapping[bytes, bytes],
        path: str,
        raw: bytes,
        body: dict[str, Any] | None,
        model: str | None,
        key: str,
    ) -> RequestContext:
        ctx = RequestContext(
            scope["method"], path, raw, body, model, key, self.policy, scope["headers"], first, self.shape
        )
        ctx.client = client_of(scope)  # the client key's configured name (gateway/auth.py), if keys are on
        peer = scope.get("client")
        ctx.peer = None if not peer else str(peer[0])
        return ctx


class Passthrough(Endpoint):
    """Any other /v1/* route (embeddings, responses, files, ...): the least loaded backend serving the model.

    The body is forwarded untouched (``body`` stays None: prepare steps leave these routes alone); only its
    ``model`` is read, to pick a backend that serves it. ``owned``: the paths other endpoints serve, with
    their error shapes (a wrong method there is a 405 in that route's shape, never a forward).
    """

    def __init__(self, owned: Mapping[str, ErrorShape], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.owned = dict(owned)

    def errors_for(self, scope: Scope) -> ErrorShape:
        return self.owned.get(scope["path"].rstrip("/"), self.shape.errors)

    def context(self, scope: Scope, raw: bytes, first: Mapping[bytes, bytes]) -> RequestContext:
        method = scope["method"]
        if scope["path"].rstrip("/") in self.owned:  # routes we serve ourselves, with the wrong method
            raise MethodNotAllowed(f"{method} is not allowed on {scope['path']}")
        if method not in FORWARDED_METHODS:
            raise MethodNotAllowed(
                f"{method} is not forwarded; use one of {', '.join(sorted(FORWARDED_METHODS))}"
            )
        path = upstream_path(scope)
        model: str | None = None
        if raw.strip():
            body = parse_object(raw, self.max_json_values)
            if "model" in body:
                model = self.shape.validate(body)
        return self.make(scope, first, path, raw, None, model, path)


class StoredResponse(Endpoint):
    """``GET``/``DELETE /v1/responses/{id}``, ``POST .../{id}/cancel``, ``GET .../{id}/input_items``: to the
    engine that owns the id (gateway/ownership.py), with the client's path, query and body as they are.

    Mounted for every method: another method on these paths is a 405 here, never a forward elsewhere."""

    def __init__(self, methods: frozenset[str], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.methods = methods

    def context(self, scope: Scope, raw: bytes, first: Mapping[bytes, bytes]) -> RequestContext:
        if scope["method"] not in self.methods:
            raise MethodNotAllowed(
                f"{scope['method']} is not allowed on {scope['path']}; use {', '.join(sorted(self.methods))}"
            )
        rid = check_response_id(scope.get("path_params", {}).get("response_id"), "response_id")
        path = upstream_path(scope)
        ctx = self.make(scope, first, path, raw, None, None, path)
        ctx.owned_id = rid
        return ctx


def upstream_path(scope: Scope) -> str:
    """The client's /v1 path and query as they go upstream, or BadRequest if it could escape /v1.

    ``raw_path`` keeps the client's percent-encoding ("path" is decoded and may hold spaces); the checks run
    on its decoded form, so ``%2e%2e`` is refused like ``..``.
    """
    raw_path: bytes | None = scope.get("raw_path")
    path: str = raw_path.decode("latin-1") if raw_path else scope["path"]
    decoded = unquote(path, encoding="latin-1")
    if not decoded.startswith("/v1/") or "//" in decoded or _UNSAFE.search(decoded) or "%2f" in path.lower():
        raise BadRequest(
            "request path must stay under /v1/ without dot segments, empty segments, backslashes, "
            "encoded slashes or control characters",
            param="path",
        )
    query = scope.get("query_string")
    if query:
        text = query.decode("latin-1")
        if _FRAMING.search(text):
            raise BadRequest("query string holds spaces or control characters", param="query")
        path += "?" + text
    return path
