"""``POST /admin/route/explain``: where would this request go, and why — a dry run without side effects.

The key comes from the endpoint itself (``Endpoint.context``: the same validation, session header and
hashing as a real request), the candidates from a fresh snapshot, the decision from the configured policy.
Nothing is committed: no pin is claimed, touched or moved, no lease is taken, no breaker trial is used, no
decision is counted. (With Redis, the snapshot's script republishes this replica's in-flight counts, as
every heartbeat does.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from backends.registry import Registry
from gateway.admin.body import finite
from gateway.admin.models import CandidateView, ExplainRequest, Explanation
from gateway.endpoints import Endpoint
from gateway.errors import BadRequest
from gateway.state import AffinityStore
from routing.policies import Policy
from routing.types import Candidate, RouteRequest

_CORE = frozenset(Candidate._fields)


class Explainer:
    def __init__(
        self, registry: Registry, store: AffinityStore, policy_name: str, endpoints: Mapping[str, Endpoint]
    ) -> None:
        self.registry = registry
        self.store = store
        self.policy_name = policy_name
        self.endpoints = endpoints  # path -> the endpoint that serves it

    async def explain(self, req: ExplainRequest) -> Explanation:
        endpoint = self.endpoints[req.path]
        key, model = self._key(req, endpoint)
        policy: Policy = endpoint.policy
        view = await self.store.view(key if policy.uses_affinity else None)
        candidates = self.registry.snapshot(model, view.conversations, view.in_flight)
        decision = policy.select(candidates, RouteRequest(key, view.pinned), time.monotonic())
        return Explanation(
            key=key,
            model=model,
            policy=self.policy_name,
            pinned=view.pinned,
            backend=decision.backend,
            reason=decision.reason.value,
            pin_action=decision.pin.value,
            candidates=[_candidate(c) for c in candidates],
            note="dry run: nothing was committed; a real request may still find its claim won by another "
            "replica, or a half-open breaker refusing it",
        )

    def _key(self, req: ExplainRequest, endpoint: Endpoint) -> tuple[str, str | None]:
        if (req.key is None) == (req.body is None):
            raise BadRequest("give exactly one of key or body", param="key")
        if req.key is not None:
            return req.key, req.model
        raw = json.dumps(req.body).encode()
        headers = [
            (k.lower().encode("latin-1", "replace"), v.encode("latin-1", "replace"))
            for k, v in req.headers.items()
        ]
        scope: dict[str, Any] = {"type": "http", "method": "POST", "path": req.path, "headers": headers}
        ctx = endpoint.context(scope, raw)  # BadRequest for what the endpoint would refuse
        return ctx.key, ctx.model


def _candidate(c: Candidate) -> CandidateView:
    signals = {k: v for k, v in c._asdict().items() if k not in _CORE}
    return CandidateView(
        id=c.id,
        state=c.state.value,
        routable=c.routable,
        in_flight=c.in_flight,
        conversations=c.conversations,
        weight=c.weight,
        load=finite(c.load) or 0.0,
        signals=signals,
    )
