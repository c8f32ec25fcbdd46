"""Settings schema: one YAML file plus ``WARMROUTE_*`` environment overrides.

Environment variables win over the file. Nested fields use a double underscore:
``WARMROUTE_ROUTING__POLICY=least_loaded``; lists take JSON (``WARMROUTE_BACKENDS='[...]'``).
Settings are loaded once (``load_settings``) and passed down; nothing reads them at import time.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict


class Dialect(StrEnum):
    """The engine kind; what the gateway knows per kind is one entry of backends/dialects.py."""

    VLLM = "vllm"
    SGLANG = "sglang"
    LLAMACPP = "llamacpp"
    OPENAI = "openai"


class Effort(StrEnum):
    """``reasoning_effort`` values: OpenAI's, plus the two vLLM also accepts."""

    NONE = "none"
    MINIMAL = "minimal"
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"
    XHIGH = "xhigh"
    MAX = "max"


class ReasoningFields(StrEnum):
    """Which reasoning field(s) a client receives, whatever the engine emits."""

    BOTH = "both"
    REASONING = "reasoning"  # vLLM's current spelling
    REASONING_CONTENT = "reasoning_content"  # SGLang, llama.cpp, older vLLM, DeepSeek's API


class BudgetEnforcement(StrEnum):
    AUTO = "auto"  # native on vllm/sglang/llamacpp, by the gateway on openai
    NATIVE = "native"
    GATEWAY = "gateway"


class PolicyName(StrEnum):
    AFFINITY = "affinity"
    TTFT = "ttft"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


DEFAULT_CONSISTENCY_PROMPT = "List the first five planets of the solar system, in order, on one line."

#: An engine command: a string runs through ``/bin/sh -c``; a list is an argv run as it is.
Command = str | tuple[str, ...]


def _check_command(v: Command | None) -> Command | None:
    if v is not None and not (v.strip() if isinstance(v, str) else v and all(v)):
        raise ValueError("must be a non-empty string (run by /bin/sh -c) or a non-empty list (argv)")
    return v


class CanaryCheckConfig(_Section):
    """One greedy question asked before a backend takes traffic (and after every outage).

    Ask with ``messages`` (``/v1/chat/completions``) or ``prompt`` (``/v1/completions``). With ``expect``
    the answer must contain it (case-insensitive); with ``expect_regex`` it must match (``re.search``).
    With neither it is a consistency check: asked twice, both answers must be equal, non-empty and not
    one token repeated.
    """

    name: str = Field(
        min_length=1,
        pattern=r"^[A-Za-z0-9_.:-]+$",
        description="The check's name: a metric label and log field",
    )
    messages: tuple[dict[str, Any], ...] | None = Field(
        default=None, description="Chat messages to ask (/v1/chat/completions); or give prompt"
    )
    prompt: str | None = Field(default=None, description="A prompt to complete (/v1/completions)")
    expect: str | None = Field(
        default=None, min_length=1, description="The answer must contain this (case-insensitive)"
    )
    expect_regex: str | None = Field(
        default=None, min_length=1, description="The answer must match this regular expression (re.search)"
    )
    max_tokens: int = Field(default=16, ge=1, le=4096, description="Tokens the answer may have")
    timeout_s: float | None = Field(
        default=None, gt=0, description="Deadline of this check; default canary.timeout_s"
    )

    @model_validator(mode="after")
    def _one_question_one_expectation(self) -> CanaryCheckConfig:
        if (self.messages is None) == (self.prompt is None):
            raise ValueError("give exactly one of messages or prompt")
        if self.expect is not None and self.expect_regex is not None:
            raise ValueError("give at most one of expect or expect_regex")
        if self.expect_regex is not None:
            try:
                re.compile(self.expect_regex)
            except re.error as exc:
                raise ValueError(f"expect_regex does not compile: {exc}") from exc
        return self


class CanaryConfig(_Section):
    """Admission checks. The top-level ``canary:`` is the default; a backend's own ``canary:`` replaces it."""

    enabled: bool = Field(default=True, description="False: a backend takes traffic once its health passes")
    consistency: bool = Field(default=True, description="Run the default consistency check first")
    consistency_prompt: str = Field(
        default=DEFAULT_CONSISTENCY_PROMPT, min_length=1, description="Asked twice by the consistency check"
    )
    max_tokens: int = Field(default=16, ge=2, le=4096, description="Of the default consistency check")
    checks: tuple[CanaryCheckConfig, ...] = Field(default=(), description="Knowledge questions, in order")
    needle_tokens: tuple[int, ...] = Field(
        default=(), description="Long-context needle checks at about these prompt lengths (tokens)"
    )
    timeout_s: float = Field(default=30.0, gt=0, description="Deadline of each check")
    needle_timeout_s: float = Field(default=300.0, gt=0, description="Deadline of each needle check")
    retry_s: float = Field(default=60.0, ge=0, description="After a failed canary, try again this much later")
    extra_body: dict[str, Any] = Field(
        default_factory=dict, description="Merged into every canary request (e.g. chat_template_kwargs)"
    )

    @model_validator(mode="after")
    def _valid_checks(self) -> CanaryConfig:
        names = [c.name for c in self.checks] + [f"needle-{n}" for n in self.needle_tokens]
        if self.consistency:
            names.append("consistency")
        if len(names) != len(set(names)):
            raise ValueError(f"canary check names must be unique: {names}")
        if any(n < 64 for n in self.needle_tokens):
            raise ValueError("needle_tokens must each be >= 64")
        return self


