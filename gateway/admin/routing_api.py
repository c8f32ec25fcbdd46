"""The admin API's routing handlers: the routing dry run, a conversation's pin (look up, forget) and the
affinity statistics, with their entries of the operation table (``gateway.admin.api.operations`` places
them). They read the store and the metrics; none changes a backend, so none is published to other replicas.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.admin import pins
from gateway.admin.body import json_response, read_model
from gateway.admin.explain import Explainer
from gateway.admin.models import AffinityStats, ExplainRequest, Explanation, Forgotten, PinView
from gateway.admin.openapi import Operation
from gateway.admin.ports import AdminPorts
from gateway.errors import NotFound
from routing.types import Reason

_AFFINITY_REASONS = (Reason.AFFINITY_HIT, Reason.SPILL_OVERLOAD, Reason.REPIN_UNHEALTHY, Reason.REPIN_REMOVED)
_NEW_OR_MOVED = (Reason.NEW_LEAST_LOADED, Reason.NEW_CHEAPEST, Reason.MOVE_CHEAPER)  # both policies' misses


class RoutingApi:
    def __init__(self, gw: AdminPorts, explainer: Explainer) -> None:
        self.gw = gw
        self.explainer = explainer
        self.limit = gw.admin.max_body_bytes

    async def explain(self, request: Request) -> Response:
        req = await read_model(request, ExplainRequest, self.limit)
        return json_response(await self.explainer.explain(req))

    async def get_pin(self, request: Request) -> Response:
        key = request.path_params["key"]
        pin = await pins.lookup(self.gw.store, key)
        if pin is None:
            raise NotFound(f"no pin for conversation {key!r}", param="key")
        present = pin.backend in self.gw.registry.backends
        return json_response(
            PinView(key=key, backend=pin.backend, expires_in_s=pin.expires_in_s, backend_configured=present)
        )

    async def forget_pin(self, request: Request) -> Response:
        key = request.path_params["key"]
        backend = await pins.forget(self.gw.store, key)
        if backend is None:
            raise NotFound(f"no pin for conversation {key!r}", param="key")
        return json_response(Forgotten(key=key, backend=backend))

    async def affinity(self, _request: Request) -> Response:
        per_backend = await pins.counts(self.gw.store)
        decisions = {r.value: n for r, n in self.gw.metrics.tally.decisions.items()}
        routed = sum(decisions[r.value] for r in (*_AFFINITY_REASONS, *_NEW_OR_MOVED))
        status = self.gw.store.status()
        stats = AffinityStats(
            store=str(status.get("backend")),
            degraded=bool(status.get("degraded")),
            pins=sum(per_backend.values()),
            per_backend=per_backend,
            decisions=decisions,
            hit_rate=decisions[Reason.AFFINITY_HIT.value] / routed if routed else None,
        )
        return json_response(stats)


def routing_operations(api: RoutingApi) -> list[Operation]:
    return [
        Operation(
            "POST",
            "/route/explain",
            api.explain,
            "Where would this go, and why (dry run)",
            Explanation,
            ExplainRequest,
            errors=(400, 413, 422),
        ),
        Operation("GET", "/pins/{key}", api.get_pin, "A conversation's pin", PinView, errors=(404,)),
        Operation(
            "DELETE", "/pins/{key}", api.forget_pin, "Forget a conversation's pin", Forgotten, errors=(404,)
        ),
        Operation("GET", "/affinity", api.affinity, "Affinity statistics", AffinityStats),
    ]
