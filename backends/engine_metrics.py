"""Reading an engine's Prometheus ``/metrics``: the vLLM series the gateway's tools use, and the engine
signals routing reads (waiting, running, KV use, prefix-cache and speculative-decoding counters) under the
names the backend's dialect publishes (``backends.dialects``: vLLM current and older, SGLang, llama.cpp
server; the generic ``openai`` dialect tries all of them).

vLLM (V1) exposes the prefix-cache counters ``vllm:prefix_cache_queries_total`` and
``vllm:prefix_cache_hits_total`` (both in tokens) and the gauges ``vllm:num_requests_running`` and
``vllm:num_requests_waiting``, one series per model name (and per engine core in newer versions). The
simulator exposes the same names. Values are summed over label sets; a missing series is simply absent.
The one labelled exception is vLLM's ``vllm:cache_config_info`` (value 1): it is read as the KV cache size
in tokens, its ``num_gpu_blocks`` label times its ``block_size`` label.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Collection, Mapping

import httpx

from backends.dialects import DIALECTS, SignalNames
from backends.registry import Backend, Registry
from backends.signals import EngineSignals
from config.settings import Dialect

_VLLM = DIALECTS[Dialect.VLLM].metrics
PREFIX_QUERIES = _VLLM.prefix_queries[0]
PREFIX_HITS = _VLLM.prefix_hits[0]
RUNNING = _VLLM.running[0]
WAITING = _VLLM.waiting[0]

CACHE_CONFIG = _VLLM.kv_capacity[0]
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
        if name == CACHE_CONFIG:
            if (tokens := _capacity_tokens(line[brace : line.rindex("}")])) is not None:
                totals[name] = totals.get(name, 0.0) + tokens
            continue
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


def _label(labels: str, name: str) -> str | None:
    """The value of label ``name`` in ``{a="1",b="2"`` (values of these labels hold no quotes)."""
    start = labels.find(f'{name}="')
    while start > 0 and labels[start - 1] not in "{, ":  # a longer label name ending in ``name``
        start = labels.find(f'{name}="', start + 1)
    if start < 0:
        return None
    start += len(name) + 2
    end = labels.find('"', start)
    return labels[start:end] if end >= 0 else None


def _capacity_tokens(labels: str) -> float | None:
    """``num_gpu_blocks`` x ``block_size`` of a ``cache_config_info`` label set; None if either is absent."""
    blocks, size = _label(labels, "num_gpu_blocks"), _label(labels, "block_size")
    try:
        tokens = float(int(blocks or "")) * float(int(size or ""))
    except ValueError:
        return None
    return tokens if tokens > 0 else None


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
# The names per engine are its dialect's (backends/dialects.py); a backend is read under its own dialect's.
ANY_ENGINE = DIALECTS[Dialect.OPENAI].metrics  # every known engine's names: the generic dialect's


def _first(samples: Mapping[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        value = samples.get(name)
        if value is not None:
            return value
    return None


def signals_from(samples: Mapping[str, float], at: float, names: SignalNames = ANY_ENGINE) -> EngineSignals:
    return EngineSignals(
        at=at,
        waiting=_first(samples, names.waiting),
        running=_first(samples, names.running),
        kv_usage=_first(samples, names.kv_usage),
        prefix_queries=_first(samples, names.prefix_queries),
        prefix_hits=_first(samples, names.prefix_hits),
        prefix_hit_rate=_first(samples, names.prefix_hit_rate),
        spec_accepted=_first(samples, names.spec_accepted),
        spec_draft=_first(samples, names.spec_draft),
        spec_accept_length=_first(samples, names.spec_accept_length),
        kv_capacity=_first(samples, names.kv_capacity),
    )


def parse_signals(text: str, at: float, dialect: Dialect = Dialect.OPENAI) -> EngineSignals:
    """The signals of ``/metrics`` text under the names ``dialect``'s engine publishes."""
    names = DIALECTS[dialect].metrics
    return signals_from(parse_samples(text, names.all()), at, names)


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
        names = DIALECTS[backend.cfg.dialect].metrics
        try:
            async with asyncio.timeout(self.timeout_s):
                samples = await scrape(self.client, backend.cfg.url, names.all(), headers)
        except TimeoutError:
            return
        if samples:
            backend.signals = signals_from(samples, self.clock(), names)
