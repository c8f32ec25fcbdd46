"""Anthropic Messages through the gateway to real vLLM engines, with the official `anthropic` SDK calling:
a conversation's turns (streamed and not) and its token counts stay on one engine, whose prefix cache then
serves the follow-ups; the usage vLLM reports reaches the gateway's metrics; errors are the SDK's classes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from .engines import PrefixCacheStats, VllmEngine
from .gateways import BACKEND_HEADER, BLOCK, MODEL, ROUTE_HEADER, RunningGateway, running_gateway
from .prompts import filler_text

TURNS = 3
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def gw(vllm_engines: list[VllmEngine]) -> Iterator[RunningGateway]:
    with running_gateway(vllm_engines, "affinity") as running:
        yield running


def sdk(gw: RunningGateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gw.url, api_key="unused", max_retries=0, timeout=120)


def caches(engines: list[VllmEngine]) -> dict[str, PrefixCacheStats]:
    return {e.name: e.prefix_cache() for e in engines}


def play(client: anthropic.Anthropic, engines: list[VllmEngine], tag: str) -> list[dict[str, Any]]:
    """One conversation of ``TURNS`` turns, every other one streamed, and a count after each."""
    system = f"{tag}: you are a terse coding agent."
    messages: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []
    for n in range(TURNS):
        messages.append({"role": "user", "content": filler_text(600 if n == 0 else 150, f"{tag}-t{n}")})
        before = caches(engines)
        args: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "system": system, "extra_body": NO_THINKING}
        if n % 2:
            with client.messages.with_streaming_response.create(messages=messages, stream=True, **args) as r:
                backend, route = r.headers[BACKEND_HEADER], r.headers[ROUTE_HEADER]
                events = r.text()
            assert "event: message_start" in events and "event: message_stop" in events
            text = "streamed"  # the reply's exact text does not matter: the next turn resends what it is
        else:
            raw = client.messages.with_raw_response.create(messages=messages, **args)
            backend, route = raw.headers[BACKEND_HEADER], raw.headers[ROUTE_HEADER]
            message = raw.parse()
            assert message.usage.input_tokens > 0 and message.stop_reason in ("end_turn", "max_tokens")
            text = "".join(b.text for b in message.content if b.type == "text") or "ok"
        after = caches(engines)
        counted = client.messages.with_raw_response.count_tokens(
            model=MODEL, system=system, messages=messages, extra_body=NO_THINKING
        )
        assert counted.parse().input_tokens > 0
        turns.append(
            {
                "backend": backend,
                "route": route,
                "served": after[backend] - before[backend],
                "count": (counted.headers[BACKEND_HEADER], counted.headers[ROUTE_HEADER]),
            }
        )
        messages.append({"role": "assistant", "content": text})
    return turns


def test_a_conversation_and_its_counts_stay_on_one_engine_whose_cache_serves_it(
    gw: RunningGateway, vllm_engines: list[VllmEngine]
) -> None:
    client = sdk(gw)
    run = uuid.uuid4().hex[:8]
    for i in range(2):
        turns = play(client, vllm_engines, f"msg-{run}-{i}")
        home = turns[0]["backend"]
        assert [t["backend"] for t in turns] == [home] * TURNS, turns
        assert [t["route"] for t in turns] == ["new_least_loaded"] + ["affinity_hit"] * (TURNS - 1)
        assert [t["count"] for t in turns] == [(home, "affinity_hit")] * TURNS
        for turn in turns[1:]:
            assert turn["served"].hits >= BLOCK, turns  # the previous turn's prompt, from the cache
    assert gw.wait_idle() == 0
    metrics = httpx.get(gw.url + "/metrics").text
    prompt = [line for line in metrics.splitlines() if line.startswith("warmroute_prompt_tokens_total{")]
    assert prompt and sum(float(line.rsplit(" ", 1)[1]) for line in prompt) > 0


def test_errors_are_the_sdk_s_own_exception_classes(gw: RunningGateway) -> None:
    client = sdk(gw)
    user = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=8, messages=user)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model=MODEL,
            max_tokens=2048,
            messages=user,
            thinking={"type": "enabled", "budget_tokens": 10},
        )
    assert "thinking.budget_tokens" in bad.value.message
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=0, messages=user)
