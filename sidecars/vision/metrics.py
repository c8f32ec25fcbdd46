"""Every sidecar collector, in its own registry (never the gateway's), ``warmroute_vision_*``.

Label values come only from error codes (a fixed set in errors.py), never from requests.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

SECONDS = (0.005, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 80)


class VisionMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.encode_seconds = Histogram(
            "warmroute_vision_encode_seconds",
            "Preprocess + vision tower per image",
            buckets=SECONDS,
            registry=r,
        )
        self.fetch_seconds = Histogram(
            "warmroute_vision_fetch_seconds",
            "Image download or data: URI decode",
            buckets=SECONDS,
            registry=r,
        )
        self.megapixels = Histogram(
            "warmroute_vision_megapixels",
            "Pixels fed to the tower per encoded image, after the pixel cap",
            buckets=(0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.25, 2, 4),
            registry=r,
        )
        self.tokens = Histogram(
            "warmroute_vision_tokens",
            "Embedding tokens per encoded image",
            buckets=(16, 64, 128, 256, 512, 1024, 1536, 2048, 4096),
            registry=r,
        )
        self.cache_hits = Counter(
            "warmroute_vision_cache_hits_total", "Encodes served from cache", registry=r
        )
        self.cache_misses = Counter("warmroute_vision_cache_misses_total", "Encodes computed", registry=r)
        self.cache_bytes = Gauge("warmroute_vision_cache_bytes", "Bytes held by the result cache", registry=r)
        self.cache_entries = Gauge("warmroute_vision_cache_entries", "Results held by the cache", registry=r)
        self.queue_depth = Gauge(
            "warmroute_vision_queue_depth",
            "Encodes admitted: fetching, decoding, queued or in the tower",
            registry=r,
        )
        self.rejections = Counter(
            "warmroute_vision_rejections_total", "Requests refused, by error code", ["reason"], registry=r
        )
        self.weights_bytes_read = Gauge(
            "warmroute_vision_weights_bytes_read",
            "Checkpoint bytes read to load the vision tower",
            registry=r,
        )
        self.checkpoint_bytes = Gauge(
            "warmroute_vision_checkpoint_bytes", "Size of all the checkpoint's weight files", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
