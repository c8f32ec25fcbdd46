"""Quotas shared by two gateway replicas through one real redis-server: the (N+1)th request of a window is
refused on either replica, tokens and requests in flight count across them, and what it costs in round
trips (one before routing, one after the answer; none for a key without a quota)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import redis
from redis.asyncio import Redis

from config.settings import load_settings
from gateway import redis_scripts
from gateway.app import Gateway, create_app
from gateway.quota_windows import Exhausted, Limits
from gateway.redis_keys import RedisKeys
from gateway.redis_quotas import QuotaUnavailable, RedisQuotas
from gateway.redis_scripts import QUOTA_ADMIT, QUOTA_FINISH
from gateway.redis_store import RedisAffinityStore, redis_pool
from tools.redis_server import CountingConnection, RedisServer

from upstreams import FAST_HEALTH, FakeEngine, serve

KEYS = [{"name": "alice", "key": "k-alice"}, {"name": "bob", "key": "k-bob"}]
QUIET = {"heartbeat_s": 60, "lease_ttl_s": 120}  # no heartbeat while round trips are counted
HOUR = 3600
QUOTA_SCRIPTS = (QUOTA_ADMIT, QUOTA_FINISH)


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


def flying(p: Pair, key: str) -> int:
    """The key's requests in flight over every replica, as Redis holds them (``count:seq`` per replica)."""
    return sum(int(v.split(":")[0]) for v in p.redis.hvals(p.keys.quota_in_flight(key)))


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
    until(lambda: flying(p, "alice") == 0)
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
    until(lambda: flying(p, "alice") == 0)
    assert chat(p.urls[1], "k-alice").status_code == 200


SHAS = {hashlib.sha1(script.encode()).hexdigest().encode() for script in QUOTA_SCRIPTS}


class QuotaCounting(CountingConnection):
    """Counts, besides every round trip, those that call a quota script (by its SHA)."""

    quota = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        data = b"".join(command) if isinstance(command, list) else bytes(command)
        if any(sha in data for sha in SHAS):
            type(self).quota += 1
        await super().send_packed_command(command, check_health)


def test_a_key_with_a_quota_costs_two_round_trips_and_one_without_none(pair: Callable[..., Pair]) -> None:
    counting = type("Counting", (QuotaCounting,), {"sent": 0, "quota": 0})

    def store(settings: Any) -> RedisAffinityStore:
        pool = redis_pool(settings.redis, connection_class=counting)
        return RedisAffinityStore(settings.redis, settings.routing, ["a"], pool=pool)

    p = pair({"alice": {"requests_per_window": 100}}, count=1, store=store, **QUIET)
    with httpx.Client(timeout=10) as client:
        chat(p.urls[0], "k-alice", client)  # connection handshake and script loading: one-off costs
        until(lambda: flying(p, "alice") == 0)
        before = counting.quota
        for _ in range(5):
            assert chat(p.urls[0], "k-bob", client).status_code == 200
        assert counting.quota == before  # no quota, no round trip
        for _ in range(5):
            assert chat(p.urls[0], "k-alice", client).status_code == 200
        until(lambda: flying(p, "alice") == 0)
    assert counting.quota - before == 10  # one admission and one finish each


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


@pytest.mark.anyio
async def test_a_replica_publishes_its_own_count_newest_first_and_skips_redis_when_degraded(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    client = Redis.from_url(redis_server.url, decode_responses=True)
    keys, failures = RedisKeys(redis_prefix), []
    down = False
    q = RedisQuotas(client, keys, "r1", failures.append, lambda: down)
    limits = Limits(concurrent=2)
    assert [(await q.admit("alice", limits)).refused for _ in range(3)] == [None, None, Exhausted.CONCURRENT]
    assert await client.hgetall(keys.quota_in_flight("alice")) == {"r1": "2:3"}  # the refusal published too
    q.finish("alice", limits, 5)
    await q.drained()
    assert await client.hget(keys.quota_in_flight("alice"), "r1") == "1:4"
    finish = client.register_script(redis_scripts.QUOTA_FINISH)
    stale = [keys.quota("alice"), keys.quota_in_flight("alice")]
    await finish(keys=stale, args=["r1", 60_000, 0, 0, 1])  # an older call arriving late
    assert await client.hget(keys.quota_in_flight("alice"), "r1") == "1:4"
    assert q.in_flight == {"alice": 1}
    down = True
    with pytest.raises(QuotaUnavailable, match="degraded"):
        await q.admit("alice", limits)
    assert q.in_flight == {"alice": 1}
    q.finish("alice", limits, 7)  # lost: not sent while degraded; the next call publishes the count
    assert failures == ["shared state degraded; tokens not charged"]
    down = False
    assert (await q.admit("alice", limits)).in_flight == 1
    assert await client.hget(keys.quota_in_flight("alice"), "r1") == "1:5"
    assert await client.hget(keys.quota("alice"), "t") == "5"
    await client.aclose()
