"""The admin API's bodies: pydantic models at the edge, and the source of its OpenAPI document.

Requests forbid unknown fields (a typo is a 422 naming it, not a silent no-op). Responses describe what the
handlers return; fields whose inner shape belongs to another module (lifecycle status, canary results,
engine signals) are plain objects.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BackendPatch(_Request):
    weight: float = Field(gt=0, le=1e6, allow_inf_nan=False, description="New routing weight")


class HoldRequest(_Request):
    duration_s: float = Field(gt=0, le=30 * 86_400, allow_inf_nan=False, description="How long to hold")
    reason: str = Field(default="", max_length=200, description="Shown to the requests the hold refuses")


class ExplainRequest(_Request):
    """Give a conversation ``key`` (as stored: see /admin/pins), or a sample request ``body`` for ``path``;
    the key is then computed exactly as that endpoint computes it (``headers`` may carry a session id)."""

    key: str | None = Field(default=None, min_length=1, max_length=4096)
    model: str | None = Field(default=None, min_length=1, max_length=1024, description="With ``key``")
    #: One of the served API shapes' paths (the explainer knows them: gateway/shapes/table.py).
    path: str = Field(default="/v1/chat/completions", pattern=r"^/v1/[A-Za-z0-9/_.-]+$", max_length=200)
    body: dict[str, Any] | None = None
    headers: dict[str, str] = Field(default_factory=dict, max_length=64)


#: The longest a ``GET /admin/changes`` waits for a change.
MAX_CHANGES_WAIT_S = 30.0


class ChangesQuery(_Request):
    """The query of ``GET /admin/changes``: answer at once if the version is not ``since``, else when it
    moves or after ``wait_s`` seconds, whichever comes first."""

    since: int = Field(default=0, ge=0, description="The version the caller last saw")
    wait_s: float = Field(
        default=0.0, ge=0, le=MAX_CHANGES_WAIT_S, allow_inf_nan=False, description="How long to wait"
    )


class ChangesView(BaseModel):
    """This replica's change version: one more for each backend state change, addition, removal, weight
    change and pin claimed or moved. It starts at 0 with the process; compare it for equality only."""

    version: int


class Problem(BaseModel):
    """OpenAI's error shape: every 4xx/5xx of the admin API."""

    class Detail(BaseModel):
        message: str
        type: str
        param: str | None
        code: str

    error: Detail


class BackendView(BaseModel):
    id: str
    url: str
    models: list[str]
    weight: float
    dialect: str
    source: str = Field(description="config | runtime (added through the admin API)")
    state: str
    reason: str
    routable: bool
    drained: bool
    cordoned: bool
    circuit: str
    probe_failures: int
    in_flight: int = Field(description="Requests in flight from this replica")
    in_flight_shared: int | None = Field(description="All replicas (Redis), None without shared state")
    pinned_conversations: int
    engine_signals: dict[str, Any] = Field(
        description="The engine's /metrics read now (vLLM queue and prefix-cache series) plus the "
        "signals routing keeps for it"
    )
    last_error: str | None = Field(description="Of the last failed health probe")
    last_checked: float | None
    canary: dict[str, Any] | None = Field(description="Last canary run: passed, check_name, answer, at, ...")
    managed: dict[str, Any] | None = Field(description="Managed engine: pid, exits, restarts, last lines")
    on_demand: dict[str, Any] | None = Field(
        default=None, description="On-demand engine: phase, hold, idle time, claims, waiters, last failure"
    )


class BackendList(BaseModel):
    backends: list[BackendView]


class ChangeResult(BaseModel):
    """What a runtime change did, on this replica and for the others."""

    backend: BackendView | None
    propagated: bool | None = Field(
        description="Written to Redis for the other replicas: true; false: Redis failed (or the change acts "
        "on this replica only); null: no Redis configured"
    )
    warnings: list[str] = Field(default_factory=list)


class Removed(BaseModel):
    id: str
    propagated: bool | None = Field(
        description="As for a change: true, false (Redis failed), null (no Redis)"
    )
    in_flight_at_removal: int = Field(description="Requests still running there; they finish on their own")
    models_left_without_backend: list[str]
    connections_closed: int
    warnings: list[str] = Field(default_factory=list)


class HoldResult(BaseModel):
    id: str
    on_demand: dict[str, Any] = Field(description="The engine's on-demand status after the change")
    note: str = "holds are kept by this replica, which runs the engine's scheduler"


class CanaryRun(BaseModel):
    id: str
    passed: bool
    result: dict[str, Any]
    state: str = Field(description="Lifecycle state after the run (an out-of-band run changes no state)")
    note: str


class CandidateView(BaseModel):
    id: str
    state: str
    routable: bool
    in_flight: int
    conversations: int
    weight: float
    load: float
    signals: dict[str, Any]


class CostView(BaseModel):
    """The ttft policy's estimate of one candidate's time to first token, and what it is made of."""

    backend: str
    uncached_tokens: int
    queue_s: float | None  # None: not finite (a backend with no known prefill rate)
    prefill_s: float | None
    load_s: float | None
    total_s: float | None


class Explanation(BaseModel):
    key: str
    model: str | None
    policy: str
    pinned: str | None
    backend: str | None
    reason: str
    pin_action: str
    candidates: list[CandidateView]
    costs: list[CostView] = Field(default_factory=list, description="ttft policy: each candidate's estimate")
    why: list[str] = Field(default_factory=list, description="The decision and the costs it compared")
    note: str


class PinView(BaseModel):
    key: str
    backend: str
    expires_in_s: float | None
    backend_configured: bool = Field(description="False: the next turn re-pins (repin_removed)")


class Forgotten(BaseModel):
    key: str
    backend: str


class AffinityStats(BaseModel):
    store: str
    degraded: bool
    pins: int
    per_backend: dict[str, int]
    decisions: dict[str, int]
    hit_rate: float | None = Field(description="affinity_hit / every decision for a conversation")


class QuotasView(BaseModel):
    enabled: bool = Field(description="A client key has a quota (quotas.keys)")
    window_s: float | None = None
    keys: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Per key: its limits, its window now (requests, tokens, in_flight, reset_s; shared "
        "state when Redis is configured), and counts per outcome (admitted, unchecked, requests, tokens, "
        "concurrent)",
    )


class AdmissionView(BaseModel):
    enabled: bool
    classes: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="Per class, highest first: rank, waiting, max_queued, timeout_s, headroom",
    )
    backends: dict[str, dict[str, int]] = Field(
        default_factory=dict, description="Per backend that admission has seen: running (admitted), capacity"
    )
    clients: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description='Per client key name ("" without a key): requests admitted, queue_full, timeout, left',
    )