class RestartConfig(_Section):
    """When a managed engine is restarted, and when the gateway stops trying."""

    grace_s: float = Field(default=10.0, ge=0, description="An outage must last this long before a restart")
    backoff_initial_s: float = Field(default=1.0, ge=0, description="Wait before the 2nd restart in a window")
    backoff_max_s: float = Field(default=60.0, ge=0, description="Doubling stops here")
    max_restarts: int = Field(default=5, ge=0, description="Restarts allowed per window; then give up")
    window_s: float = Field(default=600.0, gt=0, description="The window max_restarts counts over")

    @model_validator(mode="after")
    def _ordered(self) -> RestartConfig:
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError("backoff_initial_s must not exceed backoff_max_s")
        return self


class ManagedConfig(_Section):
    """An engine the gateway starts as a child process (in a process group of its own) and looks after."""

    command: Command = Field(description="`vllm serve ...` (a string: /bin/sh -c) or an argv list")
    stop_command: Command | None = Field(
        default=None, description="Run to stop it; default SIGTERM to its process group, SIGKILL later"
    )
    env: dict[str, str] = Field(default_factory=dict, description="Added to the gateway's environment")
    cwd: str | None = Field(default=None, description="Working directory; default the gateway's")
    start_timeout_s: float = Field(default=600.0, gt=0, description="From start to a passing health probe")
    stop_timeout_s: float = Field(default=30.0, gt=0, description="From stop request to SIGKILL")
    detached: bool = Field(
        default=False,
        description="The command returns once the engine runs elsewhere (docker start): exit 0 is no outage",
    )
    log_lines: int = Field(default=200, ge=1, le=100_000, description="Last output lines kept")
    restart: RestartConfig = RestartConfig()
    # On demand (llama-swap's model zoo): started by the first request for its models, not at gateway start.
    on_demand: bool = Field(default=False, description="Start on the first request instead of at start-up")
    idle_ttl_s: float | None = Field(
        default=None,
        gt=0,
        description="On demand: stopped after this long without a request (llama-swap ttl)",
    )
    group: str | None = Field(
        default=None,
        description="On demand: an exclusive group from top-level `groups` (engines sharing a GPU)",
    )

    _command = field_validator("command", "stop_command")(_check_command)

    @model_validator(mode="after")
    def _detached_needs_stop(self) -> ManagedConfig:
        if self.detached and self.stop_command is None:
            raise ValueError("detached engines need a stop_command (the gateway holds no process to signal)")
        return self

    @model_validator(mode="after")
    def _on_demand_keys(self) -> ManagedConfig:
        if not self.on_demand and (self.idle_ttl_s is not None or self.group is not None):
            raise ValueError("idle_ttl_s and group apply to on_demand engines only (set on_demand: true)")
        return self


class GroupConfig(_Section):
    """Engines that exclude each other (they share a GPU or a box): llama-swap's `swap: true` group."""

    max_running: int = Field(default=1, ge=1, description="Members running (or starting, stopping) at once")
    min_residency_s: float = Field(
        default=0.0, ge=0, description="A started member is not swapped out before this (no thrashing)"
    )


class OnDemandConfig(_Section):
    """Requests that wait for an on-demand engine to start."""

    max_waiting: int = Field(default=64, ge=1, description="Per model; beyond it: 503 with Retry-After")
    wait_timeout_s: float = Field(default=900.0, gt=0, description="A waiting request gives up after this")
    retry_after_s: float = Field(default=5.0, gt=0, description="Retry-After of a full queue's 503")
    keepalive_s: float = Field(default=5.0, gt=0, description="SSE comment interval while a stream waits")
    hold_header: bool = Field(
        default=False, description="Honour `x-warmroute-hold: <seconds>` from keys trusted to hold"
    )
    max_hold_s: float = Field(default=86_400.0, gt=0, description="Longest hold a request header may ask")
    hold_clients: list[str] = Field(
        default_factory=list,
        description="Client key names (auth.client_keys) trusted to hold; empty: every authenticated client",
    )


class AdmissionClassConfig(_Section):
    """One priority class of admission: its bounded queue and how long a request may wait in it."""

    max_queued: int = Field(default=256, ge=1, description="Waiting requests of this class, all backends")
    timeout_s: float = Field(default=60.0, gt=0, description="A waiting request gets a 503 after this")
    retry_after_s: float = Field(default=2.0, gt=0, description="Retry-After of this class's 503s")
    headroom: int = Field(
        default=0, ge=0, description="Slots of each backend this class leaves free for higher classes"
    )
    preemptible: bool = Field(
        default=False,
        description="A streamed chat completion of this class may be paused (its engine request aborted) "
        "for a waiting request of a higher class, and resumed as a continuation of the same stream",
    )


