"""``/metrics`` with vLLM's metric names, read from the engine at scrape time.

Each app gets its own ``CollectorRegistry`` (several simulators share one test process). Like vLLM with
several ``--served-model-name`` values, the ``model_name`` label is the first served name. The KV cache's
size is vLLM's ``vllm:cache_config_info`` info gauge (value 1; ``num_gpu_blocks`` and ``block_size`` labels).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from backends.sim.engine import SimEngine

LABELS = ("model_name",)


class EngineCollector(Collector):
    def __init__(self, engine: SimEngine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine, stats = self._engine, self._engine.stats
        label = [engine.cfg.models[0]]
        counters = (
            ("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", stats.prefix_cache_hits),
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", stats.generation_tokens),
        )
        for name, doc, value in counters:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            family.add_metric(label, value)
            yield family
        gauges = (
            ("vllm:num_requests_running", "Requests in model execution batches.", engine.num_running),
            ("vllm:num_requests_waiting", "Requests waiting to be processed.", engine.num_waiting),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                engine.kv_cache_usage(),
            ),
        )
        for name, doc, gauge in gauges:
            family_g = GaugeMetricFamily(name, doc, labels=LABELS)
            family_g.add_metric(label, gauge)
            yield family_g
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=("block_size", "enable_prefix_caching", "num_gpu_blocks"),
        )
        info.add_metric([str(engine.cfg.block_size), "True", str(engine.cache.capacity_blocks)], 1.0)
        yield info
        finished = CounterMetricFamily(
            "vllm:request_success", "Count of finished requests.", labels=(*LABELS, "finished_reason")
        )
        for reason, count in sorted(stats.finished.items()):
            finished.add_metric([*label, reason], count)
        yield finished


def make_registry(engine: SimEngine) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
