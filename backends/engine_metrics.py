"""Reading an engine's Prometheus ``/metrics``: the vLLM series the gateway's tools use, and the engine
signals routing reads (waiting, running, KV use, prefix-cache and speculative-decoding counters) under the
names vLLM (current and older), SGLang and llama.cpp server use.

vLLM (V1) exposes the prefix-cache counters ``vllm:prefix_cache_queries_total`` and
``vllm:prefix_cache_hits_total`` (both in tokens) and the gauges ``vllm:num_requests_running`` and
``vllm:num_requests_waiting``, one series per model name (and per engine core in newer versions). The
simulator exposes the same names. Values are summed over label sets; a missing series is simply absent.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import httpx

if TYPE_CHECKING:
    from backends.registry import Backend, Registry

PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"

CACHE_COUNTERS = (PREFIX_QUERIES, PREFIX_HITS)
QUEUE_GAUGES = (RUNNING, WAITING)


def parse_samples(text: str, names: Collection[str]) -> dict[str, float]:
    """Sum of every sample of each metric in ``names`` found in Prometheus text exposition ``text``."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        brace, space = line.find("{"), line.find(" ")
        if space < 0:
            continue
        labelled = 0 <= brace < space
        name = line[:brace] if labelled else line[:space]
        if name not in names:
            continue
        rest = line[line.rindex("}") + 1 :] if labelled else line[space:]
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if not math.isnan(value):
            totals[name] = totals.get(name, 0.0) + value
    return totals


async def scrape(
    client: httpx.AsyncClient, base_url: str, names: Collection[str], headers: Mapping[str, str] | None = None
) -> dict[str, float] | None:
    """``parse_samples`` of ``GET {base_url}/metrics``; None when the engine does not answer it."""
    try:
        response = await client.get(f"{base_url}/metrics", headers=headers)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    return parse_samples(response.text, names)


# -- engine signals for routing ---------------------------------------------------------------------------
# Names per engine, first found wins. Checked against the engines' sources:
# - vLLM V1: vllm:num_requests_waiting / _running, vllm:kv_cache_usage_perc (older:
#   vllm:gpu_cache_usage_perc), vllm:prefix_cache_queries_total / _hits_total (older:
#   vllm:gpu_prefix_cache_queries / _hits, with or without _total),
#   vllm:spec_decode_num_accepted_tokens_total / _num_draft_tokens_total.
# - SGLang: sglang:num_queue_reqs, sglang:num_running_reqs, sglang:token_usage (KV use, 0..1),
#   sglang:cache_hit_rate (0..1, a gauge), sglang:spec_accept_length (mean accepted length, a gauge).
# - llama.cpp server: llamacpp:requests_deferred, llamacpp:requests_processing,
#   llamacpp:kv_cache_usage_ratio (gone from newer builds).
WAITING_NAMES = (WAITING, "sglang:num_queue_reqs", "llamacpp:requests_deferred")
RUNNING_NAMES = (RUNNING, "sglang:num_running_reqs", "llamacpp:requests_processing")
KV_USAGE_NAMES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage",
                  "llamacpp:kv_cache_usage_ratio")  # fmt: skip
PREFIX_QUERY_NAMES = (PREFIX_QUERIES, "vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries")
PREFIX_HIT_NAMES = (PREFIX_HITS, "vllm:gpu_prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits")
HIT_RATE_NAMES = ("sglang:cache_hit_rate",)
SPEC_ACCEPTED_NAMES = ("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens")
SPEC_DRAFT_NAMES = ("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens")
SPEC_LENGTH_NAMES = ("sglang:spec_accept_length",)
SIGNAL_NAMES = frozenset(
    WAITING_NAMES + RUNNING_NAMES + KV_USAGE_NAMES + PREFIX_QUERY_NAMES + PREFIX_HIT_NAMES + HIT_RATE_NAMES
    + SPEC_ACCEPTED_NAMES + SPEC_DRAFT_NAMES + SPEC_LENGTH_NAMES
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """What one scrape of an engine's ``/metrics`` said; None: the engine does not report it."""

    at: float  # monotonic time of the scrape
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None  # 0..1
    prefix_queries: float | None = None  # counters (tokens): hit rate is a ratio of their deltas
    prefix_hits: float | None = None
    prefix_hit_rate: float | None = None  # engines that report the ratio itself (SGLang)
    spec_accepted: float | None = None  # counters (tokens)
    spec_draft: float | None = None
    spec_accept_length: float | None = None  # SGLang's gauge

    def fresh(self, now: float, max_age_s: float) -> bool:
        return now - self.at <= max_age_s

    def readings(self) -> list[tuple[str, float]]:
        """(name, value) of every signal the engine reported; counters are named with ``_total``."""
        names = ("waiting", "running", "kv_usage", "prefix_hit_rate", "spec_accept_length")
        counters = ("prefix_queries", "prefix_hits", "spec_accepted", "spec_draft")
        out = [(n, v) for n in names if (v := getattr(self, n)) is not None]
        out += [(n + "_total", v) for n in counters if (v := getattr(self, n)) is not None]
        return out


def _first(samples: Mapping[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        value = samples.get(name)
        if value is not None:
            return value
    return None


def signals_from(samples: Mapping[str, float], at: float) -> EngineSignals:
    return EngineSignals(
        at=at,
        waiting=_first(samples, WAITING_NAMES),
        running=_first(samples, RUNNING_NAMES),
        kv_usage=_first(samples, KV_USAGE_NAMES),
        prefix_queries=_first(samples, PREFIX_QUERY_NAMES),
        prefix_hits=_first(samples, PREFIX_HIT_NAMES),
        prefix_hit_rate=_first(samples, HIT_RATE_NAMES),
        spec_accepted=_first(samples, SPEC_ACCEPTED_NAMES),
        spec_draft=_first(samples, SPEC_DRAFT_NAMES),
        spec_accept_length=_first(samples, SPEC_LENGTH_NAMES),
    )


def parse_signals(text: str, at: float) -> EngineSignals:
    return signals_from(parse_samples(text, SIGNAL_NAMES), at)


class SignalScraper:
    """Scrapes every backend's ``/metrics`` each ``interval_s`` into ``Backend.signals``; one task.

    An engine without ``/metrics`` (or one that fails) keeps its last signals, which go stale and are then
    ignored by the snapshot (``Registry.candidates``). Engines are scraped concurrently, each bounded by
    ``timeout_s``, so a slow one delays no other by more than that.
    """

    def __init__(self, registry: Registry, client: httpx.AsyncClient, interval_s: float = 2.0,
                 timeout_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:  # fmt: skip
        self.registry = registry
        self.client = client
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="warmroute-engine-signals")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def scrape_all(self) -> None:
        backends = list(self.registry.backends.values())
        await asyncio.gather(*(self._scrape(b) for b in backends))

    async def _loop(self) -> None:
        while True:
            await self.scrape_all()
            await asyncio.sleep(self.interval_s)

    async def _scrape(self, backend: Backend) -> None:
        headers = {"authorization": f"Bearer {backend.cfg.api_key}"} if backend.cfg.api_key else None
        try:
            async with asyncio.timeout(self.timeout_s):
                samples = await scrape(self.client, backend.cfg.url, SIGNAL_NAMES, headers)
        except TimeoutError:
            return
        if samples:
            backend.signals = signals_from(samples, self.clock())