def _default_classes() -> dict[str, AdmissionClassConfig]:
    return {
        "interactive": AdmissionClassConfig(timeout_s=30.0),
        "standard": AdmissionClassConfig(),
        "batch": AdmissionClassConfig(max_queued=1024, timeout_s=600.0, retry_after_s=10.0),
    }


class AdmissionConfig(_Section):
    """Admission per backend: the gateway sends an engine only ``max_in_flight`` requests and holds the rest,
    taking the next by priority class, then by fair share of tokens among the class's clients."""

    enabled: bool = Field(default=False, description="Queue requests in the gateway, per backend")
    max_in_flight: int = Field(default=8, ge=1, description="Requests each backend runs at once (default)")
    backends: dict[str, int] = Field(
        default_factory=dict, description="Per backend id: its own max_in_flight"
    )
    classes: dict[str, AdmissionClassConfig] = Field(
        default_factory=_default_classes,
        description="Priority classes, highest first (the order written is the order served)",
    )
    default_class: str = Field(default="standard", description="The class of a request without one")
    clients: dict[str, str] = Field(
        default_factory=dict, description="Client key name (auth.client_keys) -> its class"
    )
    class_header_clients: list[str] = Field(
        default_factory=list,
        description="Client key names trusted to pick a class with `x-warmroute-class: <name>`",
    )
    default_max_tokens: int = Field(
        default=256, ge=1, description="Completion tokens estimated for a request without max_tokens"
    )
    keepalive_s: float = Field(default=5.0, gt=0, description="SSE comment interval while a stream waits")
    engine_priority: list[str] = Field(
        default_factory=list,
        description="Backend ids that schedule by priority (vLLM --scheduling-policy priority): "
        "their requests carry `priority: <class rank>` (0 first)",
    )

    @model_validator(mode="after")
    def _classes_known(self) -> AdmissionConfig:
        names = set(self.classes)
        if not names:
            raise ValueError("admission.classes: at least one class")
        unknown = sorted({self.default_class, *self.clients.values()} - names)
        if unknown:
            raise ValueError(f"admission: unknown classes {unknown} (declared: {', '.join(self.classes)})")
        return self


class KeyQuota(_Section):
    """One client key's quota: each limit unset is no limit. A window opens with the key's first request
    after the last one closed and lasts ``quotas.window_s``."""

    requests_per_window: int | None = Field(
        default=None, ge=1, description="Requests admitted per window (RPM with the default window)"
    )
    tokens_per_window: int | None = Field(
        default=None,
        ge=1,
        description="Prompt + completion tokens per window (TPM), charged from usage once answered; a "
        "request is admitted while the window has tokens left",
    )
    concurrent: int | None = Field(default=None, ge=1, description="Requests in flight at once")


class QuotasConfig(_Section):
    """Quotas per client key (auth.client_keys names): over one -> 429 with Retry-After and x-ratelimit-*
    headers. Shared through Redis when ``redis.url`` is set; in this process's memory otherwise."""

    keys: dict[str, KeyQuota] = Field(
        default_factory=dict, description="Client key name -> its quota; a key not listed has none"
    )
    window_s: float = Field(default=60.0, gt=0, description="Length of a quota window (60: per minute)")


class BreakerConfig(_Section):
    """Circuit breaker per backend, fed by connect errors, 5xx and timeouts on real traffic (a 5xx is judged
    with the request's other attempt first: gateway/blame.py)."""

    failure_threshold: int = Field(default=5, ge=1, description="Consecutive failures that open it")
    open_s: float = Field(default=10.0, gt=0, description="First open period; then one trial request")
    open_max_s: float = Field(default=300.0, gt=0, description="A failed trial doubles the period up to this")

    @model_validator(mode="after")
    def _ordered(self) -> BreakerConfig:
        if self.open_s > self.open_max_s:
            raise ValueError("open_s must not exceed open_max_s")
        return self


class GuardAction(StrEnum):
    """What a tripped output guard does; values are metric labels."""

    RECORD = "record"  # count it and log it; the stream goes on
    END = "end"  # end that stream cleanly: an SSE error event, then [DONE]


class GuardConfig(_Section):
    """Output-health guard on proxied responses: finish_reason counts, degenerate repetition in streams."""

    enabled: bool = Field(default=True, description="False: no finish_reason counts, no repetition scan")
    repeat_count: int = Field(
        default=32, ge=2, description="A unit of content deltas repeated this many times in a row trips it"
    )
    max_period: int = Field(default=4, ge=1, le=16, description="Longest repeated unit, in deltas")
    action: GuardAction = Field(
        default=GuardAction.RECORD,
        description="record: log and count; end: also end the stream with an error",
    )


class VisionMode(StrEnum):
    """What a backend does with ``image_url`` parts (see gateway/vision.py)."""

    NATIVE = "native"  # forwarded as the client sent them: the engine runs its own vision tower
    EMBEDS = "embeds"  # turned into ``image_embeds`` parts by the vision sidecar (vLLM --enable-mm-embeds)
    NONE = "none"  # text only: image requests go elsewhere, or are refused with a 400


