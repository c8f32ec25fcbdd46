"""The harness itself, straight at the engines (no gateway): they answer, cache prefixes, and caching pays."""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from collections.abc import Callable

from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam

from .engines import PrefixCacheStats, VllmEngine
from .prompts import filler_text

MODEL = "tiny-chat"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def client(engine: VllmEngine) -> OpenAI:
    return OpenAI(base_url=engine.api_base, api_key="unused", max_retries=0, timeout=120.0)


def settled(
    read: Callable[[], PrefixCacheStats], done: Callable[[PrefixCacheStats], bool]
) -> PrefixCacheStats:
    """Counters are published a moment after the reply; poll briefly instead of sleeping a fixed time."""
    deadline = time.monotonic() + 5.0
    value = read()
    while not done(value) and time.monotonic() < deadline:
        time.sleep(0.1)
        value = read()
    return value


def stream_ttft(engine: VllmEngine, text: str) -> tuple[float, int]:
    """Seconds to the first streamed token, and the prompt's token count."""
    started = time.perf_counter()
    first: float | None = None
    prompt_tokens = 0
    stream = client(engine).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": text}],
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_THINKING,
    )
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - started
        if chunk.usage:
            prompt_tokens = chunk.usage.prompt_tokens
    return (first if first is not None else time.perf_counter() - started), prompt_tokens


def test_both_engines_answer_chat(vllm_engines: list[VllmEngine]) -> None:
    for engine in vllm_engines:
        reply = client(engine).chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
            extra_body=NO_THINKING,
        )
        assert reply.model == MODEL
        assert reply.usage is not None and reply.usage.completion_tokens >= 1
        assert reply.choices[0].finish_reason in ("length", "stop")


def test_thinking_goes_to_reasoning_field(vllm_engines: list[VllmEngine]) -> None:
    """Template opens <think>, the qwen3 parser routes it to `reasoning`, the budget closes it."""
    reply = client(vllm_engines[0]).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Think first."}],
        max_tokens=24,
        temperature=0,
        extra_body={"thinking_token_budget": 6},
    )
    extra = reply.choices[0].message.model_extra or {}
    assert extra.get("reasoning"), reply
    assert reply.usage is not None and reply.usage.completion_tokens_details is not None
    assert 1 <= (reply.usage.completion_tokens_details.reasoning_tokens or 0) <= 6


def test_repeated_prompt_hits_only_that_engines_cache(vllm_engines: list[VllmEngine]) -> None:
    a, b = vllm_engines
    text = filler_text(3000, f"affinity-{uuid.uuid4().hex}")
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": text}]
    prompt_tokens = a.count_tokens(messages)
    assert 2800 <= prompt_tokens <= 3200
    b_before, a_before = b.prefix_cache(), a.prefix_cache()

    def ask() -> None:
        client(a).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body=NO_THINKING
        )

    ask()
    a_cold = settled(a.prefix_cache, lambda s: (s - a_before).queries >= prompt_tokens) - a_before
    ask()
    a_warm = (
        settled(a.prefix_cache, lambda s: (s - a_before).queries >= 2 * prompt_tokens) - a_before - a_cold
    )
    b_delta = b.prefix_cache() - b_before

    print(f"\n[e2e] {prompt_tokens}-token prompt on {a.name}: cold {a_cold}, warm {a_warm}; other {b_delta}")
    # Nothing cached yet: the prompts share only the template's first tokens, less than one block (128 here).
    assert a_cold.queries >= prompt_tokens and a_cold.hits == 0
    assert a_warm.hits >= 0.9 * prompt_tokens
    assert b_delta == PrefixCacheStats(0.0, 0.0)


def test_cached_prefix_cuts_ttft(vllm_engines: list[VllmEngine]) -> None:
    """Cold vs warm time to first token for a ~3.5k-token prompt: 1 stream, 4 output tokens, engine-0 only."""
    engine = vllm_engines[0]
    cold, warm, sizes = [], [], []
    for _ in range(3):
        text = filler_text(3500, f"ttft-{uuid.uuid4().hex}")
        cold_s, tokens = stream_ttft(engine, text)
        warm_s, _ = stream_ttft(engine, text)
        cold.append(cold_s)
        warm.append(warm_s)
        sizes.append(tokens)
    cold_med, warm_med = statistics.median(cold), statistics.median(warm)
    print(
        f"\n[e2e] TTFT, 1 stream, {min(sizes)}-{max(sizes)}-token prompts, {engine.name}:"
        f" cold {' '.join(f'{s:.3f}' for s in cold)} (median {cold_med:.3f}s),"
        f" warm {' '.join(f'{s:.3f}' for s in warm)} (median {warm_med:.3f}s);"
        f" cold/warm {cold_med / warm_med:.1f}x",
        file=sys.stderr,
    )
    assert warm_med < 0.5 * cold_med
