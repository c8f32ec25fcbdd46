"""Who may call what: one ASGI wrapper in front of the whole app.

- ``/admin`` and everything under it (the JSON API, the status page, whatever is mounted there later)
  needs ``Authorization: Bearer <admin token>``, compared in constant time. With no token configured the
  admin plane is served only when its listener is bound to loopback; bound anywhere else it answers 403
  and says why (never silently open on 0.0.0.0). With ``admin.port`` set, /admin is served on that port
  only, and that port serves nothing else.
- ``/v1/*`` needs a client key when ``auth.client_keys`` are configured: a missing or unknown key is a 401
  in OpenAI's error shape. The key's configured name goes into ``scope["state"]`` (the endpoint puts it on
  the ``RequestContext``) and into ``warmroute_client_requests_total{client}``. Names come from config
  only, never from the request.

The listener address is what the settings say (``admin.host``/``server.host``; ``warmroute serve --host``
exports its override into the environment, so every worker reads the same), not the connection's local
address: a socket bound to 0.0.0.0 reports 127.0.0.1 to a local client.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from config.settings import Settings
from gateway.errors import GatewayError, NotFound

log = logging.getLogger("warmroute.auth")

ADMIN_PREFIX = "/admin"
CLIENT_STATE = "warmroute_client"  # key in scope["state"]: the client key's configured name


class Unauthorized(GatewayError):
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class Forbidden(GatewayError):
    status = 403
    type = "invalid_request_error"
    code = "admin_disabled"


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def is_admin_path(path: str) -> bool:
    return path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")


def bearer(scope: Scope) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header, or None."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = bytes(value).partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def client_of(scope: Scope) -> str | None:
    """The name of the client key that authenticated this request (None: client keys are off)."""
    state: dict[str, Any] | None = scope.get("state")
    return None if state is None else state.get(CLIENT_STATE)


@dataclass(frozen=True, slots=True)
class AdminAccess:
    """How /admin is protected, decided once from the settings."""

    token: bytes | None
    host: str
    port: int | None  # the separate admin port, if any

    @classmethod
    def from_settings(cls, settings: Settings) -> AdminAccess:
        token = settings.admin.secret()
        host = settings.admin.host or settings.server.host
        return cls(None if token is None else token.encode(), host, settings.admin.port)

    @property
    def open_on_loopback(self) -> bool:
        return self.token is None and is_loopback(self.host)

    def describe(self) -> str:
        where = f"{self.host}:{self.port}" if self.port else f"{self.host} (the API port)"
        if self.token is not None:
            return f"admin API on {where}: bearer token required"
        if self.open_on_loopback:
            return f"admin API on {where}: no admin token configured; served because the listener is loopback"
        return (
            f"admin API DISABLED: no admin token configured and the admin listener {where} is not loopback; "
            "/admin answers 403 until admin.token (WARMROUTE_ADMIN__TOKEN) is set"
        )

    def check(self, scope: Scope) -> GatewayError | None:
        if self.token is None:
            if self.open_on_loopback:
                return None
            return Forbidden(
                f"the admin API is disabled: no admin token is configured and the admin listener is bound "
                f"to {self.host}, which is not loopback; set admin.token (WARMROUTE_ADMIN__TOKEN)"
            )
        given = bearer(scope)
        if given is None:
            return Unauthorized("admin endpoints need Authorization: Bearer <admin token>")
        if not hmac.compare_digest(given, self.token):
            return Unauthorized("the admin token is not valid")
        return None


class ClientKeys:
    """Configured client keys: token -> name. Lookup compares against every key (constant time each)."""

    def __init__(self, keys: dict[str, str]) -> None:
        self._keys = [(k.encode(), name) for k, name in keys.items()]

    def __bool__(self) -> bool:
        return bool(self._keys)

    @property
    def names(self) -> list[str]:
        return [name for _, name in self._keys]

    def identify(self, token: bytes) -> str | None:
        found = None
        for key, name in self._keys:  # no early exit: the time taken does not say which key matched
            if hmac.compare_digest(token, key):
                found = name
        return found


class AccessGuard:
    """The outermost ASGI app: admin auth for ``/admin``, client keys for ``/v1``, the admin-port split."""

    def __init__(self, app: ASGIApp, admin: AdminAccess, clients: ClientKeys, counts: dict[str, int]) -> None:
        self.app = app
        self.admin = admin
        self.clients = clients
        self.counts = counts  # warmroute_client_requests_total, by configured name
        for name in clients.names:
            counts.setdefault(name, 0)

    def __getattr__(self, name: str) -> Any:  # ``app.state`` and friends of the wrapped app
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self._check(scope)
        if error is not None:
            await reject(send, error)
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> GatewayError | None:
        path: str = scope["path"]
        admin = is_admin_path(path)
        if self.admin.port is not None:
            server = scope.get("server")
            on_admin_port = server is not None and server[1] == self.admin.port
            if admin != on_admin_port:
                where = f"port {self.admin.port}" if admin else "the API port"
                return NotFound(
                    f"no route for {scope['method']} {path} on this port (it is served on {where})"
                )
        if admin:
            return self.admin.check(scope)
        if self.clients and (path == "/v1" or path.startswith("/v1/")):
            return self._client(scope)
        return None

    def _client(self, scope: Scope) -> GatewayError | None:
        token = bearer(scope)
        if token is None:
            return Unauthorized("missing API key: send Authorization: Bearer <key>")
        name = self.clients.identify(token)
        if name is None:
            return Unauthorized("incorrect API key provided")
        scope.setdefault("state", {})[CLIENT_STATE] = name
        self.counts[name] += 1
        return None


async def reject(send: Send, err: GatewayError) -> None:
    payload = err.body()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def log_admin_access(access: AdminAccess) -> None:
    """The start-up line: how /admin is protected (a warning when it is disabled)."""
    text = access.describe()
    if access.token is None and not access.open_on_loopback:
        log.warning(text)
    else:
        log.info(text)