class KvEventsConfig(_Section):
    """An engine's KV cache events (vLLM's and SGLang's ``--kv-events-config``): the gateway subscribes and
    knows which conversations the engine still holds. Needs the ``kv`` extra (pyzmq, msgpack)."""

    endpoint: str = Field(
        pattern=r"^(tcp|ipc)://",
        description="The engine's ZMQ PUB socket, e.g. tcp://10.0.0.5:5557 (the engine binds tcp://*:5557)",
    )
    replay_endpoint: str | None = Field(
        default=None,
        pattern=r"^(tcp|ipc)://",
        description="Its replay (ROUTER) socket: batches missed after a gap or reconnect are asked for "
        "there; without it a gap makes what the engine holds unknown until each conversation's next turn",
    )
    topic: str = Field(default="", description="The topic it publishes on (its `topic`; default none)")
    replay_timeout_s: float = Field(
        default=2.0, gt=0, description="How long a replay may take before the gap is given up on"
    )


class BackendConfig(_Section):
    """One engine (a ``backends[]`` entry); several with one model name are a pool."""

    id: str = Field(
        min_length=1, pattern=r"^[A-Za-z0-9_.:-]+$", description="Unique name: a metric label, admin API id"
    )
    url: str = Field(description="Server root, e.g. http://10.0.0.5:8000 (a trailing /v1 is removed)")
    models: tuple[str, ...] = Field(min_length=1, description="Model names it serves (the body's `model`)")
    weight: float = Field(
        default=1.0,
        gt=0,
        allow_inf_nan=False,
        description="Relative capacity: its share of new conversations",
    )
    dialect: Dialect = Field(
        default=Dialect.OPENAI,
        description="Engine kind: how it spells thinking budgets and continuations, where it writes "
        "reasoning, which /metrics names it publishes (openai: any engine's), whether it takes image "
        "embeddings",
    )
    native_shapes: tuple[Literal["chat", "completions", "messages", "responses"], ...] | None = Field(
        default=None,
        description="Client API shapes it serves itself; a request of another shape is translated to chat "
        "for it. Default: its dialect's (a build without /v1/messages, a simulator with a shape off: say so)",
    )
    api_key: str | None = Field(default=None, description="Sent upstream instead of the client's key")
    forward_client_key: bool = Field(
        default=False, description="Forward a gateway client key (auth.client_keys) to this engine"
    )
    managed: ManagedConfig | None = Field(default=None, description="Started and restarted by the gateway")
    canary: CanaryConfig | None = Field(default=None, description="Replaces the top-level canary section")
    budget_enforcement: BudgetEnforcement = Field(
        default=BudgetEnforcement.AUTO, description="Who caps thinking: the engine, or the gateway"
    )
    vision: VisionMode = Field(
        default=VisionMode.NATIVE,
        description="native: images forwarded as sent (what the engine would get without a gateway); "
        "embeds: images encoded by the vision sidecar; none: never sent image requests",
    )
    kv_events: KvEventsConfig | None = Field(
        default=None,
        description="Subscribe to its KV cache events (routing.policy ttft): an evicted conversation is "
        "placed as cold",
    )
    strip_volatile: bool | None = Field(
        default=None,
        description="Strip routing.volatile_prefixes system blocks from what this engine is sent. None: "
        "unless its dialect drops the billing block itself (vLLM does, on /v1/messages and chat); false: "
        "forward the client's bytes",
    )

    @field_validator("url")
    @classmethod
    def _root_url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        v = v.rstrip("/")
        return v.removesuffix("/v1")


#: Reasoning tokens per effort when a client gives an effort and no budget (``none`` must stay 0).
DEFAULT_EFFORT_BUDGETS: dict[Effort, int] = {
    Effort.NONE: 0,
    Effort.MINIMAL: 128,
    Effort.LOW: 512,
    Effort.MEDIUM: 2048,
    Effort.HIGH: 8192,
}

#: Qwen's documented engine-agnostic early stop, closed with the end-of-thinking marker.
DEFAULT_EARLY_STOP = (
    "\n\nConsidering the limited time by the user, I have to give the solution based on the thinking "
    "directly now.\n</think>\n\n"
)


