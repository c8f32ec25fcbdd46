"""``POST /admin/route/explain``: where would this request go, and why — a dry run without side effects.

The key comes from the endpoint itself (``Endpoint.context``: the same validation, session header and
hashing as a real request), the candidates from a fresh snapshot, the decision from the configured policy.
Nothing is committed: no pin is claimed, touched or moved, no lease is taken, no breaker trial is used, no
decision is counted. (With Redis, the snapshot's script republishes this replica's in-flight counts, as
every heartbeat does.) Under the ``ttft`` policy a sample body is planned as a real request would be (its
key may be extended to tell identical heads apart) and the reply lists every candidate's estimated cost.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from starlette.types import Message

from backends.registry import Registry
from gateway.admin.body import Unprocessable, finite
from gateway.admin.models import CandidateView, CostView, ExplainRequest, Explanation
from gateway.context import RequestContext
from gateway.endpoints import Endpoint
from gateway.errors import BadRequest
from gateway.inbound import first_values
from gateway.ownership import ResponseOwnership
from gateway.state import AffinityStore
from routing.policies import Policy
from routing.types import Candidate, Cost, Decision, RouteRequest

if TYPE_CHECKING:
    from gateway.learning import RoutingFeedback

#: Candidate fields the view has a field of its own for; every other one (a routing signal) is in ``signals``.
_CORE = frozenset(Candidate._fields) & frozenset(CandidateView.model_fields)


class Explainer:
    def __init__(
        self,
        registry: Registry,
        store: AffinityStore,
        policy_name: str,
        endpoints: Mapping[str, Endpoint],
        feedback: RoutingFeedback | None = None,
    ) -> None:
        self.feedback = feedback  # the ttft policy's inputs (gateway/learning.py), when it is configured
        self.registry = registry
        self.store = store
        self.policy_name = policy_name
        self.endpoints = endpoints  # path -> the endpoint that serves it

    async def explain(self, req: ExplainRequest) -> Explanation:
        endpoint = self.endpoints.get(req.path)
        if endpoint is None:
            served = ", ".join(self.endpoints)
            raise Unprocessable(f"path must be one of the served API shapes' ({served})", param="path")
        ctx = self._context(req, endpoint)
        key, model = (req.key, req.model) if ctx is None else (ctx.key, ctx.model)
        assert key is not None
        policy: Policy = endpoint.policy
        if ctx is not None:
            # A body naming stored state (previous_response_id) goes to its owner only; an unknown id or
            # a gone owner is answered with the error the real request would get.
            await ResponseOwnership(self.store, self.registry).enter(ctx, _unsent)
            policy = ctx.policy
        feedback = self.feedback if ctx is not None and ctx.owned_id is None else None
        if feedback is not None and ctx is not None:
            feedback.plan(ctx)  # as the proxy does before routing: the key may grow a reply hash
            key = ctx.affinity_key  # a token count is planned as its conversation's next turn, as there
        view = await self.store.view(key if policy.uses_affinity else None)
        decision: Decision
        now = time.monotonic()
        if feedback is not None and ctx is not None:
            candidates = self.registry.candidates(model, feedback.conversations(), view.in_flight, now)
            decision = feedback.explain(ctx, view.pinned, view.in_flight, policy)
        else:
            candidates = self.registry.candidates(model, view.conversations, view.in_flight, now)
            if ctx is not None and ctx.ineligible:
                candidates = tuple(c for c in candidates if c.id not in ctx.ineligible)
            decision = policy.select(candidates, RouteRequest(key, view.pinned), now)
        return Explanation(
            key=key,
            model=model,
            policy=self.policy_name,
            pinned=view.pinned,
            backend=decision.backend,
            reason=decision.reason.value,
            pin_action=decision.pin.value,
            candidates=[_candidate(c) for c in candidates],
            costs=[_cost(c) for c in decision.costs],
            why=decision.explain(),
            note="dry run: nothing was committed; a real request may still find its claim won by another "
            "replica, or a half-open breaker refusing it",
        )

    def _context(self, req: ExplainRequest, endpoint: Endpoint) -> RequestContext | None:
        """The request context a real request with this body would get (None: a bare key was given)."""
        if (req.key is None) == (req.body is None):
            raise BadRequest("give exactly one of key or body", param="key")
        if req.key is not None:
            return None
        raw = json.dumps(req.body).encode()
        headers = [
            (k.lower().encode("latin-1", "replace"), v.encode("latin-1", "replace"))
            for k, v in req.headers.items()
        ]
        scope: dict[str, Any] = {"type": "http", "method": "POST", "path": req.path, "headers": headers}
        return endpoint.context(scope, raw, first_values(headers))  # BadRequest as the endpoint would


async def _unsent(_message: Message) -> None:
    """The dry run's ``send``: nothing is answered to anyone."""


def _cost(c: Cost) -> CostView:
    return CostView(
        backend=c.backend,
        uncached_tokens=c.uncached_tokens,
        queue_s=finite(c.queue_s),
        prefill_s=finite(c.prefill_s),
        load_s=finite(c.load_s),
        total_s=finite(c.total_s),
    )


def _candidate(c: Candidate) -> CandidateView:
    # A float that is no number (``placed_at`` of a backend never given a new conversation: -inf) is null.
    signals = {k: finite(v) if isinstance(v, float) else v for k, v in c._asdict().items() if k not in _CORE}
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
