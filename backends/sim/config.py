"""Settings of one simulated engine: speeds, cache shape, output lengths and the initial fault switches.

Leaf module: imports nothing from the package.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_MODEL = "sim-model"
DEFAULT_PREFILL_TPS = 4000.0
DEFAULT_TTFT_BASE_MS = 20.0
DEFAULT_DECODE_TPS = 50.0
DEFAULT_DECODE_SLOWDOWN = 0.05
DEFAULT_CACHE_TOKENS = 200_000
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_RUNNING = 64
SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy values
DEFAULT_MAX_MODEL_LEN = 131_072
DEFAULT_MAX_TOKENS = 16
DEFAULT_ANSWER_TOKENS = (8, 64)
DEFAULT_REASONING_TOKENS = (32, 256)


@dataclass(frozen=True, slots=True)
class Faults:
    """Fault switches. The engine keeps the live copy; these are the values it starts with.

    - ``fail_next``: the next N completion requests answer 500 before any byte.
    - ``die_mid_stream_after``: streamed responses break the connection after K SSE chunks (None: off).
    - ``stall_s``: wall-clock seconds to wait before the first byte (not multiplied by ``time_scale``).
    - ``repeat_token``: decode emits one token repeated up to the length limit (finish_reason ``length``).
    - ``health_fail``: ``/health`` answers 503.
    - ``slow_factor``: multiplies every prefill and decode delay (an engine that slows down mid-run).
    """

    fail_next: int = 0
    die_mid_stream_after: int | None = None
    stall_s: float = 0.0
    repeat_token: bool = False
    health_fail: bool = False
    slow_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.slow_factor <= 0:
            raise ValueError("slow_factor must be > 0")
        if self.fail_next < 0:
            raise ValueError("fail_next must be >= 0")
        if self.die_mid_stream_after is not None and self.die_mid_stream_after < 0:
            raise ValueError("die_mid_stream_after must be >= 0 or None")
        if self.stall_s < 0:
            raise ValueError("stall_s must be >= 0")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated engine.

    Timing (all sleeps are multiplied by ``time_scale``; 0 makes them instant):

    - time to first token = ``ttft_base_ms`` / 1000 + uncached_prompt_tokens / ``prefill_tps``
    - each later token of a stream takes one decode step; with R streams running,
      step = (1 + ``decode_slowdown`` * (R - 1)) / ``decode_tps``,
      i.e. per-stream speed = decode_tps / (1 + decode_slowdown * (R - 1)).
    - ``kv_events_endpoint``: publish KV cache events there (a ZMQ PUB socket bound to it, vLLM's format);
      None: off.
    - ``scheduling_policy``: which waiting request takes the next free running slot, as vLLM's
      ``--scheduling-policy``: ``fcfs``, the oldest; ``priority``, the lowest ``priority`` value of the
      request (then the oldest). As in vLLM, a waiting request never preempts a running one for its slot
      (vLLM preempts only when KV blocks run out, which this simulator does not model), and under
      ``fcfs`` a request with a non-zero ``priority`` is refused (400).
    - ``prefill_serial``: prefills run one at a time, first come first served (a real engine's prefill
      token budget is shared by the requests in it); the cache is looked up when a prefill starts, so a
      request queued behind the same prefix hits it. Off: every prefill runs in parallel.

    Native API shapes (each off: its routes answer 404, as on an engine without them):

    - ``messages_api``: ``/v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic Messages, as vLLM).
    - ``responses_api``: ``/v1/responses`` and ``/v1/responses/{id}`` (OpenAI Responses, as vLLM).
    - ``responses_store``: keep responses in this process (vLLM with ``VLLM_ENABLE_RESPONSES_API_STORE=1``),
      so ``previous_response_id`` and ``GET /v1/responses/{id}`` work here and only here. Off: ``store`` is
      ignored, as vLLM does by default.
    - ``keep_billing_block``: keep a system block starting ``x-anthropic-billing-header`` in the prompt (as
      llama.cpp does); off, it is dropped before templating (as vLLM does).
    """

    name: str = "sim"
    models: tuple[str, ...] = (DEFAULT_MODEL,)
    prefill_tps: float = DEFAULT_PREFILL_TPS
    ttft_base_ms: float = DEFAULT_TTFT_BASE_MS
    decode_tps: float = DEFAULT_DECODE_TPS
    decode_slowdown: float = DEFAULT_DECODE_SLOWDOWN
    cache_tokens: int = DEFAULT_CACHE_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE
    max_running: int = DEFAULT_MAX_RUNNING
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    answer_tokens: tuple[int, int] = DEFAULT_ANSWER_TOKENS
    reasoning_tokens: tuple[int, int] = DEFAULT_REASONING_TOKENS
    reasoning: bool = False
    prefill_serial: bool = False
    scheduling_policy: str = "fcfs"
    time_scale: float = 1.0
    seed: int = 0
    kv_events_endpoint: str | None = None
    kv_events_topic: str = "kv"
    messages_api: bool = True
    responses_api: bool = True
    responses_store: bool = True
    keep_billing_block: bool = False
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("at least one model name is required")
        if self.prefill_tps <= 0 or self.decode_tps <= 0:
            raise ValueError("prefill_tps and decode_tps must be > 0")
        if self.ttft_base_ms < 0 or self.decode_slowdown < 0 or self.time_scale < 0:
            raise ValueError("ttft_base_ms, decode_slowdown and time_scale must be >= 0")
        if self.block_size < 1 or self.cache_tokens < 0:
            raise ValueError("block_size must be >= 1 and cache_tokens >= 0")
        if self.max_running < 1 or self.max_model_len < 1 or self.default_max_tokens < 1:
            raise ValueError("max_running, max_model_len and default_max_tokens must be >= 1")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}")
        for low, high in (self.answer_tokens, self.reasoning_tokens):
            if not 0 <= low <= high:
                raise ValueError("token ranges must satisfy 0 <= min <= max")