class ModelConfig(_Section):
    """Thinking budgets of one served model (a model absent from ``models:`` gets these defaults)."""

    thinks: bool = Field(
        default=True, description="False: budgets are moot; the gateway's fields are dropped"
    )
    default_budget: int | None = Field(default=None, ge=0, description="When the client asks for none")
    max_budget: int | None = Field(default=None, ge=0, description="A larger requested budget is 400")
    effort_budgets: dict[Effort, int] = Field(
        default_factory=lambda: dict(DEFAULT_EFFORT_BUDGETS),
        description="reasoning_effort -> budget in tokens, when a client gives an effort and no budget",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ModelConfig:
        if self.effort_budgets.get(Effort.NONE, 0) != 0:
            raise ValueError("effort_budgets.none must be 0")
        if any(v < 0 for v in self.effort_budgets.values()):
            raise ValueError("effort_budgets must be >= 0")
        if self.max_budget is not None:
            over = {k.value: v for k, v in self.effort_budgets.items() if v > self.max_budget}
            if over or (self.default_budget or 0) > self.max_budget:
                raise ValueError(f"default_budget and effort_budgets must not exceed max_budget ({over})")
        return self


class ThinkingConfig(_Section):
    """Per-request thinking budgets (``thinking_budget`` / ``reasoning_effort``), see gateway/budgets.py."""

    reasoning_fields: ReasoningFields = Field(
        default=ReasoningFields.BOTH, description="Which reasoning field(s) the client receives"
    )
    budget_header: str = Field(
        default="x-thinking-budget", min_length=1, description="Request header carrying a thinking budget"
    )
    effort_header: str = Field(
        default="x-reasoning-effort", min_length=1, description="Request header carrying a reasoning effort"
    )
    early_stop: str = Field(default=DEFAULT_EARLY_STOP, min_length=1, description="Ends a capped thought")
    open_marker: str = Field(default="<think>\n", description="Opens the thought in a continued turn")
    close_marker: str = Field(
        default="\n</think>\n\n", description="Closes a finished thought before a continued answer"
    )


#: Session identity sources, in order (``routing.session_sources``): Claude Code, Codex (both spellings),
#: OpenCode, the configured header, OpenAI's ``prompt_cache_key``, Claude Code's ``metadata.user_id``.
DEFAULT_SESSION_SOURCES = (
    "header:x-claude-code-session-id",
    "header:session_id",
    "header:session-id",
    "header:x-session-affinity",
    "session_header",
    "body:prompt_cache_key",
    "body-session:metadata.user_id",
)
DEFAULT_VOLATILE_PREFIXES = ("x-anthropic-billing-header:",)
_HEADER_NAME = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_SESSION_SOURCE = re.compile(
    rf"session_header|header:{_HEADER_NAME}|body(-session)?:[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*"
)


class RoutingConfig(_Section):
    """Where each request goes: the policy and its knobs."""

    policy: PolicyName = Field(
        default=PolicyName.TTFT,
        description="ttft (default: by expected time to first token), affinity (pins and in-flight counts "
        "only), least_loaded and round_robin (benchmark baselines)",
    )
    session_header: str = Field(
        default="x-session-id",
        min_length=1,
        description="A request header whose value is the conversation key (the `session_header` entry of "
        "`session_sources`)",
    )
    session_sources: tuple[str, ...] = Field(
        default=DEFAULT_SESSION_SOURCES,
        description="Where a client names its session, in order; the first present wins and keys the "
        "conversation instead of its head. `header:NAME` (a request header), `body:PATH` (a string field "
        "of the body, dotted path), `body-session:PATH` (the session part of a Claude Code user id there: "
        "`user_…_account_…_session_<id>`, or a JSON string's `session_id`), `session_header` "
        "(`header:` + routing.session_header). Empty: heads only",
    )
    subagent_header: str | None = Field(
        default="x-claude-code-agent-id",
        min_length=1,
        description="A request header naming a subagent within its session: a session-keyed request that "
        "sends it gets a key of its own (session + agent id). None: subagents share their session's key",
    )
    volatile_prefixes: tuple[str, ...] = Field(
        default=DEFAULT_VOLATILE_PREFIXES,
        description="System text blocks starting with one of these change every request (Claude Code's "
        "billing block, with a per-request nonce): left out of conversation keys, and stripped from what "
        "is forwarded to backends whose `strip_volatile` says so",
    )
    affinity_ttl_s: float = Field(default=3600.0, gt=0, description="A pin unused this long is forgotten")
    affinity_max_entries: int = Field(
        default=500_000, ge=1, description="Pins kept in memory (LRU); about 128 bytes each"
    )
    spill_factor: float = Field(
        default=2.0, gt=1, description="Spill when the pinned load exceeds this times the others' mean"
    )
    spill_min_in_flight: int = Field(
        default=8,
        ge=1,
        description="Never spill a backend with fewer requests in flight than this (raise it towards the "
        "engine's batch size: a spilled turn re-reads its whole prompt elsewhere)",
    )
    repin_on_spill: bool = Field(default=False, description="Move the pin when a turn spills")
    active_window_s: float = Field(
        default=10.0,
        gt=0,
        description="ttft policy: a conversation loads its backend this long after its request",
    )
    load_share: float = Field(
        default=2.0,
        ge=0,
        description="ttft policy: turns of load each active conversation is expected to bring",
    )
    stay_margin: float = Field(
        default=0.6, ge=0, description="ttft policy: leave the pin only when elsewhere is this much cheaper"
    )
    speed_half_life_s: float = Field(
        default=15.0, gt=0, description="ttft policy: half-life of the learned engine speeds"
    )
    completion_key_chars: int = Field(
        default=512, ge=16, description="Leading prompt characters that key a /v1/completions conversation"
    )
    response_owner_ttl_s: float = Field(
        default=86400.0,
        gt=0,
        description="How long the engine that produced a /v1/responses answer is remembered as the owner "
        "of its id (previous_response_id, GET/DELETE/cancel/input_items go there only)",
    )

    @field_validator("session_sources")
    @classmethod
    def _sources(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        bad = [s for s in v if not _SESSION_SOURCE.fullmatch(s)]
        if bad:
            raise ValueError(
                f"unknown session source(s) {bad}: use header:NAME, body:PATH, body-session:PATH or "
                "session_header"
            )
        return v

    @field_validator("session_header", "subagent_header")
    @classmethod
    def _header_name(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(_HEADER_NAME, v):
            raise ValueError(f"{v!r} is not an HTTP header name")
        return v

    @field_validator("volatile_prefixes")
    @classmethod
    def _prefixes(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(not p for p in v):
            raise ValueError("an empty prefix would make every system block volatile")
        return v


class TimeoutConfig(_Section):
    """Clocks on each upstream attempt."""

    connect_s: float = Field(default=5.0, gt=0, description="Connecting to an engine")
    first_byte_s: float = Field(default=600.0, gt=0, description="Upstream response headers")
    read_s: float = Field(default=300.0, gt=0, description="Longest silence between streamed chunks")
    request_s: float = Field(default=1800.0, gt=0, description="Whole request, stream included")


class LimitsConfig(_Section):
    """What a client request may be, and the upstream pool."""

    max_body_bytes: int = Field(
        default=32 * 1024 * 1024, ge=1024, description="Largest client request body (then 413)"
    )
    max_json_values: int = Field(
        default=500_000,
        ge=1000,
        description="JSON values one request body may hold, counted (',', '{' and '[') before parsing; "
        "more is 413. Bounds what parsing a body can cost: ~150 bytes per value at worst",
    )
    max_held_body_bytes: int = Field(
        default=256 * 1024 * 1024,
        ge=1024,
        description="Request-body bytes one worker holds at once, over all requests in flight (read, "
        "parsed, forwarded); a body that would pass it is refused with 503 server_busy and Retry-After",
    )
    max_connections: int = Field(default=1024, ge=1, description="Upstream connection pool size")
    body_read_timeout_s: float = Field(
        default=30.0, gt=0, description="Longest silence while a client sends a request body (then 408)"
    )
    body_deadline_s: float = Field(
        default=30.0,
        gt=0,
        description="A request body must be complete this long after its head, plus 1 s per "
        "body_min_bytes_per_s bytes received (a minimum rate); then 408",
    )
    body_min_bytes_per_s: int = Field(
        default=16384, ge=1, description="The rate that earns a body more time than body_deadline_s"
    )


class UpstreamConfig(_Section):
    """The proxy's own HTTP/1.1 client. The pool size per engine stays ``limits.max_connections``."""

    idle_timeout_s: float = Field(
        default=4.0,
        gt=0,
        description="Close a pooled connection idle this long; keep it below the engines' keep-alive "
        "(uvicorn, so vLLM and SGLang: 5 s), or a request can meet a connection the engine is closing",
    )
    pool_timeout_s: float = Field(
        default=30.0, gt=0, description="Longest wait for a free connection when all of an engine's are busy"
    )
    max_response_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="Largest engine response head; past it the connection is aborted",
    )
    max_response_headers: int = Field(
        default=200, ge=8, description="Header fields in an engine response; more aborts the connection"
    )


class HealthConfig(_Section):
    """Health probes of every backend (and the vision sidecar)."""

    interval_s: float = Field(default=5.0, gt=0, description="Time between probes of one backend")
    timeout_s: float = Field(default=2.0, gt=0, description="Deadline of one probe")
    path: str = Field(default="/health", description="Probed path (GET /v1/models when it answers 404)")
    fail_threshold: int = Field(default=2, ge=1, description="Consecutive failures that mark a backend down")


class ServerConfig(_Section):
    """The gateway's own listener and worker processes."""

    host: str = Field(default="127.0.0.1", description="Address of the API listener")
    port: int = Field(default=8080, ge=0, le=65535, description="Port of the API listener")
    workers: int = Field(default=1, ge=1, description="Worker processes; more than 1 needs redis.url")
    log_level: str = Field(default="info", description="debug, info, warning, error")
    # What one client may do to the server (per worker process); see gateway/server_protocol.py.
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="From accept (or the next request's first byte) to a complete head"
    )
    max_header_bytes: int = Field(
        default=64 * 1024, ge=1024, description="Request line plus headers; more is refused with 431"
    )
    max_headers: int = Field(default=100, ge=8, description="Header fields per request; more is 431")
    max_connections: int = Field(
        default=2048,
        ge=1,
        description="Open client connections per worker; one more is answered 503 and closed at once "
        "(keep it below the process's open-file limit minus the upstream pool)",
    )
    shutdown_grace_s: float = Field(
        default=30.0, ge=0, description="On SIGTERM, how long requests in flight may take to finish"
    )
    hide_engine_errors: bool = Field(
        default=False,
        description="Answer an engine's 5xx with a generic error of the same status instead of its body "
        "(which can carry internal host names, paths, tracebacks)",
    )


class RedisConfig(_Section):
    """Shared state for several workers or replicas. ``url: null`` keeps state in memory.

    If Redis is unreachable the gateway routes from local state, reports itself degraded and reconnects in
    the background with exponential backoff (``reconnect_min_s`` doubling up to ``reconnect_max_s``).
    """

    url: str | None = Field(default=None, description="e.g. redis://127.0.0.1:6379/0")
    prefix: str = Field(
        default="warmroute:",
        min_length=1,
        description="Prefix of every key; with Redis Cluster use a hash tag such as '{warmroute}:'",
    )
    timeout_s: float = Field(
        default=0.1,
        gt=0,
        le=10,
        description="Pool wait, connect and read timeout of one round trip; past it, route locally",
    )
    lease_ttl_s: float = Field(
        default=10.0, gt=0, description="A dead replica's in-flight counts vanish this long after it stops"
    )
    heartbeat_s: float = Field(
        default=1.0, gt=0, description="How often an idle replica republishes its in-flight counts"
    )
    reconnect_min_s: float = Field(default=0.2, gt=0, description="First reconnect delay after an outage")
    reconnect_max_s: float = Field(default=5.0, gt=0, description="The doubling reconnect delay stops here")
    max_connections: int = Field(default=32, ge=1, description="Connection pool size per worker")

    @model_validator(mode="after")
    def _lease_outlives_heartbeats(self) -> RedisConfig:
        if self.heartbeat_s * 2 > self.lease_ttl_s:
            raise ValueError(
                "lease_ttl_s must be at least twice heartbeat_s (a late heartbeat must not expire)"
            )
        if self.reconnect_min_s > self.reconnect_max_s:
            raise ValueError("reconnect_min_s must not exceed reconnect_max_s")
        return self


class AdminConfig(_Section):
    """The admin API under /admin (gateway/admin). Without a token it is served only on loopback."""

    token: SecretStr | None = Field(
        default=None, description="Bearer token for /admin (env WARMROUTE_ADMIN__TOKEN)"
    )
    token_file: str | None = Field(default=None, description="Read the token from this file instead")
    port: int | None = Field(
        default=None, ge=1, le=65535, description="Serve /admin only on this port (and only /admin there)"
    )
    host: str | None = Field(
        default=None, description="Admin listener address (with port only); default server.host"
    )
    allow_managed: bool = Field(
        default=False,
        description="Allow POST /admin/backends with a `managed` block (it runs a command on this host)",
    )
    sync_interval_s: float = Field(
        default=1.0, gt=0, description="With Redis: how often replicas poll for backend changes"
    )
    max_body_bytes: int = Field(
        default=256 * 1024, ge=1024, description="Largest admin request body (then 413)"
    )
    protect_metrics: bool = Field(
        default=False, description="/metrics needs the admin token too (it names client keys and backends)"
    )
    protect_readyz_detail: bool = Field(
        default=False,
        description="/readyz's detail (exits, last output lines, canary answers) only with the admin token; "
        "without it even loopback callers (a same-host reverse proxy) get the short form",
    )

    @model_validator(mode="after")
    def _coherent(self) -> AdminConfig:
        if self.host is not None and self.port is None:
            raise ValueError(
                "host is set without port: without a port of its own /admin is served by the API listener "
                "(server.host), not on admin.host; set admin.port too, or drop admin.host"
            )
        protected = [n for n in ("protect_metrics", "protect_readyz_detail") if getattr(self, n)]
        if (
            protected
            and self.token_file is None
            and (self.token is None or not self.token.get_secret_value())
        ):
            raise ValueError(
                f"{' and '.join(protected)} need{'s' if len(protected) == 1 else ''} the admin token, and "
                "none is set: set admin.token (WARMROUTE_ADMIN__TOKEN) or admin.token_file"
            )
        return self

    def secret(self) -> str | None:
        """The configured token (the file wins), stripped; None when none is configured."""
        if self.token_file is not None:
            try:
                text = Path(self.token_file).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"admin.token_file {self.token_file}: {exc.strerror}") from exc
            return text or None
        return (self.token.get_secret_value() or None) if self.token is not None else None


class ClientKey(_Section):
    """One client API key."""

    name: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.:-]+$",
        description="The client's name: a metric label, what on_demand.hold_clients lists",
    )
    key: SecretStr = Field(description="The bearer token this client sends")


