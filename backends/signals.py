"""What one scrape of an engine's ``/metrics`` said (``EngineSignals``). A leaf module: the registry keeps
the last one per backend, ``backends.engine_metrics`` makes them, routing's snapshot reads them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineSignals:
    """What one scrape of an engine's ``/metrics`` said; None: the engine does not report it."""

    at: float  # monotonic time of the scrape
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None  # 0..1
    prefix_queries: float | None = None  # counters (tokens): hit rate is a ratio of their deltas
    prefix_hits: float | None = None
    prefix_hit_rate: float | None = None  # engines that report the ratio itself (SGLang)
    spec_accepted: float | None = None  # counters (tokens)
    spec_draft: float | None = None
    spec_accept_length: float | None = None  # SGLang's gauge
    kv_capacity: float | None = None  # KV cache size in tokens (vLLM's ``cache_config_info`` labels)

    def fresh(self, now: float, max_age_s: float) -> bool:
        return now - self.at <= max_age_s

    def readings(self) -> list[tuple[str, float]]:
        """(name, value) of every signal the engine reported; counters are named with ``_total``."""
        names = ("waiting", "running", "kv_usage", "prefix_hit_rate", "spec_accept_length", "kv_capacity")
        counters = ("prefix_queries", "prefix_hits", "spec_accepted", "spec_draft")
        out = [(n, v) for n in names if (v := getattr(self, n)) is not None]
        out += [(n + "_total", v) for n in counters if (v := getattr(self, n)) is not None]
        return out
