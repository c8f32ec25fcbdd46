"""Per-request thinking budgets: the fields the gateway owns, validated at the edge, shaped per attempt.

A client asks with ``thinking_budget`` (tokens, 0 = no thinking) and/or ``reasoning_effort`` (OpenAI's field),
in the body or, for clients that cannot add body fields, in headers (the body wins when both are given).
``resolve`` turns that into a ``Thinking`` or a 400 before any engine is called; ``BudgetStep`` (a
``PrepareStep``) spells it for the dialect of the backend each attempt goes to (backends/dialects.py), or
marks the attempt for the gateway-enforced path (gateway/continuation.py).

Rules where the issue is silent:
- an explicit budget must leave room for an answer: ``thinking_budget < max_completion_tokens`` (or
  ``max_tokens``) when either is set. Budgets derived from an effort or a model default are not checked: the
  client's own token limit then binds first, as it would without the gateway;
- ``reasoning_effort: "none"`` with a budget > 0, or budget 0 with an effort other than ``none``, contradict;
- a budget with an effort: the budget caps, the effort still goes to engines that understand it;
- a model configured ``thinks: false``: nothing to cap; the gateway's own field is dropped, not refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from backends.dialects import DIALECTS
from backends.registry import Backend
from config.settings import BudgetEnforcement, Dialect, Effort, ModelConfig, ThinkingConfig
from gateway.context import Draft, RequestContext
from gateway.continuation import shape_phase1
from gateway.errors import BadRequest
from gateway.metrics import Metrics
from gateway.shapes.base import ThinkingUse
from gateway.thinking import BudgetAsk, Thinking

# For ``BudgetStep.prepare`` (once per attempt): on Python 3.11 every ``ThinkingUse.X`` is a class attribute
# load through ``EnumType.__getattr__``'s slow hook (~0.25 us each).
_IGNORE, _EFFORT = ThinkingUse.IGNORE, ThinkingUse.EFFORT

BUDGET_FIELD = "thinking_budget"
EFFORT_FIELD = "reasoning_effort"
EFFORTS = tuple(e.value for e in Effort)
#: A request with no budget or effort field or header: what ``_budget`` and ``_effort`` would read of it.
_NOTHING_ASKED = BudgetAsk(None, None, BUDGET_FIELD)
#: Where a client asks for a thinking budget, for the errors of routes that take none.
BUDGET_ROUTES = (
    f"/v1/chat/completions ('{BUDGET_FIELD}', '{EFFORT_FIELD}'), /v1/messages ('thinking') and "
    "/v1/responses ('reasoning.effort')"
)
_DEFAULT_MODEL = ModelConfig()

log = logging.getLogger("warmroute.budgets")


class BudgetPolicy:
    """The configuration ``resolve`` and ``BudgetStep`` read, built once from settings."""

    def __init__(
        self,
        cfg: ThinkingConfig,
        models: Mapping[str, ModelConfig],
        ignored: Callable[[str, str], None] | None = None,
    ) -> None:
        """``ignored(shape, header)``: counts a budget header a shape ignores (gateway/metrics.py)."""
        self.cfg = cfg
        self.ignored = ignored
        self._announced: set[tuple[str, str]] = set()  # (shape, header) already logged
        self.models = dict(models)
        self.budget_header = cfg.budget_header.lower().encode("latin-1")
        self.effort_header = cfg.effort_header.lower().encode("latin-1")

    def model(self, name: str | None) -> ModelConfig:
        return self.models.get(name or "", _DEFAULT_MODEL)

    def thinks(self, name: str | None) -> bool:
        return self.model(name).thinks

    def refuse(self, body: dict[str, Any], headers: Mapping[bytes, bytes], shape: str, path: str) -> None:
        """For shapes that refuse a budget (``ThinkingUse.REFUSE``: /v1/completions has no chat template or
        reasoning parser). A budget or an effort in the body asks this request for one: a 400 naming the
        routes that take budgets, not a no-op. The budget and effort headers are often set on every request
        a client sends, whatever the route, so they are no error here; each one is ignored and announced:
        counted (``warmroute_thinking_ignored_requests_total``) and logged, once per header and route."""
        for name in (BUDGET_FIELD, EFFORT_FIELD):
            if body.get(name) is not None:
                raise BadRequest(
                    f"'{name}' does not apply to {path}, which has no chat template or reasoning parser; "
                    f"thinking budgets are taken by {BUDGET_ROUTES}",
                    param=name,
                )
        for header, spelled in (
            (self.budget_header, self.cfg.budget_header),
            (self.effort_header, self.cfg.effort_header),
        ):
            if header in headers:
                self._ignored(shape, path, spelled)

    def _ignored(self, shape: str, path: str, header: str) -> None:
        if self.ignored is not None:
            self.ignored(shape, header)
        if (shape, header) not in self._announced:
            self._announced.add((shape, header))
            log.warning(
                "header %s is ignored on %s, which has no reasoning to cap (thinking budgets are taken by "
                "%s); counted in warmroute_thinking_ignored_requests_total, logged once",
                header,
                path,
                BUDGET_ROUTES,
            )

    def refuse_budget(
        self, body: dict[str, Any], headers: Mapping[bytes, bytes], path: str, effort: tuple[str, ...]
    ) -> None:
        """For shapes with an effort only (``ThinkingUse.EFFORT``): a token budget, in the body or the
        header, is a 400 that says what to ask with instead. OpenAI's Responses API has no reasoning token
        budget (``reasoning`` holds ``effort``, ``summary``, ...; ``max_output_tokens`` bounds reasoning and
        answer together), nor has vLLM's Responses route (its request has no ``thinking_token_budget``, as
        its chat request has), so the gateway invents none: the effort, through the model's effort table,
        is this route's budget."""
        instead = (
            f"ask with '{'.'.join(effort)}' (or header {self.cfg.effort_header}): the model's effort table "
            f"gives its token budget; or use /v1/chat/completions, where '{BUDGET_FIELD}' caps thinking"
        )
        if body.get(BUDGET_FIELD) is not None:
            raise BadRequest(
                f"'{BUDGET_FIELD}' is not a field of {path}, which has no reasoning token budget; {instead}",
                param=BUDGET_FIELD,
            )
        if self.budget_header in headers:
            raise BadRequest(
                f"header {self.cfg.budget_header} does not apply to {path}, which has no reasoning token "
                f"budget; {instead}",
                param=self.cfg.budget_header,
            )

    def resolve(
        self, body: dict[str, Any], headers: Mapping[bytes, bytes], model: str | None
    ) -> Thinking | None:
        """The request's thinking budget, ``None`` if it asks for nothing, or ``BadRequest``. ``headers``:
        each request header's first value (``gateway.inbound.first_values``), here and below."""
        in_body = BUDGET_FIELD in body or EFFORT_FIELD in body
        if not (in_body or self.budget_header in headers or self.effort_header in headers):
            return self.decide(_NOTHING_ASKED, model)  # the common request: 5 calls and an object fewer
        budget = _budget(body, _text(headers.get(self.budget_header)), self.cfg.budget_header)
        effort = _effort(body, _text(headers.get(self.effort_header)), self.cfg.effort_header)
        _check_agreement(budget, effort)
        if budget is not None:
            _check_room(body, budget)
        return self.decide(BudgetAsk(budget, effort, BUDGET_FIELD), model)

    def decide(self, ask: BudgetAsk, model: str | None) -> Thinking | None:
        """A validated ask resolved against the model's configuration (its ``max_budget`` is a 400)."""
        budget, effort = ask.budget, ask.effort
        mcfg = self.model(model)
        if budget is not None and mcfg.max_budget is not None and budget > mcfg.max_budget:
            raise BadRequest(
                f"'{ask.param}' must be between 0 and {mcfg.max_budget} for model {model!r}, got {budget}",
                param=ask.param,
            )
        if not mcfg.thinks:
            return None
        explicit = budget is not None
        if budget is None and effort is not None:
            budget = mcfg.effort_budgets.get(Effort(effort))
        if budget is None and effort is None:
            if mcfg.default_budget is None:
                return None
            budget = mcfg.default_budget
        return Thinking(budget, effort, explicit)

    def resolve_effort(
        self,
        body: dict[str, Any],
        path: tuple[str, ...],
        headers: Mapping[bytes, bytes],
        model: str | None,
    ) -> Thinking | None:
        """For shapes with an effort only (``ThinkingUse.EFFORT``): the body's effort at ``path`` (the shape
        validated it), else the effort header's, resolved as chat's ``reasoning_effort`` is (the model's
        effort table gives its budget; no effort: the model's default budget). The budget is never the
        client's (``explicit`` False): where it cannot be applied it is not enforced (``budget_as_chat``)."""
        value = read_path(body, path)
        if value is None:
            value = _effort({}, _text(headers.get(self.effort_header)), self.cfg.effort_header)
        elif value not in EFFORTS:
            raise BadRequest(f"'{'.'.join(path)}' must be one of {', '.join(EFFORTS)}", param=".".join(path))
        return self.decide(BudgetAsk(None, None if value is None else str(value), ".".join(path)), model)