class AuthConfig(_Section):
    """Client API keys for /v1/*. None configured: /v1 is open (as before)."""

    client_keys: tuple[ClientKey, ...] = Field(
        default=(), description="[{name, key}]; env WARMROUTE_AUTH__CLIENT_KEYS='[...]' (JSON)"
    )
    client_keys_file: str | None = Field(
        default=None, description="More keys, one `name key` pair per line (# comments)"
    )

    @model_validator(mode="after")
    def _unique(self) -> AuthConfig:
        names = [k.name for k in self.client_keys]
        keys = {k.key.get_secret_value() for k in self.client_keys}
        if len(set(names)) != len(names) or len(keys) != len(names) or "" in keys:
            raise ValueError("client key names and keys must be unique and non-empty")
        return self

    def keys(self) -> dict[str, str]:
        """key -> client name, from the list and the file; duplicate names or keys are a ConfigError."""
        pairs = [(k.name, k.key.get_secret_value()) for k in self.client_keys]
        if self.client_keys_file is not None:
            try:
                text = Path(self.client_keys_file).read_text()
            except OSError as exc:
                raise ConfigError(f"auth.client_keys_file {self.client_keys_file}: {exc.strerror}") from exc
            for n, line in enumerate(text.splitlines(), 1):
                fields = line.split("#", 1)[0].split()
                if not fields:
                    continue
                if len(fields) != 2:
                    raise ConfigError(f"auth.client_keys_file line {n}: expected `name key`")
                pairs.append((fields[0], fields[1]))
        names = [n for n, _ in pairs]
        out = {key: name for name, key in pairs}
        if len(set(names)) != len(names) or len(out) != len(pairs) or "" in out:
            raise ConfigError("auth: client key names and keys must be unique and non-empty")
        return out


