"""``/readyz``: is this gateway ready, and how each backend stands.

Served on the API port without auth, for load balancers and supervisors. Who gets the detail (each
backend's full lifecycle status: the failed canary check and its answer, exit codes, last output lines; the
vision sidecar's the same) is decided per request: by default a loopback peer (an operator on the host, a
local supervisor) whose request carries no forwarding headers (a reverse proxy on the same host is a
loopback peer speaking for everyone); with ``admin.protect_readyz_detail`` only a caller with the admin
token (for proxies that add no such header). Anyone else gets ids, states and a short reason, no URLs or
output.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from backends.fleet import Fleet
from backends.registry import Registry
from gateway.auth import AdminAccess, forwarded, is_loopback
from gateway.sidecar import SidecarHost
from gateway.state import AffinityStore

#: The short form's reason is cut here: engine output must not leak through it.
SHORT_REASON_CHARS = 120


def readyz_endpoint(
    registry: Registry,
    fleet: Fleet,
    store: AffinityStore,
    sidecar: SidecarHost | None,
    access: AdminAccess,
) -> Callable[[Request], Awaitable[Response]]:
    async def readyz(request: Request) -> Response:
        detail = wants_detail(request, access)
        # Stopped on-demand engines start on a request: a gateway fronting only those is ready.
        ready = registry.any_ready() or fleet.startable()
        shared = store.status()
        body: dict[str, Any] = {
            "ready": ready,
            "backends": readyz_backends(fleet.status(), detail),
            "shared_state": {"backend": shared.get("backend"), "degraded": bool(shared.get("degraded"))},
        }
        if sidecar is not None:  # not part of readiness: text requests never need it
            side: dict[str, Any] = {"state": sidecar.state, "available": sidecar.available}
            if detail:
                side["status"] = sidecar.status()
            body["vision_sidecar"] = side
        return JSONResponse(body, status_code=200 if ready else 503)

    return readyz


def wants_detail(request: Request, access: AdminAccess) -> bool:
    """A wrong or missing token is no error here (a probe must not fail on it): the short form."""
    if access.protect_readyz_detail:
        return access.has_token(request.scope)
    client = request.client
    return client is not None and is_loopback(client.host) and not forwarded(request.scope)


def readyz_backends(status: dict[str, dict[str, Any]], detail: bool) -> dict[str, dict[str, Any]]:
    if detail:
        return status
    out: dict[str, dict[str, Any]] = {}
    for bid, st in status.items():
        reason = str(st.get("reason") or "").split(";", 1)[0].split(": ", 1)[0]  # "canary failed", …
        out[bid] = {"state": st["state"], "reason": reason[:SHORT_REASON_CHARS]}
    return out
