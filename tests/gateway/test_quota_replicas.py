"""Quotas shared by two gateway replicas through one real redis-server: the (N+1)th request of a window is
refused on either replica, tokens and requests in flight count across them, and what it costs in round
trips (one before routing, one after the answer; none for a key without a quota)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis

from config.settings import load_settings
from gateway.app import Gateway, create_app
from gateway.redis_keys import RedisKeys
from gateway.redis_store import RedisAffinityStore, redis_pool
from tools.redis_server import CountingConnection, RedisServer

from upstreams import FakeEngine, serve

KEYS = [{"name": "alice", "key": "k-alice"}, {"name": "bob", "key": "k-bob"}]
FAST_HEALTH = {"interval_s": 0.2, "timeout_s": 1, "fail_threshold": 1}
QUIET = {"heartbeat_s": 60, "lease_ttl_s": 120}  # no heartbeat while round trips are counted
HOUR = 3600


@dataclass
class Pair:
    urls: list[str]
    gateways: list[Gateway]
    engine: FakeEngine
    keys: RedisKeys
    redis: redis.Redis


@pytest.fixture
def pair(redis_server: RedisServer, redis_prefix: str) -> Iterator[Callable[..., Pair]]:
    stack = contextlib.ExitStack()

    def make(quotas: dict[str, Any], count: int = 2, store: Any = None, **redis_cfg: Any) -> Pair:
        engine = FakeEngine("a")
        engine_url = stack.enter_context(serve(engine.app()))[0]
        cfg = {"url": redis_server.url, "prefix": redis_prefix, "timeout_s": 2.0, **redis_cfg}
        urls, gateways = [], []
        for _ in range(count):
            settings = load_settings(
                None,
                backends=[{"id": "a", "url": engine_url, "models": ["m"]}],
                health=FAST_HEALTH,
                redis=cfg,
                auth={"client_keys": KEYS},
                quotas={"keys": quotas, "window_s": HOUR},
                admin={"sync_interval_s": 3600},
            )
            app = create_app(settings, store(settings) if store else None)
            urls.append(stack.enter_context(serve(app))[0])
            gateways.append(app.state.gateway)
        client = redis.Redis.from_url(redis_server.url, decode_responses=True)
        stack.callback(client.close)
        return Pair(urls, gateways, engine, RedisKeys(redis_prefix), client)

    with stack:
        yield make


def chat(url: str, key: str, client: httpx.Client | None = None, stream: bool = False) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    headers = {"authorization": f"Bearer {key}"}
    return (client or httpx).post(url + "/v1/chat/completions", json=body, headers=headers, timeout=10)


def until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    """For state another thread's event loop writes (the gateway's background finish): polled."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached before the deadline"
        time.sleep(0.02)


def test_the_request_past_n_per_window_is_refused_on_either_replica(pair: Callable[..., Pair]) -> None:
    p = pair({"alice": {"requests_per_window": 5}})
    answers = [chat(p.urls[i % 2], "k-alice") for i in range(5)]  # alternating replicas
    assert [r.status_code for r in answers] == [200] * 5
    assert [r.headers["x-ratelimit-remaining-requests"] for r in answers] == ["4", "3", "2", "1", "0"]
    for url in p.urls:
        refused = chat(url, "k-alice")
        assert refused.status_code == 429, refused.text
        assert refused.headers["x-ratelimit-limit-requests"] == "5"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-reset-requests"].startswith(("59m", "1h0m0s"))
        assert 3590 <= int(refused.headers["retry-after"]) <= 3600
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert len(p.engine.requests) == 5
    assert chat(p.urls[1], "k-bob").status_code == 200  # another key, no quota
    until(lambda: p.redis.hlen(p.keys.quota_in_flight("alice")) == 0)
    admin = httpx.get(p.urls[0] + "/admin/quotas", timeout=10).json()
    alice = admin["keys"]["alice"]
    assert (admin["enabled"], alice["requests"], alice["in_flight"], alice["requests_per_window"]) == (
        True,
        5,
        0,
        5,
    )
    assert alice["counts"] == {"admitted": 3, "requests": 1}  # replica 0's own: turns 0, 2, 4 and a 429


