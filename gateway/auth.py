"""Who may call what: one ASGI wrapper in front of the whole app.

- ``/admin`` and everything under it (the JSON API, the status page, whatever is mounted there later)
  needs ``Authorization: Bearer <admin token>``, compared in constant time. With no token configured the
  admin plane is served only when the listener that serves it is bound to loopback; bound anywhere else it
  answers 403 and says why (never silently open on 0.0.0.0), and so does a request that came through a
  proxy (``Forwarded``, ``X-Forwarded-For``, ``X-Real-IP``: a reverse proxy on the same host would open it
  to everyone the proxy serves). That listener is ``admin.host:admin.port``
  when ``admin.port`` is set (then it serves /admin only, and /admin is served nowhere else), else the API
  listener, ``server.host`` (settings refuse ``admin.host`` without ``admin.port``).
- A connection is on the admin listener when the local address it arrived on (the ASGI scope's
  ``server``) is that listener's bound address: its port, and its host unless the host is a wildcard
  (0.0.0.0, ::). Never the port alone: another listener may share the port on another address.
- ``/metrics`` needs the admin token too with ``admin.protect_metrics`` (a 401 as for /admin).
- ``/v1/*`` needs a client key when ``auth.client_keys`` are configured, as ``Authorization: Bearer <key>``
  or (Anthropic's clients) ``x-api-key: <key>``: a missing or unknown key is a 401 in the route's error
  shape (Anthropic's on /v1/messages, else OpenAI's). The key's configured name goes into
  ``scope["state"]`` (the endpoint puts it on the ``RequestContext``) and into
  ``warmroute_client_requests_total{client}``. Names come from config only, never from the request.
- Scopes: ``http`` is checked as above, ``lifespan`` passes, a ``websocket`` is closed before it is
  accepted (the gateway serves none, and nothing may reach the app unchecked), any other type is an error.

Whether the admin listener is loopback is decided by the address the settings bind it to
(``admin.host``/``server.host``; ``warmroute serve --host`` writes its override into the settings every
worker is handed), not by a connection's local address: a socket bound to 0.0.0.0 reports
127.0.0.1 to a local client.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from config.settings import ConfigError, Settings
from gateway.errors import GatewayError, NotFound
from gateway.shapes.base import OPENAI_ERRORS, ErrorShape

log = logging.getLogger("warmroute.auth")

ADMIN_PREFIX = "/admin"
METRICS = "/metrics"
WS_POLICY_VIOLATION = 1008  # RFC 6455 close code
#: Headers reverse proxies add (nginx and HAProxy when configured to; Caddy and Traefik always).
FORWARDING_HEADERS = frozenset({b"forwarded", b"x-forwarded-for", b"x-real-ip"})
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


def forwarded(scope: Scope) -> bool:
    """Did a proxy add forwarding headers? Then the peer speaks for someone else, whatever its address."""
    return any(name in FORWARDING_HEADERS for name, _ in scope["headers"])


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


def api_key(scope: Scope) -> bytes | None:
    """The value of an ``x-api-key`` header (how Anthropic's clients send their key), or None."""
    for name, value in scope["headers"]:
        if name == b"x-api-key":
            token = bytes(value).strip()
            return token or None
    return None


def client_of(scope: Scope) -> str | None:
    """The name of the client key that authenticated this request (None: client keys are off)."""
    state: dict[str, Any] | None = scope.get("state")
    return None if state is None else state.get(CLIENT_STATE)


IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def _address(host: str) -> IPAddress | None:
    """``host`` as an address (IPv6 brackets and IPv4-mapped IPv6 undone), or None if it is not one."""
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


@dataclass(frozen=True, slots=True)
class Listener:
    """A listening socket's bound address: which connections arrived on it.

    ``addresses`` None: bound to a wildcard, so any local address on that port is this socket's. A host
    name is resolved once, as binding it does.
    """

    port: int
    addresses: frozenset[IPAddress] | None

    @classmethod
    def bound(cls, host: str, port: int) -> Listener:
        if host.strip("[]") in _WILDCARDS:
            return cls(port, None)
        addr = _address(host)
        if addr is not None:
            return cls(port, frozenset({addr}))
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise ConfigError(f"admin listener host {host!r} does not resolve: {exc}") from exc
        return cls(port, frozenset(a for info in infos if (a := _address(str(info[4][0]))) is not None))

    def accepted(self, server: Any) -> bool:
        """Did the connection whose local address is ``server`` (scope["server"]) arrive here?"""
        if not isinstance(server, (tuple, list)) or len(server) < 2 or server[1] != self.port:
            return False
        if self.addresses is None:
            return True
        addr = _address(str(server[0]))
        return addr is not None and addr in self.addresses


@dataclass(frozen=True, slots=True)
class AdminAccess:
    """How /admin (and, when asked, /metrics and /readyz's detail) is protected, decided once."""

    token: bytes | None
    host: str  # the address of the listener that serves /admin
    port: int | None  # the separate admin port, if any
    protect_metrics: bool = False
    protect_readyz_detail: bool = False
    listener: Listener | None = None  # the admin listener, with ``port``

    @classmethod
    def from_settings(cls, settings: Settings) -> AdminAccess:
        admin = settings.admin
        token = admin.secret()
        if token is None and (admin.protect_metrics or admin.protect_readyz_detail):
            raise ConfigError("admin.protect_metrics/protect_readyz_detail need an admin token; none is set")
        # Without admin.port, /admin is served by the API listener: that is the one whose address counts.
        host = (admin.host or settings.server.host) if admin.port is not None else settings.server.host
        listener = None if admin.port is None else Listener.bound(host, admin.port)
        return cls(
            None if token is None else token.encode(),
            host,
            admin.port,
            admin.protect_metrics,
            admin.protect_readyz_detail,
            listener,
        )

    @property
    def open_on_loopback(self) -> bool:
        return self.token is None and is_loopback(self.host)

    def describe(self) -> str:
        where = f"{self.host}:{self.port}" if self.port else f"{self.host} (the API port)"
        if self.token is not None:
            protected = (("/metrics", self.protect_metrics), ("/readyz detail", self.protect_readyz_detail))
            also = " and ".join(path for path, on in protected if on)
            extra = f"; also for {also}" if also else ""
            return f"admin API on {where}: bearer token required{extra}"
        if self.open_on_loopback:
            return f"admin API on {where}: no admin token configured; served because the listener is loopback"
        return (
            f"admin API DISABLED: no admin token configured and the admin listener {where} is not loopback; "
            "/admin answers 403 until admin.token (WARMROUTE_ADMIN__TOKEN) is set"
        )

    def on_admin_listener(self, scope: Scope) -> bool:
        return self.listener is not None and self.listener.accepted(scope.get("server"))

    def check(self, scope: Scope) -> GatewayError | None:
        if self.token is None:
            if self.open_on_loopback and not forwarded(scope):
                return None
            if self.open_on_loopback:
                return Forbidden(
                    "the admin API is served without a token only to callers on this host, and this request "
                    "came through a proxy (it carries forwarding headers); set admin.token "
                    "(WARMROUTE_ADMIN__TOKEN)"
                )
            return Forbidden(
                f"the admin API is disabled: no admin token is configured and the admin listener is bound "
                f"to {self.host}, which is not loopback; set admin.token (WARMROUTE_ADMIN__TOKEN)"
            )
        return self.check_token(scope, "admin endpoints need Authorization: Bearer <admin token>")

    def check_token(self, scope: Scope, missing: str) -> GatewayError | None:
        """A 401 (``missing``: its message when no token was sent) unless the request carries the admin
        token, which must be configured."""
        given = bearer(scope)
        if given is None:
            return Unauthorized(missing)
        if self.token is None or not hmac.compare_digest(given, self.token):
            return Unauthorized("the admin token is not valid")
        return None

    def has_token(self, scope: Scope) -> bool:
        """Does the request carry the (configured) admin token?"""
        return self.token is not None and self.check_token(scope, "") is None


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

    def __init__(
        self,
        app: ASGIApp,
        admin: AdminAccess,
        clients: ClientKeys,
        counts: dict[str, int],
        errors: Mapping[str, ErrorShape] | None = None,
    ) -> None:
        """``errors``: the error shape of each served route (path -> shape); others answer OpenAI's."""
        self.app = app
        self.admin = admin
        self.clients = clients
        self.errors = dict(errors or {})
        self.counts = counts  # warmroute_client_requests_total, by configured name
        for name in clients.names:
            counts.setdefault(name, 0)

    def __getattr__(self, name: str) -> Any:  # ``app.state`` and friends of the wrapped app
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "lifespan":
            await self.app(scope, receive, send)
            return
        if kind == "websocket":  # refused before the handshake completes: the server answers 403
            log.info("websocket %r refused: this gateway serves no websockets", scope.get("path"))
            await send({"type": "websocket.close", "code": WS_POLICY_VIOLATION, "reason": ""})
            return
        if kind != "http":
            raise RuntimeError(f"unsupported ASGI scope type {kind!r}")
        error = self._check(scope)
        if error is not None:
            await reject(send, error, self.errors.get(scope["path"].rstrip("/"), OPENAI_ERRORS))
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope) -> GatewayError | None:
        path: str = scope["path"]
        admin = is_admin_path(path)
        if self.admin.port is not None and admin != self.admin.on_admin_listener(scope):
            where = f"port {self.admin.port}" if admin else "the API port"
            return NotFound(f"no route for {scope['method']} {path} on this port (it is served on {where})")
        if admin:
            return self.admin.check(scope)
        if self.admin.protect_metrics and (path == METRICS or path.startswith(METRICS + "/")):
            return self.admin.check_token(scope, "/metrics needs Authorization: Bearer <admin token>")
        if self.clients and (path == "/v1" or path.startswith("/v1/")):
            return self._client(scope)
        return None

    def _client(self, scope: Scope) -> GatewayError | None:
        token = bearer(scope) or api_key(scope)
        if token is None:
            return Unauthorized("missing API key: send Authorization: Bearer <key> (or x-api-key: <key>)")
        name = self.clients.identify(token)
        if name is None:
            return Unauthorized("incorrect API key provided")
        scope.setdefault("state", {})[CLIENT_STATE] = name
        self.counts[name] += 1
        return None


async def reject(send: Send, err: GatewayError, errors: ErrorShape = OPENAI_ERRORS) -> None:
    payload = errors.body(err)
    headers = [(b"content-type", errors.content_type), (b"content-length", str(len(payload)).encode())]
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