class BudgetStep:
    """The ``PrepareStep``: the budget spelled for the chosen backend's dialect, per attempt.

    Each attempt starts from the original body (``Draft``), so a retry on another dialect never sees the
    previous dialect's fields.
    """

    def __init__(self, policy: BudgetPolicy, metrics: Metrics) -> None:
        self.policy = policy
        self.metrics = metrics

    async def prepare(self, ctx: RequestContext, backend: Backend, draft: Draft) -> None:
        if ctx.shape.thinking is _IGNORE:
            return  # a shape without budgets: its body is the client's
        thinking = ctx.thinking
        # An attempt translated to chat (gateway/translation.py) carries chat's fields whatever its client
        # shape: it is spelled as a chat request (below), never in the client shape's own fields.
        if ctx.attempt is None or ctx.attempt.translated is None:
            if ctx.shape.thinking is _EFFORT:
                self._effort(ctx, backend, draft)
                return
            if ctx.shape.thinking_ask is not None:
                self._own_fields(ctx, backend, draft)
                return
        body = draft.read()
        if thinking is None:
            if body is not None and BUDGET_FIELD in body:
                draft.edit().pop(BUDGET_FIELD)  # ours: engines would ignore it or refuse it
            return
        dialect = backend.cfg.dialect
        enforced = gateway_enforces(backend.cfg.budget_enforcement, dialect, thinking)
        shaped = draft.edit()
        if thinking.effort is not None and ctx.shape.thinking_ask is None:
            # An effort from the header is the request's as one in the body is (chat's own field, or the one
            # a translated Responses body got): the engine gets its native effort control either way, and
            # the dialect's spelling below leaves out an effort it does not take.
            shaped.setdefault(EFFORT_FIELD, thinking.effort)
        if enforced and ctx.attempt is not None and ctx.attempt.translated is not None:
            # Phase 2 continues this chat body, not the client's (gateway/translation.py stitches the two
            # chat phases before translating the answer back).
            draft.phase1_source = dict(shaped)
        DIALECTS[dialect].budget.shape(shaped, thinking, native=not enforced)
        if enforced:
            shape_phase1(shaped, thinking)
            draft.enforced = thinking  # this attempt's, not the request's: a retry elsewhere decides anew
        self.metrics.budget_attempt("off" if thinking.off else "gateway" if enforced else "native")

    def _effort(self, ctx: RequestContext, backend: Backend, draft: Draft) -> None:
        """The effort where the shape keeps it, if the backend's dialect accepts it (else left out: the
        engine's default); the client's bytes when that is what they already say."""
        thinking = ctx.thinking
        if thinking is None or thinking.effort is None:
            return
        path = ctx.shape.effort_path
        accepted = DIALECTS[backend.cfg.dialect].budget.efforts
        wanted = thinking.effort if thinking.effort in accepted else None
        if read_path(draft.read(), path) != wanted:
            write_path(draft.edit(), path, wanted)
        self.metrics.budget_attempt("off" if thinking.off else "native")

    def _own_fields(self, ctx: RequestContext, backend: Backend, draft: Draft) -> None:
        """A shape with its own thinking fields (Anthropic's ``thinking``): the client's go to the engine as
        sent, its native route caps them; a budget the gateway derived is written by the shape.

        Where only the gateway could cap it (``budget_as_chat``) the attempt was translated to chat by the
        first prepare step (gateway/translation.py) and never reaches here; one that does anyway is refused,
        never sent uncapped."""
        thinking = ctx.thinking
        if thinking is None:
            return
        if budget_as_chat(ctx, backend):
            if thinking.explicit:
                raise BudgetNotEnforceable(
                    f"backend {backend.id} does not cap thinking on {ctx.shape.path}, and this attempt was "
                    "not translated to chat completions, where the gateway enforces it",
                    param="thinking",
                )
            return  # a derived budget on a request the translation refused: the client's bytes
        spell = ctx.shape.thinking_spell
        body = draft.read()
        field = None if spell is None or body is None else spell(body, thinking)
        if field is not None:
            draft.edit()[field[0]] = field[1]
        self.metrics.budget_attempt("off" if thinking.off else "native")


