"""Engine signals: read under each engine's names, pushed into the ttft snapshot while fresh, re-exported."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import generate_latest

from backends.engine_metrics import SignalScraper, parse_signals
from backends.registry import SIGNALS_MAX_AGE_S, Registry
from backends.signals import EngineSignals
from config.settings import Dialect, load_settings
from gateway.metrics import Metrics

VLLM = """\
vllm:num_requests_waiting{model_name="m",engine="0"} 3
vllm:num_requests_waiting{model_name="m",engine="1"} 1
vllm:num_requests_running{model_name="m"} 5
vllm:kv_cache_usage_perc{model_name="m"} 0.25
vllm:prefix_cache_queries_total{model_name="m"} 1000
vllm:prefix_cache_hits_total{model_name="m"} 600
vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 70
vllm:spec_decode_num_draft_tokens_total{model_name="m"} 100
"""
VLLM_OLD = """\
vllm:num_requests_waiting{model_name="m"} 2
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
vllm:gpu_prefix_cache_queries_total{model_name="m"} 40
vllm:gpu_prefix_cache_hits_total{model_name="m"} 10
"""
SGLANG = """\
sglang:num_queue_reqs{model_name="m"} 4
sglang:num_running_reqs{model_name="m"} 8
sglang:token_usage{model_name="m"} 0.52
sglang:cache_hit_rate{model_name="m"} 0.28
sglang:spec_accept_length{model_name="m"} 2.5
"""
LLAMA_CPP = """\
llamacpp:requests_processing 2
llamacpp:requests_deferred 6
llamacpp:prompt_tokens_seconds 812.5
"""


def test_vllm_current_names() -> None:
    assert parse_signals(VLLM, 5.0) == EngineSignals(
        5.0, 4.0, 5.0, 0.25, 1000.0, 600.0, None, 70.0, 100.0, None
    )


def test_vllm_older_names() -> None:
    s = parse_signals(VLLM_OLD, 0.0)
    assert (s.waiting, s.kv_usage, s.prefix_queries, s.prefix_hits) == (2.0, 0.5, 40.0, 10.0)


def test_sglang_names() -> None:
    s = parse_signals(SGLANG, 0.0)
    assert (s.waiting, s.running, s.kv_usage, s.prefix_hit_rate, s.spec_accept_length) == (
        4,
        8,
        0.52,
        0.28,
        2.5,
    )


def test_llama_cpp_names_and_absence_is_none() -> None:
    s = parse_signals(LLAMA_CPP, 0.0)
    assert (s.waiting, s.running, s.kv_usage, s.prefix_queries) == (6.0, 2.0, None, None)
    assert parse_signals("", 0.0) == EngineSignals(0.0)


def registry() -> Registry:
    settings = load_settings(None, backends=[{"id": n, "url": f"http://{n}", "models": ["m"]} for n in "ab"])
    return Registry(settings.backends)


def test_fresh_signals_reach_the_snapshot_and_stale_ones_do_not() -> None:
    reg = registry()
    reg.backends["a"].signals = parse_signals(VLLM, at=100.0)
    reg.backends["b"].signals = parse_signals(VLLM, at=100.0 - SIGNALS_MAX_AGE_S - 1)
    a, b = reg.candidates("m", {"a": 2}, None, now=100.0)
    assert (a.id, a.waiting, a.conversations, b.waiting) == ("a", 4, 2, -1)


def test_the_prefill_ledger_counts_until_the_first_byte_or_the_release() -> None:
    reg = registry()
    first, second = reg.lease("a"), reg.lease("a")
    first.prefill(1000)
    second.prefill(300)
    assert (reg.backends["a"].prefilling, second.queued_tokens) == (1300, 1000)
    first.first_byte()
    first.first_byte()
    assert reg.backends["a"].prefilling == 300
    second.release()
    first.release()
    assert (reg.backends["a"].prefilling, reg.backends["a"].in_flight) == (0, 0)


def test_the_first_byte_hook_is_called_once_at_the_first_byte_and_never_by_a_release() -> None:
    reg = registry()
    first, second = reg.lease("a"), reg.lease("a")
    seen: list[str] = []
    first.on_first_byte = lambda: seen.append("first")
    second.on_first_byte = lambda: seen.append("second")
    first.first_byte()
    first.first_byte()
    first.release()
    second.release()  # no first byte came: nothing to time
    assert seen == ["first"]


def test_signals_and_learned_rates_are_exported_per_backend() -> None:
    reg = registry()
    reg.backends["a"].signals = parse_signals(SGLANG, 0.0)
    reg.backends["a"].prefill_tps = 1234.0
    lines = generate_latest(Metrics(reg).registry).decode().splitlines()
    engine = sorted(line for line in lines if line.startswith("warmroute_engine_signal{"))
    assert engine == [
        'warmroute_engine_signal{backend="a",signal="kv_usage"} 0.52',
        'warmroute_engine_signal{backend="a",signal="prefix_hit_rate"} 0.28',
        'warmroute_engine_signal{backend="a",signal="running"} 8.0',
        'warmroute_engine_signal{backend="a",signal="spec_accept_length"} 2.5',
        'warmroute_engine_signal{backend="a",signal="waiting"} 4.0',
    ]
    assert 'warmroute_backend_prefill_tokens_per_second{backend="a"} 1234.0' in lines


@pytest.mark.anyio
async def test_the_scraper_reads_each_backend_and_keeps_the_last_signals_when_one_fails() -> None:
    reg = registry()

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "a":
            return httpx.Response(200, text=VLLM)
        return httpx.Response(404)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        scraper = SignalScraper(reg, client, clock=lambda: 7.0)
        reg.backends["b"].signals = old = parse_signals(SGLANG, 1.0)
        await scraper.scrape_all()
    assert reg.backends["a"].signals == parse_signals(VLLM, 7.0)
    assert reg.backends["b"].signals is old


def test_vllm_cache_config_info_is_read_as_the_kv_cache_size_in_tokens() -> None:
    text = (
        'vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
        'num_gpu_blocks="1000",num_cpu_blocks="None"} 1.0\n' + VLLM
    )
    s = parse_signals(text, 0.0, Dialect.VLLM)
    assert (s.kv_capacity, s.waiting) == (16_000.0, 4.0)
    assert ("kv_capacity", 16_000.0) in s.readings()
    # Without the labels (or with a number that is none) it is unknown, not zero.
    assert parse_signals('vllm:cache_config_info{block_size="16"} 1.0\n', 0.0).kv_capacity is None
    bad = 'vllm:cache_config_info{num_gpu_blocks="None",block_size="16"} 1.0\n'
    assert parse_signals(bad, 0.0).kv_capacity is None
    other = 'vllm:cache_config_info{xnum_gpu_blocks="9",num_gpu_blocks="2",block_size="32"} 1\n'
    assert parse_signals(other, 0.0).kv_capacity == 64.0


def test_the_kv_cache_size_reaches_the_snapshot_and_does_not_go_stale() -> None:
    reg = Registry(load_settings(None, backends=[{"id": "a", "url": "http://a", "models": ["m"]}]).backends)
    text = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1\n'
    reg.backends["a"].signals = parse_signals(text, at=0.0)
    (c,) = reg.candidates("m", {}, None, now=SIGNALS_MAX_AGE_S + 100.0)
    assert c.kv_capacity == 1600
    reg.backends["a"].signals = None
    assert reg.candidates("m", {}, None, now=0.0)[0].kv_capacity == 0
