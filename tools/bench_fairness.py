"""``warmroute bench --scenario fair-share``: two clients of one class, demand 4:1, both backlogged.

One simulated engine (``MAX_RUNNING`` at a time, FIFO beyond, as in the noisy-neighbour scenario). Client
``heavy`` keeps ``HEAVY`` streams in flight, client ``light`` ``LIGHT`` (4:1), both far more than the engine
runs, in the same admission class. After a warm-up, the completion tokens of the streams that finish within
a window are counted per client. Variants:

- ``share``: admission off: the engine's FIFO queue serves them in proportion to demand (about 4:1);
- ``share+admission``: admission on (``max_in_flight`` = the engine's slots): fair share by virtual time
  over tokens should give each half (target: within 10 % of equal).

Reported: each client's share of the tokens, and tokens per second over the window (the total work; target:
within 5 % of admission off).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from tools.bench_neighbours import FLOOD_TOKENS, KEYS, body, start_engine, start_gateway
from tools.bench_rounds import interleaved_rounds, report
from tools.client import stream_chat
from tools.launch import SimProfile

HEAVY, LIGHT = 32, 8  # streams each client keeps in flight
WARMUP_S = 4.0  # unscaled: the queue fills, admission's virtual clocks settle
WINDOW_S = 24.0  # unscaled: tokens counted over this
VARIANTS = ("share", "share+admission")
SCENARIOS = {
    "fair-share": "two clients of one class, demand 4:1, both backlogged: token shares within 10 % of equal "
    "with admission; tokens/s within 5 % of admission off",
}


@dataclass(slots=True)
class Window:
    """Completion tokens per client of the streams that finished between ``start`` and ``end``."""

    start: float
    end: float
    tokens: dict[str, int]

    def count(self, client: str, finished_at: float, tokens: int) -> None:
        if self.start <= finished_at <= self.end:
            self.tokens[client] = self.tokens.get(client, 0) + tokens


def summarize(window: Window) -> dict[str, Any]:
    total = sum(window.tokens.values())
    heavy, light = window.tokens.get("heavy", 0), window.tokens.get("light", 0)
    return {
        "heavy_share": heavy / total if total else 0.0,
        "light_share": light / total if total else 0.0,
        "tokens_per_s": total / (window.end - window.start),
        "tokens": total,
    }


async def _client(client: httpx.AsyncClient, url: str, name: str, window: Window) -> None:
    headers = {"authorization": f"Bearer {KEYS[name]}"}
    n = 0
    while True:
        n += 1
        result = await stream_chat(client, url, body(FLOOD_TOKENS, f"{name} document {n}"), headers)
        if result.error is None:
            window.count(name, time.monotonic(), result.completion_tokens)


async def run_variant(client: httpx.AsyncClient, url: str, time_scale: float) -> dict[str, Any]:
    now = time.monotonic()
    window = Window(now + WARMUP_S * time_scale, now + (WARMUP_S + WINDOW_S) * time_scale, {})
    tasks = [
        asyncio.create_task(_client(client, url, name, window))
        for name, streams in (("heavy", HEAVY), ("light", LIGHT))
        for _ in range(streams)
    ]
    await asyncio.sleep(window.end - time.monotonic())
    for task in tasks:  # the streams still open are cut: the gateway sees the clients leave
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return summarize(window)


async def run_scenario(name: str, rounds: int, time_scale: float, profile: SimProfile) -> dict[str, Any]:
    async def run(client: httpx.AsyncClient, url: str, variant: str) -> dict[str, Any]:
        return await run_variant(client, url, time_scale)

    runs = await interleaved_rounds(
        name,
        rounds,
        VARIANTS,
        profile,
        start_engine=start_engine,
        start_gateway=start_gateway,
        run_variant=run,
        brief=brief,
        max_connections=HEAVY + LIGHT + 8,
    )
    return report(name, SCENARIOS[name], rounds, time_scale, runs)


def brief(result: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items())
