"""The engine dialect table: a complete entry per configured dialect; /metrics read under its own names."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import httpx
import pytest

from backends.dialects import DIALECTS, REASONING_FIELDS, EngineDialect, ShapeName, SignalNames
from backends.engine_metrics import SignalScraper, parse_signals
from backends.registry import Registry
from backends.signals import EngineSignals
from config.settings import Dialect, load_settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dialect", list(Dialect))
def test_every_dialect_has_a_complete_entry(dialect: Dialect) -> None:
    entry = DIALECTS[dialect]
    assert isinstance(entry, EngineDialect)
    for f in dataclasses.fields(EngineDialect):
        assert hasattr(entry, f.name), f.name
    assert "none" in entry.budget.efforts  # every engine can be told not to think
    assert entry.reasoning_fields and set(entry.reasoning_fields) <= set(REASONING_FIELDS)
    assert all(isinstance(k, str) and isinstance(v, bool) for k, v in entry.continuation.items())
    assert entry.metrics.waiting and entry.metrics.running  # the queue signals routing needs
    assert {ShapeName.CHAT, ShapeName.COMPLETIONS} <= entry.native_shapes <= set(ShapeName)


def test_the_table_has_exactly_the_configured_dialects() -> None:
    assert set(DIALECTS) == set(Dialect)


def test_the_facts_per_engine() -> None:
    vllm, sglang, llamacpp, openai = (DIALECTS[d] for d in Dialect)
    assert (vllm.embeds is not None, sglang.embeds, llamacpp.embeds, openai.embeds is not None) == (
        True,
        None,
        None,
        True,
    )
    assert dict(vllm.continuation) == {"continue_final_message": True, "add_generation_prompt": False}
    assert dict(sglang.continuation) == {"continue_final_message": True}
    assert dict(llamacpp.continuation) == {}  # a trailing assistant message is a prefill by default
    assert [d.budget.native for d in (vllm, sglang, llamacpp, openai)] == [True, True, True, False]
    assert vllm.reasoning_fields == ("reasoning", "reasoning_content")
    assert sglang.reasoning_fields == llamacpp.reasoning_fields == ("reasoning_content",)
    assert ShapeName.RESPONSES in vllm.native_shapes and ShapeName.RESPONSES not in llamacpp.native_shapes
    assert ShapeName.MESSAGES not in openai.native_shapes
    assert REASONING_FIELDS == ("reasoning", "reasoning_content")


def test_the_generic_dialect_reads_every_engines_metrics() -> None:
    others = (DIALECTS[d].metrics.all() for d in Dialect if d is not Dialect.OPENAI)
    assert DIALECTS[Dialect.OPENAI].metrics.all() == frozenset().union(*others)


def test_the_table_imports_only_config_and_the_standard_library() -> None:
    tree = ast.parse((ROOT / "backends" / "dialects.py").read_text())
    imported = {
        (node.module or "").split(".")[0] if isinstance(node, ast.ImportFrom) else alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported - {"__future__", "collections", "dataclasses", "enum", "types", "typing"} == {"config"}


# -- /metrics per dialect -----------------------------------------------------------------------------------

# One exposition carrying every engine's series, each with its own values: a dialect reads only its own.
MIXED = """\
vllm:num_requests_waiting{model_name="m"} 1
vllm:num_requests_running{model_name="m"} 2
vllm:kv_cache_usage_perc{model_name="m"} 0.1
vllm:prefix_cache_queries_total{model_name="m"} 100
vllm:prefix_cache_hits_total{model_name="m"} 40
sglang:num_queue_reqs{model_name="m"} 3
sglang:num_running_reqs{model_name="m"} 4
sglang:token_usage{model_name="m"} 0.3
sglang:cache_hit_rate{model_name="m"} 0.5
llamacpp:requests_deferred 5
llamacpp:requests_processing 6
llamacpp:kv_cache_usage_ratio 0.6
"""

EXPECTED = {
    Dialect.VLLM: EngineSignals(9.0, 1.0, 2.0, 0.1, 100.0, 40.0),
    Dialect.SGLANG: EngineSignals(9.0, 3.0, 4.0, 0.3, prefix_hit_rate=0.5),
    Dialect.LLAMACPP: EngineSignals(9.0, 5.0, 6.0, 0.6),
    # the generic dialect: the first name found per signal, vLLM's first
    Dialect.OPENAI: EngineSignals(9.0, 1.0, 2.0, 0.1, 100.0, 40.0, 0.5),
}


@pytest.mark.parametrize("dialect", list(Dialect))
def test_each_dialect_reads_its_own_metric_names(dialect: Dialect) -> None:
    assert parse_signals(MIXED, 9.0, dialect) == EXPECTED[dialect]


def test_older_vllm_names_are_vllms() -> None:
    old = 'vllm:gpu_cache_usage_perc{model_name="m"} 0.7\nvllm:gpu_prefix_cache_hits 8\n'
    s = parse_signals(old, 0.0, Dialect.VLLM)
    assert (s.kv_usage, s.prefix_hits) == (0.7, 8.0)
    assert parse_signals(old, 0.0, Dialect.SGLANG) == EngineSignals(0.0)


def test_merged_names_keep_each_engines_order() -> None:
    a, b = SignalNames(waiting=("a1", "a2")), SignalNames(waiting=("b1",), running=("b2",))
    assert SignalNames.merged(a, b) == SignalNames(waiting=("a1", "a2", "b1"), running=("b2",))


@pytest.mark.anyio
async def test_the_scraper_reads_each_backend_under_its_own_dialect() -> None:
    backends = [
        {"id": d.value, "url": f"http://{d.value}", "models": ["m"], "dialect": d.value} for d in Dialect
    ]
    reg = Registry(load_settings(None, backends=backends).backends)
    asked: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.host)
        return httpx.Response(200, text=MIXED)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        await SignalScraper(reg, client, clock=lambda: 9.0).scrape_all()
    assert sorted(asked) == sorted(d.value for d in Dialect)
    assert {d: reg.backends[d.value].signals for d in Dialect} == EXPECTED
