"""Identical heads with distinct session ids are placed apart from their first turn, on simulated engines.

Coding agents start many sessions with one identical head (system prompt, tools, first instruction); head
hashing alone cannot tell them apart until their replies diverge. With a session id each session is its own
conversation: 16 such sessions over 4 simulator processes get a load max/mean of at most 1.2 on their first
turn (here: exactly 4 each) under ``affinity`` and ``ttft``, sent one after another or all at once, and
every follow-up stays where its session started.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from simprocs import SIM_START_TIMEOUT_S, SimFactory

from config.settings import load_settings
from gateway.app import Gateway

from clusters import served_gateway

pytestmark = pytest.mark.anyio
SESSIONS, ENGINES = 16, 4
SYSTEM = "You are Claude Code, Anthropic's official CLI. Follow the repository's conventions. " * 40
HEAD = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "Read the failing test and fix it."},
]


@contextlib.asynccontextmanager
async def gateway(urls: list[str], policy: str) -> AsyncIterator[tuple[str, Gateway]]:
    backends = [{"id": f"e{i}", "url": u, "models": ["sim-model"]} for i, u in enumerate(urls)]
    settings = load_settings(
        None,
        backends=backends,
        routing={"policy": policy},
        health={"interval_s": 0.5, "timeout_s": 2.0, "fail_threshold": 2},
    )
    async with served_gateway(settings, SIM_START_TIMEOUT_S) as served:
        yield served


async def turn(client: httpx.AsyncClient, url: str, sid: str, messages: list[dict[str, Any]]) -> str:
    body = {"model": "sim-model", "messages": messages, "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers={"x-claude-code-session-id": sid}) as r:  # fmt: skip
        assert r.status_code == 200
        await r.aread()
        return r.headers["x-warmroute-backend"]


def max_over_mean(placed: dict[str, str]) -> float:
    load = Counter(placed.values())
    return max(load.values()) / (SESSIONS / ENGINES) if len(load) == ENGINES else float(SESSIONS)


@pytest.mark.parametrize("policy", ["affinity", "ttft"])
@pytest.mark.parametrize("burst", [False, True], ids=["one-by-one", "all-at-once"])
async def test_sixteen_sessions_sharing_a_head_spread_from_their_first_turn(
    sims: SimFactory, policy: str, burst: bool
) -> None:
    urls = sims(*([["--time-scale", "0.02"]] * ENGINES))
    sids = [f"session-{i:02d}" for i in range(SESSIONS)]
    async with gateway(urls, policy) as (url, _gw), httpx.AsyncClient(timeout=30) as client:
        if burst:
            homes = await asyncio.gather(*(turn(client, url, sid, HEAD) for sid in sids))
        else:
            homes = [await turn(client, url, sid, HEAD) for sid in sids]
        placed = dict(zip(sids, homes, strict=True))
        assert max_over_mean(placed) <= 1.2, Counter(placed.values())
        follow = [
            *HEAD,
            {"role": "assistant", "content": "Looking at it."},
            {"role": "user", "content": "ok"},
        ]
        moved = [sid for sid in sids if await turn(client, url, sid, follow) != placed[sid]]
        assert moved == []