class SidecarConfig(_Section):
    """The CPU vision sidecar (sidecars/vision/) that encodes images for ``vision: embeds`` backends.

    ``url`` is where it listens: an external sidecar, or the one the gateway starts itself when ``managed``
    is given (the command must make it listen there). A managed sidecar has the managed engines' lifecycle:
    health probes (the top-level ``health`` section, path ``/health``), restarts with backoff and a cap, the
    last exit cause and output lines, stopped on shutdown.
    """

    url: str = Field(description="Sidecar root, e.g. http://127.0.0.1:8090")
    managed: ManagedConfig | None = Field(default=None, description="Started and restarted by the gateway")
    timeout_s: float = Field(
        default=120.0, gt=0, description="One encode, the sidecar's queue included; past it: 503"
    )
    connect_timeout_s: float = Field(default=2.0, gt=0, description="Connecting to the sidecar")
    max_parallel: int = Field(
        default=4, ge=1, description="Encodes in flight from this gateway process; more wait their turn"
    )

    @field_validator("url")
    @classmethod
    def _root_url(cls, v: str) -> str:
        return BackendConfig._root_url(v)  # the same rule as a backend's


class Settings(BaseSettings):
    """The whole configuration: one YAML file plus ``WARMROUTE_*`` environment overrides."""

    model_config = SettingsConfigDict(
        env_prefix="WARMROUTE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    backends: tuple[BackendConfig, ...] = Field(default=(), description="The engines the gateway routes to")
    routing: RoutingConfig = RoutingConfig()
    timeouts: TimeoutConfig = TimeoutConfig()
    limits: LimitsConfig = LimitsConfig()
    health: HealthConfig = HealthConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    server: ServerConfig = ServerConfig()
    redis: RedisConfig = RedisConfig()
    canary: CanaryConfig = CanaryConfig()
    breaker: BreakerConfig = BreakerConfig()
    thinking: ThinkingConfig = ThinkingConfig()
    models: dict[str, ModelConfig] = Field(default_factory=dict, description="Per served model")
    guard: GuardConfig = GuardConfig()
    admin: AdminConfig = AdminConfig()
    auth: AuthConfig = AuthConfig()
    groups: dict[str, GroupConfig] = Field(default_factory=dict, description="Exclusive on-demand groups")
    on_demand: OnDemandConfig = OnDemandConfig()
    admission: AdmissionConfig = AdmissionConfig()
    quotas: QuotasConfig = QuotasConfig()
    sidecar: SidecarConfig | None = Field(default=None, description="Vision sidecar for embeds backends")

    @model_validator(mode="after")
    def _groups_declared(self) -> Settings:
        for b in self.backends:
            group = b.managed.group if b.managed is not None else None
            if group is not None and group not in self.groups:
                declared = ", ".join(sorted(self.groups)) or "none"
                raise ValueError(f"backend {b.id!r}: group {group!r} is not declared in groups ({declared})")
        return self

    @model_validator(mode="after")
    def _admin_port_is_its_own(self) -> Settings:
        if self.admin.port is not None and self.admin.port == self.server.port:
            raise ValueError(
                f"admin.port {self.admin.port} is also server.port: the admin listener needs a port of its "
                "own (a connection is told apart by the address it arrived on)"
            )
        return self

    @model_validator(mode="after")
    def _unique_ids(self) -> Settings:
        seen: set[str] = set()
        for b in self.backends:
            if b.id in seen:
                raise ValueError(f"duplicate backend id {b.id!r}")
            seen.add(b.id)
        return self

    @model_validator(mode="after")
    def _one_manager_per_engine(self) -> Settings:
        managed = [b.id for b in self.backends if b.managed is not None]
        if managed and self.server.workers > 1:
            raise ValueError(
                f"managed backends {managed} need server.workers: 1 (every worker would start its own engine)"
            )
        return self

    @model_validator(mode="after")
    def _embeds_need_a_sidecar(self) -> Settings:
        embeds = [b.id for b in self.backends if b.vision is VisionMode.EMBEDS]
        if embeds and self.sidecar is None:
            raise ValueError(f"backends {embeds} have vision: embeds, which needs a sidecar section")
        if self.sidecar is not None and self.sidecar.managed is not None and self.server.workers > 1:
            raise ValueError("a managed sidecar needs server.workers: 1 (every worker would start its own)")
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment first: it overrides what the YAML file (passed as init kwargs) says.
        return env_settings, init_settings


class ConfigError(Exception):
    """A configuration that cannot start; the message names the offending field."""


def load_settings(path: str | Path | None = None, **overrides: Any) -> Settings:
    """Read ``path`` (YAML) and the environment into ``Settings``, or raise ``ConfigError``."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        data = loaded or {}
    data.update(overrides)
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from exc


def _describe(exc: ValidationError, path: str | Path | None) -> str:
    where = f" in {path}" if path else ""
    lines = [f"invalid configuration{where}:"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)
