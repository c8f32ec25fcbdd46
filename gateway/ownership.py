"""Stored Responses state: which engine owns each response id, and requests that need it sent there only.

An engine keeps ``previous_response_id`` state in its own process (vLLM: a per-process dict, with
``VLLM_ENABLE_RESPONSES_API_STORE=1``). So:

- recording: the id of every stored answer on ``POST /v1/responses`` (a body's ``id``; a stream's
  ``response.created`` ``response.id``, its first event) goes into the affinity store (memory, or Redis
  shared by replicas) with the backend that produced it, for ``routing.response_owner_ttl_s``. The write is
  awaited *before the bytes holding the id are sent to the client*: no client can name an id before every
  replica can find its owner (a follow-up sent to another replica the instant the answer ended included).
  Requests with ``store: false`` are not recorded (nothing was stored: a follow-up naming them fails
  wherever it goes);
- routing: a ``POST /v1/responses`` with ``previous_response_id``, and ``GET``/``DELETE
  /v1/responses/{id}``, ``POST .../{id}/cancel``, ``GET .../{id}/input_items``, go to the owner only: every
  other backend is ineligible and the ``OwnerPolicy`` never retries elsewhere. An unknown id is a 404; an
  owner removed, down, cordoned or draining is a 409, one (re)starting a 503 with ``Retry-After``, each
  saying why and what to do (resend the full input without ``previous_response_id``).

One module, two hooks of the admission phase (gateway/phases.py): ``wrap`` (the recorder sits on the
client's ``send``, where the bytes the client gets go by) and ``enter`` (the owner looked up before routing).
"""

from __future__ import annotations

import logging
import re

from starlette.types import Message, Send

from backends.registry import Registry
from gateway.context import Release, RequestContext
from gateway.errors import (
    BadRequest,
    ResponseNotFound,
    ResponseOwnerGone,
    ResponseOwnerStarting,
    ServerBusy,
)
from gateway.shapes.responses import PATH, RESPONSE_ID, RESPONSES
from gateway.state import AffinityStore
from routing.policies.owner import OwnerPolicy
from routing.types import BackendState

log = logging.getLogger("warmroute.ownership")

#: The id is the response object's first field (OpenAI's API, vLLM's ResponsesResponse): found within the
#: first bytes of a body, or of a stream's first event. Not found in this many bytes: not recorded.
MAX_ID_SEARCH_BYTES = 64 * 1024
_BODY_ID = re.compile(rb'\A\s*\{\s*"id"\s*:\s*"([^"\\]{1,200})"')
_STREAM_ID = re.compile(rb'"response"\s*:\s*\{\s*"id"\s*:\s*"([^"\\]{1,200})"')
_STARTING = frozenset({BackendState.STARTING, BackendState.CANARY})
_RESEND = "resend the conversation's full input without previous_response_id"
OWNER_POLICY = OwnerPolicy()


class ResponseOwnership:
    """The admission module: ``wrap`` records ids, ``enter`` routes requests that name one."""

    def __init__(self, store: AffinityStore, registry: Registry) -> None:
        self.store = store
        self.registry = registry

    def wrap(self, ctx: RequestContext, send: Send) -> Send:
        body = ctx.body
        if ctx.shape is not RESPONSES or ctx.method != "POST" or ctx.owned_id is not None or body is None:
            return send
        if body.get("store") is False:
            return send
        return Recorder(ctx, send, self.store).send

    async def enter(self, ctx: RequestContext, send: Send) -> Release | None:
        rid, param = ctx.owned_id, "response_id"  # the id in the path
        if rid is None and ctx.shape is RESPONSES and ctx.body is not None:
            rid, param = ctx.body.get("previous_response_id"), "previous_response_id"
            ctx.owned_id = rid
        if rid is None:
            return None
        owner = await self.owner(rid, param)
        self.check(rid, owner, ctx.model, param)
        ctx.ineligible = frozenset(self.registry.backends) - {owner}
        ctx.policy = OWNER_POLICY
        return None

    async def owner(self, rid: str, param: str) -> str:
        owner = await self.store.owner(rid)
        if owner is not None:
            return owner
        if self.store.status().get("degraded"):
            raise ServerBusy(
                f"response {rid!r}: its owner cannot be looked up while the shared state store is "
                "unavailable; retry shortly, or " + _RESEND
            )
        raise ResponseNotFound(
            f"response {rid!r} is not known to this gateway (never made through it, or older than its "
            f"record's lifetime); {_RESEND}",
            param=param,
        )

    def check(self, rid: str, owner: str, model: str | None, param: str) -> None:
        """The owner can take the request now, or the error that says why not."""
        backend = self.registry.backends.get(owner)
        if backend is None:
            raise ResponseOwnerGone(
                f"response {rid!r} is held by backend {owner!r}, which has been removed: its stored state "
                f"went with it; {_RESEND}",
                param=param,
            )
        if model is not None and model not in backend.cfg.models:
            raise BadRequest(
                f"response {rid!r} is held by backend {owner!r}, which does not serve model {model!r}",
                param="model",
            )
        state = backend.routing_state
        if state is BackendState.READY:
            return
        if state in _STARTING:
            raise ResponseOwnerStarting(
                f"backend {owner!r}, which holds response {rid!r}, is starting ({state.value}); retry "
                f"shortly. If the engine restarted, its stored responses are gone: then {_RESEND}"
            )
        why = "its circuit is open" if backend.circuit_open else f"it is {state.value}"
        raise ResponseOwnerGone(
            f"backend {owner!r}, which holds response {rid!r}, takes no requests now ({why}); no other "
            f"engine has this response's state: {_RESEND}",
            param=param,
        )


class Recorder:
    """On the client's ``send``: finds the answer's response id and records its owner before the bytes that
    hold it go on. After that (or once it gives up) it only passes messages on."""

    __slots__ = ("_ctx", "_head", "_inner", "_pattern", "_store")

    def __init__(self, ctx: RequestContext, inner: Send, store: AffinityStore) -> None:
        self._ctx = ctx
        self._inner = inner
        self._store = store
        self._head = b""
        self._pattern: re.Pattern[bytes] | None = None  # set by the response head: None = not looking

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self._pattern = _pattern_for(message) if message["status"] == 200 else None
        elif self._pattern is not None and message["type"] == "http.response.body":
            await self._look(message.get("body", b""), message.get("more_body", False))
        await self._inner(message)

    async def _look(self, chunk: bytes, more: bool) -> None:
        assert self._pattern is not None
        self._head += chunk[: MAX_ID_SEARCH_BYTES - len(self._head)]
        found = self._pattern.search(self._head)
        if found is not None:
            rid = found.group(1).decode("latin-1")
            self._pattern, self._head = None, b""
            lease, attempt = self._ctx.lease, self._ctx.attempt
            if attempt is not None and attempt.translated is not None:
                return  # answered by a chat engine through the gateway's translation: stored nowhere
            if lease is not None and RESPONSE_ID.fullmatch(rid):
                await self._store.own(rid, lease.backend.id)
            return
        if not more or len(self._head) >= MAX_ID_SEARCH_BYTES:
            log.debug("no response id found in the answer to POST %s; not recorded", PATH)
            self._pattern, self._head = None, b""


def _pattern_for(head: Message) -> re.Pattern[bytes]:
    for name, value in head.get("headers", ()):
        if name == b"content-type":
            return _STREAM_ID if value.startswith(b"text/event-stream") else _BODY_ID
    return _BODY_ID
