"""The simulated engine: admission (running / waiting), prefix-cache lookups, timed prefill and decode.

One ``SimEngine`` per app. All state is plain Python touched from one event loop; waiting requests park on
futures, so no asyncio primitive is bound to a loop at construction.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import math
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from backends.sim.cache import PrefixCache, block_hashes
from backends.sim.config import SimConfig
from backends.sim.faults import FaultState
from backends.sim.kv_publisher import KvPublisher
from backends.sim.text import OutputPlan, PieceKind

Sleep = Callable[[float], Awaitable[None]]


def ttft_seconds(cfg: SimConfig, uncached_tokens: int) -> float:
    """Unscaled time to first token: fixed overhead plus prefill of the tokens the cache did not hold."""
    return cfg.ttft_base_ms / 1000.0 + uncached_tokens / cfg.prefill_tps


def decode_step_seconds(cfg: SimConfig, running: int) -> float:
    """Unscaled time of one decode step (one token for every running stream) with ``running`` streams."""
    return (1.0 + cfg.decode_slowdown * (max(running, 1) - 1)) / cfg.decode_tps


@dataclass(slots=True)
class RequestUsage:
    """Filled in while a request runs; read for the ``usage`` block."""

    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    created_tokens: int = 0  # prompt tokens this request wrote to the prefix cache (vLLM: cache creation)
    reasoning_tokens: int = 0

    def as_openai(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(slots=True)
class EngineStats:
    """Monotonic counters (they back both ``/metrics`` and ``/sim/stats``)."""

    requests: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    injected_failures: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    paths: Counter[str] = field(default_factory=Counter)


class SimEngine:
    def __init__(self, cfg: SimConfig, sleep: Sleep | None = None) -> None:
        self.cfg = cfg
        self.kv_publisher: KvPublisher | None = None
        if cfg.kv_events_endpoint is not None:
            self.kv_publisher = KvPublisher(cfg.kv_events_endpoint, cfg.kv_events_topic)
        on_events = self.kv_publisher.publish if self.kv_publisher is not None else None
        self.cache = PrefixCache(cfg.cache_tokens, cfg.block_size, on_events)
        self.faults = FaultState(cfg.faults)
        self.stats = EngineStats()
        self._sleep_fn: Sleep = sleep or asyncio.sleep
        self._ids = itertools.count(1)
        self._held: dict[int, int] = {}  # running request id -> tokens in its KV blocks
        # Waiting requests in the order they take a slot: (priority or 0 under fcfs, request id), the id
        # being arrival order; the future is resolved when the slot is handed over.
        self._waiting: list[tuple[tuple[int, int], asyncio.Future[None]]] = []
        self._by_priority = cfg.scheduling_policy == "priority"
        self._prefill_lock: asyncio.Lock | None = None  # made on first use: bound to the running loop
        self._prefill_waiters = 0  # admitted, waiting for the serial prefill (vLLM counts them as waiting)

    # -- gauges ---------------------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._held)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + self._prefill_waiters

    def kv_cache_usage(self) -> float:
        """Share of KV blocks held by running requests (cached-but-idle blocks count as free, as in vLLM)."""
        if self.cache.capacity_blocks == 0:
            return 1.0 if self._held else 0.0
        blocks = sum(math.ceil(tokens / self.cfg.block_size) for tokens in self._held.values())
        return min(1.0, blocks / self.cache.capacity_blocks)

    # -- admission ------------------------------------------------------------------------------------------

    async def _admit(self, request_id: int, priority: int) -> None:
        """Take a running slot now, or wait in the policy's order until ``_wake_next`` hands one over (a
        running request keeps its slot whatever arrives: no preemption, as vLLM for a full batch)."""
        if len(self._held) < self.cfg.max_running and not self._waiting:
            self._held[request_id] = 0
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = ((priority if self._by_priority else 0, request_id), waiter)
        bisect.insort(self._waiting, entry, key=lambda e: e[0])
        try:
            await waiter
        except BaseException:
            if entry in self._waiting:
                self._waiting.remove(entry)
            elif waiter.done() and not waiter.cancelled():
                self._release(request_id)  # handed a slot we will not use: pass it on
            raise

    def _release(self, request_id: int) -> None:
        self._held.pop(request_id, None)
        self._wake_next()

    def _wake_next(self) -> None:
        # The slot is taken on the waiter's behalf here, so a newcomer cannot slip in before it resumes.
        while self._waiting and len(self._held) < self.cfg.max_running:
            (_, request_id), waiter = self._waiting.pop(0)
            if not waiter.done():
                self._held[request_id] = 0
                waiter.set_result(None)

    async def _sleep(self, seconds: float) -> None:
        await self._sleep_fn(seconds * self.cfg.time_scale * self.faults.current.slow_factor)

    async def _prefill(self, prompt: Sequence[str], hashes: list[bytes], usage: RequestUsage) -> None:
        """Look the prompt up in the cache, spend the time of what it missed, cache the prompt."""
        usage.cached_tokens = self.cache.match(hashes, len(prompt))
        self.stats.prefix_cache_queries += len(prompt)
        self.stats.prefix_cache_hits += usage.cached_tokens
        self.stats.prompt_tokens += len(prompt)
        await self._sleep(ttft_seconds(self.cfg, len(prompt) - usage.cached_tokens))
        self.cache.insert(hashes, prompt)
        stored = next((i for i, block in enumerate(hashes) if block not in self.cache), len(hashes))
        usage.created_tokens = max(0, min(stored * self.cfg.block_size, len(prompt)) - usage.cached_tokens)

    # -- one request ----------------------------------------------------------------------------------------

    async def generate(
        self, prompt: Sequence[str], plan: OutputPlan, usage: RequestUsage, priority: int = 0
    ) -> AsyncGenerator[tuple[PieceKind, str], None]:
        """Wait for a slot (``priority`` orders the wait under the priority policy), prefill (TTFT), then
        yield one (kind, text) piece per decode step.

        The slot is released however the consumer stops (finish, cancellation on client disconnect, close).
        """
        request_id = next(self._ids)
        prompt_hashes = block_hashes(prompt, self.cfg.block_size)
        self.stats.requests += 1
        await self._admit(request_id, priority)
        generated: list[str] = []
        prefilled = finished = False
        try:
            self._held[request_id] = len(prompt)
            if self.cfg.prefill_serial:
                if self._prefill_lock is None:
                    self._prefill_lock = asyncio.Lock()  # FIFO: waiters are woken in arrival order
                self._prefill_waiters += 1
                try:
                    await self._prefill_lock.acquire()
                finally:
                    self._prefill_waiters -= 1
                try:
                    await self._prefill(prompt, prompt_hashes, usage)
                finally:
                    self._prefill_lock.release()
            else:
                await self._prefill(prompt, prompt_hashes, usage)
            prefilled = True
            for index, (kind, text) in enumerate(plan.pieces()):
                if index:
                    await self._sleep(decode_step_seconds(self.cfg, self.num_running))
                generated.append(text.strip())
                usage.completion_tokens += 1
                usage.reasoning_tokens += kind is PieceKind.REASONING
                self.stats.generation_tokens += 1
                self._held[request_id] += 1
                yield kind, text
            finished = True
        finally:
            if prefilled:  # blocks filled during decode are cached too: the next turn can hit the reply
                tokens = [*prompt, *generated]
                self.cache.insert(block_hashes(tokens, self.cfg.block_size, prompt_hashes), tokens)
            self.stats.finished[plan.finish_reason.value if finished else "abort"] += 1
            self._release(request_id)

    def close(self) -> None:
        if self.kv_publisher is not None:
            self.kv_publisher.close()
            self.kv_publisher = None

    def snapshot(self) -> dict[str, Any]:
        """JSON view for ``GET /sim/stats``."""
        s = self.stats
        return {
            "name": self.cfg.name,
            "models": list(self.cfg.models),
            "requests": s.requests,
            "running": self.num_running,
            "waiting": self.num_waiting,
            "prompt_tokens": s.prompt_tokens,
            "cached_tokens": s.prefix_cache_hits,
            "prefix_cache_queries": s.prefix_cache_queries,
            "generation_tokens": s.generation_tokens,
            "injected_failures": s.injected_failures,
            "finished": dict(s.finished),
            "paths": dict(s.paths),
            "cache": {
                "blocks": len(self.cache),
                "capacity_blocks": self.cache.capacity_blocks,
                "block_size": self.cfg.block_size,
            },
            "kv_cache_usage": self.kv_cache_usage(),
            "faults": self.faults.as_dict(),
        }
