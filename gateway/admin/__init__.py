"""The admin plane under ``/admin``: a JSON API over the running gateway, with its OpenAPI document.

- ``api``: the backend handlers, the change long poll and the operation table; ``routing_api``: the
  routing dry run, pin and affinity handlers; ``openapi``: the document generated from that table and the
  pydantic models (``models``); ``body``: safe body reading and responses;
- ``runtime``: backend changes applied to this replica; ``sync``: the Redis change feed that carries them
  to the other replicas; ``explain``: the routing dry run; ``pins``: pin lookups over either store;
- ``ports``: what the admin plane is handed (``AdminPorts``), built by ``create_app``.

Authentication is not here: ``gateway.auth.AccessGuard`` wraps the whole app and covers every path under
``/admin``, including routes other modules add to ``Admin.routes`` (the status page, say).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.admin.api import AdminApi, operations
from gateway.admin.explain import Explainer
from gateway.admin.openapi import Operation, document
from gateway.admin.ports import AdminPorts
from gateway.admin.routing_api import RoutingApi
from gateway.admin.runtime import LocalChanges
from gateway.admin.sync import ChangeFeed


class Admin:
    """Built by ``create_app``; ``start``/``aclose`` run in the app's lifespan."""

    def __init__(self, ports: AdminPorts) -> None:
        self.local = LocalChanges(ports)
        self.feed: ChangeFeed | None = None
        channel = ports.store.admin_channel()  # None: nothing to publish to (no other replica shares it)
        if channel is not None:
            admin = ports.admin
            self.feed = ChangeFeed(
                channel.redis, channel.keys, self.local, admin.sync_interval_s, admin.allow_managed
            )
        explainer = Explainer(ports.registry, ports.store, ports.policy, ports.endpoints, ports.feedback)
        self.api = AdminApi(ports, self.feed, self.local)
        self.routing_api = RoutingApi(ports, explainer)
        self.operations: list[Operation] = operations(self.api, self.routing_api)
        self._document: dict[str, object] | None = None

    @property
    def routes(self) -> list[BaseRoute]:
        """Routes under /admin (paths relative to it): mount them with ``Mount("/admin", routes=...)``."""
        routes: list[BaseRoute] = [Route(op.path, op.handler, methods=[op.method]) for op in self.operations]
        routes.append(Route("/openapi.json", self.openapi, methods=["GET"]))
        return routes

    async def openapi(self, _request: Request) -> Response:
        if self._document is None:
            self._document = document(self.operations)
        return JSONResponse(self._document)

    async def start(self) -> None:
        """Before the fleet starts: apply what other replicas changed at runtime, then follow the feed."""
        if self.feed is not None:
            await self.feed.start()

    async def aclose(self) -> None:
        if self.feed is not None:
            await self.feed.aclose()
