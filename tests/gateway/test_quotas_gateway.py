"""Quotas per client key through the proxy, on the in-memory transport: exact 429 bodies and headers, the
headers of admitted answers, tokens charged from usage, and the in-flight count given back however a request
ends. Held replies wait on ``asyncio.Event``s; the quota clock stands still, so nothing here depends on time
passing."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from typing import Any

import pytest
from prometheus_client import generate_latest
from redis.asyncio import Redis

from config.settings import RedisConfig
from gateway.context import RequestContext
from gateway.errors import GatewayError
from gateway.quota_windows import Limits, Verdict
from gateway.quotas import LocalQuotas, Quotas
from gateway.redis_keys import RedisKeys
from gateway.redis_quotas import QuotaUnavailable, RedisQuotas
from gateway.redis_store import redis_pool
from gateway.shapes.base import ApiShape, ErrorShape
from gateway.shapes.messages import MESSAGES
from gateway.shapes.table import CHAT
from gateway.transport import UpstreamConnectError
from routing.policies.round_robin import RoundRobinPolicy
from tools.procs import free_port

from proxy_rig import OneBackend, ProxyClient
from transports import Reply

pytestmark = pytest.mark.anyio
JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream")]
HOUR = 3600
WALL = 1_796_200_000.25  # the wall clock the quotas date Anthropic's resets from: 2026-12-02T08:26:40.25Z


def answer(prompt: int = 40, completion: int = 70) -> Reply:
    usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    return Reply.json({"id": "c", "choices": [{"message": {"content": "ok"}}], "usage": usage})


class AnnouncedQuotas(LocalQuotas):
    """The in-memory store on a clock that stands still (windows never move on their own), announcing each
    admission (what a test waits on)."""

    def __init__(self) -> None:
        super().__init__(clock=lambda: 1000.0)
        self.admitted = asyncio.Event()

    async def admit(self, key: str, limits: Limits) -> Verdict:
        verdict = await super().admit(key, limits)
        self.admitted.set()
        return verdict


class Rig(OneBackend):
    """One backend ``a`` behind a proxy whose quota module has ``keys``."""

    def __init__(self, keys: dict[str, Any]) -> None:
        super().__init__(quotas={"keys": keys, "window_s": HOUR})
        self.store = AnnouncedQuotas()
        self.quotas = Quotas(self.settings.quotas, self.store, self.metrics.quotas(), wall=lambda: WALL)
        self.proxy = self.build_proxy(self.quotas)

    def counter(self, client: str, outcome: str) -> float:
        return self.sample("warmroute_quota_requests_total", client=client, outcome=outcome)

    async def window(self, key: str) -> Verdict:
        return await self.quotas.store.state(key, self.quotas.limits[key])

    async def idle(self, key: str) -> None:
        assert (await self.window(key)).in_flight == 0
        assert self.registry.total_in_flight() == 0 and self.fake.unclosed() == []


def context(client: str | None, *, stream: bool = False, shape: ApiShape = CHAT) -> RequestContext:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    raw = json.dumps(body).encode()
    ctx = RequestContext(
        "POST", "/v1/chat/completions", raw, body, "m", "k", RoundRobinPolicy(), [], {}, shape
    )
    ctx.client = client
    return ctx


def ratelimit(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    return [(k, v) for k, v in headers if k.startswith((b"x-ratelimit-", b"anthropic-ratelimit-", b"retry-"))]


async def test_the_request_past_the_window_gets_a_429_with_openais_headers_and_body() -> None:
    rig = Rig({"alice": {"requests_per_window": 3}})
    rig.fake.script("http://a", *(answer() for _ in range(3)))
    admitted = [await ProxyClient(rig, context("alice")).answer() for _ in range(3)]
    assert [s for s, _, _ in admitted] == [200, 200, 200]
    remaining = [dict(h)[b"x-ratelimit-remaining-requests"] for _, h, _ in admitted]
    assert remaining == [b"2", b"1", b"0"]
    status, headers, body = await ProxyClient(rig, context("alice")).answer()
    assert status == 429
    assert ratelimit(headers) == [
        (b"retry-after", b"3600"),
        (b"x-ratelimit-limit-requests", b"3"),
        (b"x-ratelimit-remaining-requests", b"0"),
        (b"x-ratelimit-reset-requests", b"1h0m0s"),
    ]
    assert json.loads(body) == {
        "error": {
            "message": "Rate limit reached for client key 'alice' on requests per 3600 s: limit 3, used 3. "
            "Please try again in 1h0m0s.",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    assert len(rig.fake.requests) == 3  # the refused one never reached the engine
    assert (rig.counter("alice", "admitted"), rig.counter("alice", "requests")) == (3, 1)
    await rig.idle("alice")


async def test_admitted_answers_carry_both_trios_and_tokens_come_from_usage() -> None:
    rig = Rig({"alice": {"requests_per_window": 10, "tokens_per_window": 200}})
    rig.fake.script("http://a", answer(40, 70), answer(30, 20), answer())
    first = await ProxyClient(rig, context("alice")).answer()
    assert first[0] == 200
    h = dict(first[1])
    assert (h[b"x-ratelimit-limit-requests"], h[b"x-ratelimit-remaining-requests"]) == (b"10", b"9")
    assert (h[b"x-ratelimit-limit-tokens"], h[b"x-ratelimit-remaining-tokens"]) == (b"200", b"200")
    assert h[b"x-ratelimit-reset-requests"] == h[b"x-ratelimit-reset-tokens"] == b"1h0m0s"
    assert (await rig.window("alice")).tokens == 110  # 40 + 70, charged once it was answered
    second = dict((await ProxyClient(rig, context("alice")).answer())[1])
    assert second[b"x-ratelimit-remaining-tokens"] == b"90"
    assert (await rig.window("alice")).tokens == 160
    third = dict((await ProxyClient(rig, context("alice")).answer())[1])  # 160 < 200: admitted
    assert third[b"x-ratelimit-remaining-tokens"] == b"40"
    status, headers, body = await ProxyClient(rig, context("alice")).answer()  # 270 spent
    assert status == 429
    assert json.loads(body)["error"]["type"] == "tokens"
    limited = dict(ratelimit(headers))
    assert (limited[b"x-ratelimit-remaining-tokens"], limited[b"x-ratelimit-remaining-requests"]) == (
        b"0",
        b"7",
    )
    assert rig.counter("alice", "tokens") == 1
    await rig.idle("alice")


async def test_a_streams_usage_is_charged_and_its_head_carries_the_headers() -> None:
    rig = Rig({"alice": {"tokens_per_window": 1000}})
    events = [
        b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17}}\n\n',
        b"data: [DONE]\n\n",
    ]
    rig.fake.script("http://a", Reply(200, SSE, events))
    status, headers, _ = await ProxyClient(rig, context("alice", stream=True)).answer()
    assert status == 200
    assert dict(headers)[b"x-ratelimit-remaining-tokens"] == b"1000"
    assert (await rig.window("alice")).tokens == 17
    await rig.idle("alice")


async def test_an_answer_without_usage_is_charged_its_prompt_estimate_and_a_failure_nothing() -> None:
    rig = Rig({"alice": {"tokens_per_window": 1000}})
    rig.fake.script("http://a", Reply(200, SSE, [b"data: [DONE]\n\n"]), Reply.json({"error": "no"}, 400))
    ctx = context("alice", stream=True)
    await ProxyClient(rig, ctx).answer()
    assert (await rig.window("alice")).tokens == len(ctx.raw) // 4
    await ProxyClient(rig, context("alice")).answer()
    assert (await rig.window("alice")).tokens == len(ctx.raw) // 4
    await rig.idle("alice")


async def test_a_refusal_is_rendered_in_the_routes_own_error_shape() -> None:
    rig = Rig({"alice": {"requests_per_window": 1}})

    def body(err: GatewayError) -> bytes:
        return json.dumps({"type": "error", "error": {"type": err.type, "message": err.message}}).encode()

    shape = dataclasses.replace(CHAT, errors=ErrorShape(body, lambda err: b"", b"application/x-test"))
    rig.fake.script("http://a", answer())
    await ProxyClient(rig, context("alice", shape=shape)).answer()
    status, headers, sent = await ProxyClient(rig, context("alice", shape=shape)).answer()
    assert (status, dict(headers)[b"content-type"], dict(headers)[b"retry-after"]) == (
        429,
        b"application/x-test",
        b"3600",
    )
    assert json.loads(sent)["type"] == "error" and json.loads(sent)["error"]["type"] == "requests"


async def test_keys_without_a_quota_and_requests_without_a_key_are_not_looked_at() -> None:
    rig = Rig({"alice": {"requests_per_window": 1}})
    rig.fake.script("http://a", answer(), answer())
    for client in ("bob", None):
        status, headers, _ = await ProxyClient(rig, context(client)).answer()
        assert status == 200 and ratelimit(headers) == []
    text = generate_latest(rig.metrics.registry).decode()
    assert "warmroute_quota_requests_total{" not in text


async def test_the_concurrent_limit_refuses_while_one_runs_and_admits_once_it_ended() -> None:
    rig = Rig({"alice": {"concurrent": 1}})
    gate = asyncio.Event()
    rig.fake.script("http://a", Reply(200, JSON, [gate, json.dumps({"usage": None}).encode()]), answer())
    running = ProxyClient(rig, context("alice"))
    await rig.store.admitted.wait()
    status, headers, body = await ProxyClient(rig, context("alice")).answer()
    assert (status, ratelimit(headers), json.loads(body)["error"]["type"]) == (
        429,
        [(b"retry-after", b"1")],
        "concurrent",
    )
    assert "limit 1, in flight 1" in json.loads(body)["error"]["message"]
    gate.set()
    assert (await running.answer())[0] == 200
    assert (await ProxyClient(rig, context("alice")).answer())[0] == 200
    assert (rig.counter("alice", "admitted"), rig.counter("alice", "concurrent")) == (2, 1)
    await rig.idle("alice")


@pytest.mark.parametrize(
    "ending",
    ["answered", "engine_5xx", "connect_error", "client_left_waiting", "client_left_streaming"],
)
async def test_in_flight_returns_to_zero_however_a_request_ends(ending: str) -> None:
    rig = Rig({"alice": {"concurrent": 2, "tokens_per_window": 10_000}})
    gate = asyncio.Event()
    replies = {
        "answered": [answer()],
        "engine_5xx": [Reply.json({"error": "boom"}, 500)],
        "connect_error": [Reply(error=UpstreamConnectError("refused"))],
        "client_left_waiting": [Reply(200, JSON, before_head=gate)],
        "client_left_streaming": [Reply(200, SSE, [b'data: {"choices":[]}\n\n', gate])],
    }[ending]
    rig.fake.script("http://a", *replies)
    client = ProxyClient(rig, context("alice", stream=ending == "client_left_streaming"))
    if ending == "client_left_waiting":
        await rig.store.admitted.wait()
        client.leave.set()
    elif ending == "client_left_streaming":
        await client.sent_body()
        client.leave.set()
    await client.task
    await rig.idle("alice")
    assert rig.counter("alice", "admitted") == 1


async def test_an_unreachable_shared_state_admits_unchecked_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
    client = Redis(connection_pool=redis_pool(cfg))
    rig = Rig({"alice": {"requests_per_window": 1}})
    rig.quotas.store = RedisQuotas(client, RedisKeys("t:"), "r1", rig.quotas.unavailable)
    rig.fake.script("http://a", answer(), answer())
    with caplog.at_level(logging.WARNING, logger="warmroute.quotas"):
        results = [await ProxyClient(rig, context("alice")).answer() for _ in range(2)]
    assert [(s, ratelimit(h)) for s, h, _ in results] == [(200, []), (200, [])]  # past the limit: fail open
    assert rig.counter("alice", "unchecked") == 2 and rig.metrics.quotas().store_failures == 2
    warnings = [r.getMessage() for r in caplog.records if r.name == "warmroute.quotas"]
    assert len(warnings) == 1 and "admitted unchecked (1 times)" in warnings[0]
    with pytest.raises(QuotaUnavailable):
        await rig.quotas.store.state("alice", Limits(requests=1))
    await client.aclose()


async def test_messages_answers_and_429s_carry_anthropics_headers_with_an_rfc3339_reset() -> None:
    rig = Rig({"alice": {"requests_per_window": 2, "tokens_per_window": 1000}})
    rig.fake.script("http://a", answer(), answer())
    _, first, _ = await ProxyClient(rig, context("alice", shape=MESSAGES)).answer()
    assert ratelimit(first) == [
        (b"anthropic-ratelimit-requests-limit", b"2"),
        (b"anthropic-ratelimit-requests-remaining", b"1"),
        (b"anthropic-ratelimit-requests-reset", b"2026-12-02T09:26:41Z"),  # WALL + 1 h, rounded up
        (b"anthropic-ratelimit-tokens-limit", b"1000"),
        (b"anthropic-ratelimit-tokens-remaining", b"1000"),
        (b"anthropic-ratelimit-tokens-reset", b"2026-12-02T09:26:41Z"),
    ]
    await ProxyClient(rig, context("alice", shape=MESSAGES)).answer()
    status, headers, body = await ProxyClient(rig, context("alice", shape=MESSAGES)).answer()
    assert status == 429
    assert ratelimit(headers) == [
        (b"retry-after", b"3600"),
        (b"anthropic-ratelimit-requests-limit", b"2"),
        (b"anthropic-ratelimit-requests-remaining", b"0"),
        (b"anthropic-ratelimit-requests-reset", b"2026-12-02T09:26:41Z"),
        (b"anthropic-ratelimit-tokens-limit", b"1000"),
        (b"anthropic-ratelimit-tokens-remaining", b"960"),  # chat-shaped usage: each charged its prompt
        (b"anthropic-ratelimit-tokens-reset", b"2026-12-02T09:26:41Z"),
    ]
    assert json.loads(body)["error"]["type"] == "rate_limit_error"
    await rig.idle("alice")


@pytest.mark.parametrize("shape", [CHAT, MESSAGES], ids=["chat", "messages"])
async def test_the_engines_own_rate_limit_headers_give_way_to_the_gateways(shape: ApiShape) -> None:
    rig = Rig({"alice": {"requests_per_window": 5}})
    engines = [
        (b"x-ratelimit-limit-requests", b"999"),
        (b"x-ratelimit-remaining-requests", b"998"),
        (b"anthropic-ratelimit-requests-limit", b"999"),
        (b"retry-after", b"7"),
    ]
    reply = answer()
    rig.fake.script("http://a", dataclasses.replace(reply, headers=[*reply.headers, *engines]))
    rig.fake.script("http://a", dataclasses.replace(reply, headers=[*reply.headers, *engines]))
    _, limited, _ = await ProxyClient(rig, context("alice", shape=shape)).answer()
    names = [k for k, _ in ratelimit(limited)]
    assert len(names) == len(set(names))  # every name once
    ours = dict(ratelimit(limited))
    if shape is MESSAGES:
        assert [k for k in names if k.startswith(b"x-ratelimit-")] == []
        assert ours[b"anthropic-ratelimit-requests-limit"] == b"5"
        assert ours[b"anthropic-ratelimit-requests-remaining"] == b"4"
    else:
        assert ours[b"x-ratelimit-limit-requests"] == b"5" and ours[b"x-ratelimit-remaining-requests"] == b"4"
        assert b"anthropic-ratelimit-requests-limit" not in ours
    assert ours[b"retry-after"] == b"7"  # not a rate-limit header of ours: the engine's back-off stands
    _, unlimited, _ = await ProxyClient(rig, context(None, shape=shape)).answer()
    assert ratelimit(unlimited) == engines  # no quota of ours: the engine's headers reach the client as sent