def test_tokens_charged_on_one_replica_refuse_on_the_other(pair: Callable[..., Pair]) -> None:
    p = pair({"alice": {"tokens_per_window": 8}})
    assert chat(p.urls[0], "k-alice").status_code == 200  # the fake engine's usage: 1 + 3 tokens
    until(lambda: p.redis.hget(p.keys.quota("alice"), "t") == "4")
    second = chat(p.urls[1], "k-alice")
    assert (second.status_code, second.headers["x-ratelimit-remaining-tokens"]) == (200, "4")
    until(lambda: p.redis.hget(p.keys.quota("alice"), "t") == "8")
    refused = chat(p.urls[0], "k-alice")
    assert (refused.status_code, refused.json()["error"]["type"]) == (429, "tokens")


def test_a_request_in_flight_on_one_replica_counts_on_the_other(pair: Callable[..., Pair]) -> None:
    p = pair({"alice": {"concurrent": 1}})
    p.engine.gate = threading.Event()  # the stream waits after its first chunk
    with httpx.Client(timeout=10) as client:
        headers = {"authorization": "Bearer k-alice"}
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
        with client.stream("POST", p.urls[0] + "/v1/chat/completions", json=body, headers=headers) as s:
            chunks = s.iter_raw()  # held: a dropped iterator closes the response (the client "left")
            next(chunks)  # it is admitted and streaming
            refused = chat(p.urls[1], "k-alice")
            assert (refused.status_code, refused.headers["retry-after"]) == (429, "1")
            assert refused.json()["error"]["type"] == "concurrent"
            p.engine.gate.set()
            assert b"".join(chunks).endswith(b"data: [DONE]\n\n")
    until(lambda: p.redis.hlen(p.keys.quota_in_flight("alice")) == 0)
    assert chat(p.urls[1], "k-alice").status_code == 200


def test_a_key_with_a_quota_costs_two_round_trips_and_one_without_none(pair: Callable[..., Pair]) -> None:
    counting = CountingConnection.fresh()

    def store(settings: Any) -> RedisAffinityStore:
        pool = redis_pool(settings.redis, connection_class=counting)
        return RedisAffinityStore(settings.redis, settings.routing, ["a"], pool=pool)

    p = pair({"alice": {"requests_per_window": 100}}, count=1, store=store, **QUIET)
    with httpx.Client(timeout=10) as client:
        chat(p.urls[0], "k-alice", client)  # connection handshake and script loading: one-off costs
        chat(p.urls[0], "k-bob", client)
        until(lambda: p.redis.hlen(p.keys.quota_in_flight("alice")) == 0)
        before = counting.sent
        for _ in range(5):
            assert chat(p.urls[0], "k-bob", client).status_code == 200
        without = (counting.sent - before) / 5
        before = counting.sent
        for _ in range(5):
            assert chat(p.urls[0], "k-alice", client).status_code == 200
        until(lambda: p.redis.hlen(p.keys.quota_in_flight("alice")) == 0)
        with_quota = (counting.sent - before) / 5
    # bob's requests pay the affinity store's round trips only: the baseline alice pays on top of.
    assert with_quota - without == 2, (with_quota, without)


@pytest.mark.anyio
async def test_requests_racing_on_both_replicas_are_admitted_exactly_n_times(
    pair: Callable[..., Pair],
) -> None:
    p = pair({"alice": {"requests_per_window": 6}})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"authorization": "Bearer k-alice"}
    async with httpx.AsyncClient(timeout=10) as client:
        answers = await asyncio.gather(
            *(
                client.post(p.urls[i % 2] + "/v1/chat/completions", json=body, headers=headers)
                for i in range(16)
            )
        )
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] * 6 + [429] * 10
    assert len(p.engine.requests) == 6
    assert sorted(r.headers["x-ratelimit-remaining-requests"] for r in answers if r.status_code == 200) == [
        "0",
        "1",
        "2",
        "3",
        "4",
        "5",
    ]
