"""A real vLLM CPU engine publishing KV cache events (``--kv-events-config``, ZMQ on 127.0.0.1) with a small
KV cache (``--num-gpu-blocks-override``) behind a ttft gateway that subscribes to them.

A conversation's second turn is estimated warm from the events (the index's estimate against the engine's own
``cached_tokens``); other work then evicts it, and its third turn is estimated cold, as the engine reports.
Then the same multi-turn workload, more conversations than one engine's cache holds, runs through two engines
twice, caches reset between: the engines' prefix-cache hit rate with events is at least that without.
Two engines of its own, eager mode, started together (~40-60 s), not the session's: eviction and pressure need
caches of 3,072 tokens. The session's engines hold ~350k tokens each and serve every other module; a cache
that small would evict those modules' conversations, and filling theirs would cost more prefill than these
two starts.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from config.settings import load_settings
from gateway.app import Gateway, create_app
from gateway.metrics import KvEventsMetrics
from tools.procs import free_port

from .engines import EngineConfig, VllmEngine, cpu_sets, wait_all_healthy
from .gateways import FAST_HEALTH, MODEL, NO_THINKING
from .prompts import filler_text
from upstreams import serve  # tests/ is on sys.path: pytest puts it there for the tests/e2e package

BLOCK = 32  # the CPU backend wants multiples of 32
BLOCKS = 96  # 3072 tokens of KV cache: a few prompts of 1500 tokens evict everything else
MAX_LEN = 2048
ENGINE = "kv-0"
OTHER = "kv-1"


def wait(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s:.0f}s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def kv_engines(
    engine_config: EngineConfig, engine_log_dir: Path
) -> Iterator[list[tuple[VllmEngine, int, int]]]:
    started = []
    for name, cpus in zip((ENGINE, OTHER), cpu_sets(2), strict=True):
        pub, replay = free_port(), free_port()
        kv = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": "kv",
              "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}  # fmt: skip
        cfg = dataclasses.replace(
            engine_config,
            max_model_len=MAX_LEN,
            extra_args=(
                "--kv-events-config", json.dumps(kv),
                "--block-size", str(BLOCK),
                "--num-gpu-blocks-override", str(BLOCKS),
                "--enable-prompt-tokens-details",
            ),
            extra_env=(("VLLM_SERVER_DEV_MODE", "1"),),  # POST /reset_prefix_cache between phases
        )  # fmt: skip
        engine = VllmEngine(cfg, name=name, port=free_port(), cpus=cpus,
                            log_path=engine_log_dir / f"{name}.log")  # fmt: skip
        engine.start()
        started.append((engine, pub, replay))
    try:
        wait_all_healthy([e for e, _, _ in started])
        yield started
    finally:
        for engine, _, _ in started:
            engine.stop()


@pytest.fixture(scope="module")
def kv_engine(kv_engines: list[tuple[VllmEngine, int, int]]) -> tuple[VllmEngine, int, int]:
    return kv_engines[0]


def backend_config(engine: VllmEngine, pub: int, replay: int, events: bool = True) -> dict[str, Any]:
    events_cfg = {"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                  "topic": "kv"}  # fmt: skip
    return {"id": engine.name, "url": engine.base_url, "models": [MODEL], "dialect": "vllm",
            **({"kv_events": events_cfg} if events else {})}  # fmt: skip


def chat(base: str, messages: list[dict[str, Any]], max_tokens: int = 4) -> dict[str, Any]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **NO_THINKING}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_after_the_engine_evicts_a_conversation_the_estimate_says_cold(
    kv_engine: tuple[VllmEngine, int, int],
) -> None:
    engine, pub, replay = kv_engine
    backend = backend_config(engine, pub, replay)
    settings = load_settings(
        None, backends=[backend], routing={"policy": "ttft"}, health=FAST_HEALTH, canary={"enabled": False}
    )
    app = create_app(settings)
    gw: Gateway = app.state.gateway
    with serve(app) as (url, _server):
        kv, m = gw.kv, gw.metrics.kv
        assert kv is not None and m is not None
        index = kv.engine(ENGINE)
        # The subscription is live once a batch arrives: warm up straight on the engine until one does.
        n = 0

        def seen() -> bool:
            nonlocal n
            if index.expected_seq is None:
                n += 1
                chat(engine.base_url, [{"role": "user", "content": filler_text(100, f"warm-{n}")}], 1)
            return index.expected_seq is not None

        wait(seen, 60, "a KV event batch at the gateway")
        assert index.block_size == BLOCK

        history: list[dict[str, Any]] = [
            {"role": "system", "content": filler_text(300, "sys")},
            {"role": "user", "content": filler_text(200, "conv-t1")},
        ]
        first = chat(url, history)
        wait(lambda: len(kv) > 0, 30, "turn 1 tied to its blocks")
        prompt1 = first["usage"]["prompt_tokens"]

        history += [
            {"role": "assistant", "content": first["choices"][0]["message"]["content"] or ""},
            {"role": "user", "content": filler_text(60, "conv-t2")},
        ]
        second = chat(url, history)
        reported2 = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert _compared(m) == 1
        assert m.estimated[(ENGINE,)] == prompt1 // BLOCK * BLOCK > 0  # the events' estimate...
        # ...and what the engine read: at least that, less the last block when the generation prompt in it is
        # rendered differently in the history (plus the reply's blocks when it is not)
        assert reported2 >= m.estimated[(ENGINE,)] - BLOCK > 0

        # Other work, straight on the engine, fills its cache: the conversation's blocks are evicted.
        removed = m.events.get((ENGINE, "BlockRemoved"), 0)
        for tag in ("fill-a", "fill-b", "fill-c"):
            chat(engine.base_url, [{"role": "user", "content": filler_text(1500, tag)}], 1)
        wait(lambda: m.events.get((ENGINE, "BlockRemoved"), 0) > removed, 30, "evictions announced")
        keys = list(kv._records)  # the conversation's keys (reply key, head key)
        wait(lambda: all(kv.held(k, ENGINE) == 0 for k in keys), 30, "the conversation's blocks gone")

        history += [
            {"role": "assistant", "content": second["choices"][0]["message"]["content"] or ""},
            {"role": "user", "content": filler_text(60, "conv-t3")},
        ]
        estimated = m.estimated[(ENGINE,)]
        third = chat(url, history)
        assert third["usage"]["prompt_tokens_details"]["cached_tokens"] < BLOCK  # the engine: cold
        assert _compared(m) == 2
        assert m.estimated[(ENGINE,)] == estimated  # the gateway's estimate for turn 3 was 0: cold too
        assert m.gaps == {}


def _compared(m: KvEventsMetrics) -> int:
    return m.compared.get((ENGINE,), 0)


CONVERSATIONS = 6  # ~700 tokens each by turn 3: more than one engine's 3072-token cache, less than two


def conversation_turns(n: int) -> list[list[dict[str, Any]]]:
    return [
        [{"role": "system", "content": filler_text(250, f"pressure-sys-{i}")},
         {"role": "user", "content": filler_text(150, f"pressure-t1-{i}")}]
        for i in range(n)
    ]  # fmt: skip


def hit_rate_of_follow_ups(url: str) -> float:
    """Turn by turn across the conversations (each turn of all before the next): cached / prompt tokens of
    turns 2 and 3, as the engines report them."""
    histories = conversation_turns(CONVERSATIONS)
    cached = prompt = 0
    for turn in (1, 2, 3):
        for i, history in enumerate(histories):
            if turn > 1:
                history.append({"role": "user", "content": filler_text(40, f"pressure-t{turn}-{i}")})
            out = chat(url, history)
            history.append({"role": "assistant", "content": out["choices"][0]["message"]["content"] or ""})
            if turn > 1:
                cached += out["usage"]["prompt_tokens_details"]["cached_tokens"]
                prompt += out["usage"]["prompt_tokens"]
    return cached / prompt


def await_subscription(gw: Gateway, engine: VllmEngine) -> None:
    """Warm up straight on ``engine`` until the gateway has a KV event batch from it."""
    assert gw.kv is not None
    index, sent = gw.kv.engine(engine.name), [0]

    def seen() -> bool:
        if index.expected_seq is None:
            sent[0] += 1
            chat(engine.base_url, [{"role": "user", "content": filler_text(50, f"w-{sent[0]}")}], 1)
        return index.expected_seq is not None

    wait(seen, 60, f"a KV event batch from {engine.name}")


def reset_caches(engines: list[VllmEngine]) -> None:
    for engine in engines:
        r = httpx.post(engine.base_url + "/reset_prefix_cache", timeout=30)
        assert r.status_code == 200, r.text


def test_the_engines_hit_rate_with_events_is_at_least_that_without(
    kv_engines: list[tuple[VllmEngine, int, int]],
) -> None:
    engines = [e for e, _, _ in kv_engines]
    rates = {}
    for events in (False, True):
        backends = [backend_config(e, pub, replay, events) for e, pub, replay in kv_engines]
        settings = load_settings(
            None, backends=backends, routing={"policy": "ttft"}, health=FAST_HEALTH, canary={"enabled": False}
        )
        app = create_app(settings)
        gw: Gateway = app.state.gateway
        with serve(app) as (url, _server):
            for engine in engines if events else ():  # live subscriptions first: a batch from each
                await_subscription(gw, engine)
            reset_caches(engines)
            rates[events] = hit_rate_of_follow_ups(url)
    assert rates[False] > 0  # the workload does reuse prefixes
    assert rates[True] >= rates[False], rates