def budget_as_chat(ctx: RequestContext, backend: Backend) -> bool:
    """This attempt should go as chat (gateway/translation.py translates it) for its thinking budget to
    apply: a positive cap that the backend's native route for the shape does not enforce.

    - Messages (its own ``thinking`` fields): where the dialect's route does not cap it (``capped_shapes``:
      SGLang accepts ``budget_tokens`` on ``/v1/messages`` without enforcing it), or the backend says
      ``budget_enforcement: gateway``. As chat the cap is the dialect's chat field or the gateway's two
      phases.
    - Responses (an effort, the model's effort table giving the budget, as on chat): where the gateway
      would enforce the budget on chat (``gateway_enforces``: dialect ``openai``, ``budget_enforcement:
      gateway``), and only for a response the client does not keep (``store: false``, as Codex sends): a
      translated answer is stored nowhere, so a later ``previous_response_id`` could not find it. Elsewhere
      the effort goes to the engine's own Responses route, its own control.

    A derived budget (no client ``budget_tokens``) on a request the translation refuses (a stored
    response's chain, a built-in tool) goes to the engine's own route instead (gateway/translation.py)."""
    thinking = ctx.thinking
    if thinking is None or not thinking.budget:
        return False
    cfg = backend.cfg
    if ctx.shape.thinking is _EFFORT:
        kept = ctx.body is None or ctx.body.get("store") is not False
        return not kept and gateway_enforces(cfg.budget_enforcement, cfg.dialect, thinking)
    if ctx.shape.thinking_ask is None:
        return False
    capped = ctx.shape.name in DIALECTS[cfg.dialect].capped_shapes
    return _needs_gateway(cfg.budget_enforcement, capped, thinking)


