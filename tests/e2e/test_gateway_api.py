"""Through the gateway with the official client: models, chat (plain and streamed), completions, errors."""

from __future__ import annotations

import time
import uuid

import openai
import pytest

from .engines import VllmEngine
from .gateways import BACKEND_HEADER, BLOCK, MODEL, NO_THINKING, ROUTE_HEADER, RunningGateway, settled
from .prompts import filler_text


def test_models(affinity_gateway: RunningGateway, vllm_engines: list[VllmEngine]) -> None:
    client = affinity_gateway.client()
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_non_streamed(affinity_gateway: RunningGateway, vllm_engines: list[VllmEngine]) -> None:
    raw = affinity_gateway.client().chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}],
        max_tokens=8,
        temperature=0,
        extra_body=NO_THINKING,
    )
    reply = raw.parse()
    assert raw.headers[BACKEND_HEADER] in {e.name for e in vllm_engines}
    assert raw.headers[ROUTE_HEADER] == "new_least_loaded"
    assert reply.model == MODEL and reply.choices[0].message.content
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 8
    assert affinity_gateway.wait_idle() == 0


def test_chat_streamed_with_reasoning_and_usage(
    affinity_gateway: RunningGateway, vllm_engines: list[VllmEngine]
) -> None:
    """Thinking on, budget 4: reasoning deltas, then content; the usage chunk last; the stream ends."""
    raw = affinity_gateway.client().chat.completions.with_raw_response.create(
        model=MODEL,
        # A fixed prompt at temperature 0: the random-weight model's reply is the same every run (a random
        # prompt would now and then draw an immediate end-of-turn token and no reasoning at all).
        messages=[{"role": "user", "content": "Think, then answer."}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"thinking_token_budget": 4},
    )
    assert raw.headers["content-type"].startswith("text/event-stream")
    assert raw.headers[BACKEND_HEADER] in {e.name for e in vllm_engines}
    reasoning, content, arrivals, finish, usage = [], [], [], [], []
    for chunk in raw.parse():  # ends at `data: [DONE]`; a stream cut short raises instead
        arrivals.append(time.perf_counter())
        if chunk.usage is not None:
            usage.append(chunk.usage)
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning"):
                reasoning.append(extra["reasoning"])
            if choice.delta.content:
                content.append(choice.delta.content)
            if choice.finish_reason:
                finish.append(choice.finish_reason)
    assert 1 <= len(reasoning) <= 4, reasoning
    assert finish in (["length"], ["stop"])
    assert len(usage) == 1 and usage[0].completion_tokens >= len(reasoning) + len(content)
    assert usage[0].prompt_tokens > 0
    # Relayed as events (one chunk each), not one buffered body. No clock: a client that reads late (a busy
    # machine) finds every chunk already there, so arrival times say nothing about the gateway.
    assert len(arrivals) >= 4
    assert affinity_gateway.wait_idle() == 0


def test_completions_follow_their_prompt(
    affinity_gateway: RunningGateway, vllm_engines: list[VllmEngine]
) -> None:
    """/v1/completions is keyed by the prompt's head: a repeat lands on the same engine and hits its cache."""
    client = affinity_gateway.client()
    engines = {e.name: e for e in vllm_engines}
    prompt = filler_text(1500, f"completion-{uuid.uuid4().hex}")
    start = {name: e.prefix_cache() for name, e in engines.items()}
    # ignore_eos: exactly max_tokens tokens, whatever the random-weight model draws.
    first = client.completions.with_raw_response.create(
        model=MODEL, prompt=prompt, max_tokens=4, extra_body={"ignore_eos": True}
    )
    engine = engines[first.headers[BACKEND_HEADER]]
    text = first.parse()
    assert text.usage is not None and text.usage.completion_tokens == 4
    prompt_tokens = text.usage.prompt_tokens
    before = settled(engine.prefix_cache, lambda s: (s - start[engine.name]).queries >= prompt_tokens)

    raw = client.completions.with_raw_response.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    assert (raw.headers[BACKEND_HEADER], raw.headers[ROUTE_HEADER]) == (engine.name, "affinity_hit")
    chunks = list(raw.parse())
    assert sum(1 for c in chunks if c.choices) >= 2 and chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, 4)
    warm = settled(engine.prefix_cache, lambda s: (s - before).queries >= prompt_tokens) - before
    assert warm.hits >= prompt_tokens - BLOCK, warm
    assert affinity_gateway.wait_idle() == 0


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streamed"])
def test_engine_400_passes_through(
    affinity_gateway: RunningGateway, vllm_engines: list[VllmEngine], stream: bool
) -> None:
    """vLLM refuses a negative temperature (a field the gateway does not own); the client gets that 400, and
    the gateway lets go of it. A bogus `reasoning_effort` is the gateway's own 400 (test_gateway_budgets)."""
    client = affinity_gateway.client()
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=stream,
            temperature=-1.0,
        )
    err = caught.value
    assert err.status_code == 400
    assert err.response.headers.get(BACKEND_HEADER) in {e.name for e in vllm_engines}, "not the engine's 400"
    assert "temperature" in str(err.body), err.body
    assert affinity_gateway.wait_idle() == 0, "in-flight count leaked"
    backends = affinity_gateway.gateway.registry.backends
    assert {b.state.value for b in backends.values()} == {"ready"}, "a 400 must not mark an engine down"
