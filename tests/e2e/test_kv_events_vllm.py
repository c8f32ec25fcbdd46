"""A real vLLM CPU engine publishing KV cache events (``--kv-events-config``, ZMQ on 127.0.0.1) with a small
KV cache (``--num-gpu-blocks-override``) behind a ttft gateway that subscribes to them.

A conversation's second turn is estimated warm from the events (the index's estimate against the engine's own
``cached_tokens``); other work then evicts it, and its third turn is estimated cold, as the engine reports.
One engine of its own (the session's two are not started), eager mode: one start of ~35-90 s.
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

from .engines import EngineConfig, VllmEngine, cpu_sets
from .gateways import FAST_HEALTH, MODEL, NO_THINKING
from .prompts import filler_text
from upstreams import serve  # tests/ is on sys.path: pytest puts it there for the tests/e2e package

BLOCK = 32  # the CPU backend wants multiples of 32
BLOCKS = 96  # 3072 tokens of KV cache: a few prompts of 1500 tokens evict everything else
MAX_LEN = 2048
ENGINE = "kv-0"


def wait(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s:.0f}s"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def kv_engine(engine_config: EngineConfig, engine_log_dir: Path) -> Iterator[tuple[VllmEngine, int, int]]:
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
    )  # fmt: skip
    engine = VllmEngine(cfg, name=ENGINE, port=free_port(), cpus=cpu_sets(1)[0],
                        log_path=engine_log_dir / f"{ENGINE}.log")  # fmt: skip
    engine.start()
    try:
        engine.wait_healthy()
        yield engine, pub, replay
    finally:
        engine.stop()


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
    backend = {"id": ENGINE, "url": engine.base_url, "models": [MODEL], "dialect": "vllm",
               "kv_events": {"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                             "topic": "kv"}}  # fmt: skip
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
