"""OpenAI endpoints as pure ASGI apps: parse and validate what we own, key the conversation, hand to Proxy."""

from __future__ import annotations

from starlette.types import Receive, Scope, Send

from config.settings import RoutingConfig
from gateway.errors import GatewayError, MethodNotAllowed
from gateway.inbound import (
    ClientGone,
    header,
    parse_object,
    read_body,
    require_model,
    validate_chat,
    validate_completion,
)
from gateway.proxy import Outbound, Proxy, send_error
from routing.keys import chat_key, completion_key, session_key
from routing.policies import Policy
from routing.policies.least_loaded import LeastLoadedPolicy

_OWNED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})


class _Endpoint:
    """Read the body, validate, key, forward. Subclasses say how to validate and key."""

    path = ""

    def __init__(self, proxy: Proxy, routing: RoutingConfig, max_body: int) -> None:
        self.proxy = proxy
        self.routing = routing
        self.max_body = max_body
        self.session_header = routing.session_header.lower().encode("latin-1")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            raw = await read_body(scope, receive, self.max_body)
            out = self.outbound(scope, raw)
        except GatewayError as err:
            await send_error(send, err)
            return
        except ClientGone:
            return
        await self.proxy.forward(scope, receive, send, out, self.policy())

    def policy(self) -> Policy:
        return self.proxy.policy

    def outbound(self, scope: Scope, raw: bytes) -> Outbound:
        raise NotImplementedError

    def session(self, scope: Scope, model: str) -> str | None:
        sid = header(scope, self.session_header)
        return session_key(model, sid.decode("latin-1")) if sid else None


class ChatCompletions(_Endpoint):
    def outbound(self, scope: Scope, raw: bytes) -> Outbound:
        body = parse_object(raw)
        model = validate_chat(body)
        key = self.session(scope, model) or chat_key(body)
        return Outbound("POST", "/v1/chat/completions", raw, model, key)


class Completions(_Endpoint):
    def outbound(self, scope: Scope, raw: bytes) -> Outbound:
        body = parse_object(raw)
        model = validate_completion(body)
        key = self.session(scope, model) or completion_key(
            model, body["prompt"], self.routing.completion_key_chars
        )
        return Outbound("POST", "/v1/completions", raw, model, key)


class Passthrough(_Endpoint):
    """Any other /v1/* route (embeddings, responses, ...): the least loaded backend serving the model."""

    def __init__(self, proxy: Proxy, routing: RoutingConfig, max_body: int) -> None:
        super().__init__(proxy, routing, max_body)
        self._policy = LeastLoadedPolicy()

    def policy(self) -> Policy:
        return self._policy

    def outbound(self, scope: Scope, raw: bytes) -> Outbound:
        if scope["path"] in _OWNED_PATHS:  # routes we serve ourselves, reached with the wrong method
            raise MethodNotAllowed(f"{scope['method']} is not allowed on {scope['path']}")
        model: str | None = None
        if raw.strip():
            body = parse_object(raw)
            if "model" in body:
                model = require_model(body)
        # raw_path keeps the client's percent-encoding; "path" is decoded and may hold spaces.
        raw_path = scope.get("raw_path")
        path = raw_path.decode("latin-1") if raw_path else scope["path"]
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        return Outbound(scope["method"], path, raw, model, path)