def read_path(body: dict[str, Any] | None, path: tuple[str, ...]) -> Any:
    """The value at ``path`` in nested objects, or None where any step is absent or not an object."""
    value: Any = body
    for name in path:
        if not isinstance(value, dict):
            return None
        value = value.get(name)
    return value


def write_path(body: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    """Set (``value`` None: remove) the value at ``path``, rebuilding each nested object on the way: the
    original's nested objects are never mutated (``Draft``)."""
    name, rest = path[0], path[1:]
    if not rest:
        if value is None:
            body.pop(name, None)
        else:
            body[name] = value
        return
    inner = body.get(name)
    copy = dict(inner) if isinstance(inner, dict) else {}
    write_path(copy, rest, value)
    body[name] = copy


def _needs_gateway(mode: BudgetEnforcement, capped: bool, thinking: Thinking) -> bool:
    """A positive cap on a shape's own field needs the gateway where the engine's route does not cap it
    (``capped``: ``EngineDialect.capped_shapes``) or the backend says the gateway enforces."""
    if not thinking.budget:
        return False
    return mode is BudgetEnforcement.GATEWAY or (mode is BudgetEnforcement.AUTO and not capped)


class BudgetNotEnforceable(BadRequest):
    code = "budget_not_enforceable"


def gateway_enforces(mode: BudgetEnforcement, dialect: Dialect, thinking: Thinking) -> bool:
    """Only a positive cap needs enforcing by the gateway; "off" is a template switch every dialect has.
    ``auto``: the gateway enforces where the engine has no native cap."""
    if thinking.budget is None or thinking.budget == 0:
        return False
    if mode is BudgetEnforcement.AUTO:
        return not DIALECTS[dialect].budget.native
    return mode is BudgetEnforcement.GATEWAY


# -- validation ---------------------------------------------------------------------------------------------


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1").strip()


def _budget(body: dict[str, Any], header: str | None, header_name: str) -> int | None:
    allowed = "an integer >= 0 (0 = no thinking)"
    if BUDGET_FIELD in body:
        value = body[BUDGET_FIELD]
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise BadRequest(f"'{BUDGET_FIELD}' must be {allowed}, got {value!r}", param=BUDGET_FIELD)
        return value
    if header is None:
        return None
    if not header.isascii() or not header.isdigit():
        raise BadRequest(f"header {header_name} must be {allowed}, got {header!r}", param=header_name)
    return int(header)


def _effort(body: dict[str, Any], header: str | None, header_name: str) -> str | None:
    value: Any = body.get(EFFORT_FIELD) if EFFORT_FIELD in body else header
    where = f"'{EFFORT_FIELD}'" if EFFORT_FIELD in body else f"header {header_name}"
    if value is None:
        return None
    if not isinstance(value, str) or value not in EFFORTS:
        raise BadRequest(
            f"{where} must be one of {', '.join(EFFORTS)}, got {value!r}",
            param=EFFORT_FIELD if EFFORT_FIELD in body else header_name,
        )
    return value


def _check_agreement(budget: int | None, effort: str | None) -> None:
    if budget is None or effort is None:
        return
    if (budget == 0) != (effort == Effort.NONE):
        raise BadRequest(
            f"'{BUDGET_FIELD}': {budget} contradicts '{EFFORT_FIELD}': {effort!r}; budget 0 goes only with "
            f"effort 'none' (and 'none' only with 0); give one of the two, or agreeing values",
            param=BUDGET_FIELD,
        )


def _check_room(body: dict[str, Any], budget: int) -> None:
    for name in ("max_completion_tokens", "max_tokens"):
        limit = body.get(name)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if budget > 0 and budget >= limit:
                raise BadRequest(
                    f"'{BUDGET_FIELD}' ({budget}) leaves no room for an answer within '{name}' ({limit}); "
                    f"it must be below {limit}",
                    param=BUDGET_FIELD,
                )
            return
