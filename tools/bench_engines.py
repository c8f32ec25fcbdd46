"""What the benchmark reads from the engines themselves: prefix-cache counters, queue gauges, cache resets.

Engine numbers are the ground truth for routing quality: the gateway's own view of load and of where a
prefix lives is exactly what is being tested, so nothing here asks the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from backends.engine_metrics import CACHE_COUNTERS, PREFIX_HITS, PREFIX_QUERIES, QUEUE_GAUGES, scrape
from tools.launch import Engine

SAMPLE_INTERVAL_S = 0.1


@dataclass(frozen=True, slots=True)
class CacheCounters:
    """Per-engine ``(queries, hits)`` in tokens; an engine without the counters maps to None."""

    by_engine: Mapping[str, tuple[float, float] | None]

    def hit_rate_since(self, before: CacheCounters) -> float | None:
        """Hits over queries between ``before`` and now, summed over engines (None if any lacks them)."""
        queries = hits = 0.0
        for engine, now in self.by_engine.items():
            then = before.by_engine.get(engine)
            if now is None or then is None:
                return None
            queries += now[0] - then[0]
            hits += now[1] - then[1]
        return hits / queries if queries > 0 else None


async def read_cache_counters(
    client: httpx.AsyncClient, engines: Sequence[Engine], headers: Mapping[str, str] | None = None
) -> CacheCounters:
    scraped = await asyncio.gather(*(scrape(client, e.url, CACHE_COUNTERS, headers) for e in engines))
    by_engine: dict[str, tuple[float, float] | None] = {}
    for engine, values in zip(engines, scraped, strict=True):
        ok = values is not None and PREFIX_QUERIES in values and PREFIX_HITS in values
        by_engine[engine.id] = (values[PREFIX_QUERIES], values[PREFIX_HITS]) if ok and values else None
    return CacheCounters(by_engine)


async def reset_prefix_caches(
    client: httpx.AsyncClient, engines: Sequence[Engine], headers: Mapping[str, str] | None = None
) -> bool:
    """POST /reset_prefix_cache on every engine (vLLM needs VLLM_SERVER_DEV_MODE=1). True if all did."""

    async def reset(engine: Engine) -> bool:
        try:
            response = await client.post(f"{engine.url}/reset_prefix_cache", headers=headers)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    return all(await asyncio.gather(*(reset(e) for e in engines)))


@dataclass(slots=True)
class LoadSampler:
    """Samples each engine's running + waiting requests every ``interval_s`` until stopped."""

    client: httpx.AsyncClient
    engines: Sequence[Engine]
    headers: Mapping[str, str] | None = None
    interval_s: float = SAMPLE_INTERVAL_S
    samples: dict[str, list[float]] = field(default_factory=dict)
    failed: int = 0

    async def run(self, stop: asyncio.Event) -> None:
        self.samples = {e.id: [] for e in self.engines}
        next_at = time.monotonic()
        while not stop.is_set():
            await asyncio.gather(*(self._sample(e) for e in self.engines))
            next_at += self.interval_s
            delay = next_at - time.monotonic()
            if delay < 0:  # fell behind (busy machine): skip missed ticks rather than bunch up
                next_at = time.monotonic()
                delay = 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)

    async def _sample(self, engine: Engine) -> None:
        values = await scrape(self.client, engine.url, QUEUE_GAUGES, self.headers)
        if values is None or not values:
            self.failed += 1
            return
        self.samples[engine.id].append(sum(values.values()))

    def time_average(self) -> dict[str, float]:
        """Mean sampled queue (running + waiting) per engine; samples are evenly spaced in time."""
        return {engine: sum(s) / len(s) for engine, s in self.samples.items() if s}


def imbalance(averages: Mapping[str, float]) -> float | None:
    """Max over mean of the per-engine average load: 1.0 is perfectly even."""
    if not averages:
        return None
    mean = sum(averages.values()) / len(averages)
    return max(averages.values()) / mean if mean > 0 else None
