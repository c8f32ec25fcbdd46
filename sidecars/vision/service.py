"""The encode path without HTTP: fetch → cache lookup → decode → admission → the tower, with metrics.

Admission: one encode runs at a time (torch's threads parallelise inside it); up to ``queue_size`` more
wait; past that a request is refused at once with QueueFull (503) instead of queueing without bound. A
request is admitted before its image is fetched or decoded (both hold up to ``max_download_bytes`` and take
time), so the queue bounds those too; only a cache hit on a data: URI seen before is answered unadmitted.
Identical images in flight at once are encoded once (the later requests wait for the first's result).

A data: URI seen before is answered without decoding it again: a hash of the URI text maps to the content
key its bytes had (base64 decoding costs more than the whole rest of a cache hit). The mapping only ever
points to the key of those very bytes, so it changes nothing but speed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import anyio
from PIL import Image

from . import images
from .cache import ByteLRU, Encoded, content_key
from .encoder import Encoder
from .errors import NotReady, QueueFull, VisionError
from .fetch import INLINE_DECODE, ImageFetcher
from .metrics import VisionMetrics
from .settings import VisionSettings

DECODERS = 2  # images decoded at once; bounds the memory a burst of large images can take
URI_ALIASES = 4096  # data: URI text hash → content key, most recent kept


@dataclass(frozen=True, slots=True)
class Result:
    encoded: Encoded
    cached: bool
    timings: dict[str, float]


class VisionService:
    def __init__(self, settings: VisionSettings, fetcher: ImageFetcher, metrics: VisionMetrics) -> None:
        self.settings = settings
        self.fetcher = fetcher
        self.metrics = metrics
        self.cache = ByteLRU(settings.cache_bytes)
        self.encoder: Encoder | None = None
        self.load_error: str | None = None
        self.pending = 0  # encodes admitted: running + waiting
        self._tower = anyio.CapacityLimiter(1)
        self._decoders = anyio.CapacityLimiter(DECODERS)
        self._inflight: dict[str, asyncio.Future[Encoded]] = {}
        self._uri_keys: OrderedDict[bytes, str] = OrderedDict()

    def ready(self, encoder: Encoder) -> None:
        self.encoder = encoder
        self.metrics.weights_bytes_read.set(encoder.report.bytes_read)
        self.metrics.checkpoint_bytes.set(encoder.report.checkpoint_bytes)

    async def encode(self, url: str) -> Result:
        try:
            return await self._encode(url)
        except VisionError as exc:
            self.metrics.rejections.labels(exc.code).inc()
            raise

    async def _encode(self, url: str) -> Result:
        encoder = self.encoder
        if encoder is None:
            raise NotReady(
                self.load_error or "the vision tower is still loading; retry after GET /health is 200"
            )
        started = time.perf_counter()
        alias = await _alias(url) if url[:5].lower() == "data:" else None
        known = self._uri_keys.get(alias) if alias else None
        hit = self.cache.get(known) if known else None
        if hit is not None:
            self.metrics.cache_hits.inc()
            return Result(hit, True, {"fetch_ms": 0.0, "total_ms": (time.perf_counter() - started) * 1e3})
        with self._admission():
            return await self._fetch_and_encode(encoder, url, alias, started)

    async def _fetch_and_encode(
        self, encoder: Encoder, url: str, alias: bytes | None, started: float
    ) -> Result:
        fetched = await self.fetcher.fetch(url)
        fetched_at = time.perf_counter()
        self.metrics.fetch_seconds.observe(fetched_at - started)
        images.check_content_type(fetched.content_type)
        key = content_key(fetched.data, encoder.fingerprint)
        if alias:
            self._remember(alias, key)
        timings = {"fetch_ms": (fetched_at - started) * 1e3}
        hit = self.cache.get(key)
        if hit is None and key in self._inflight:
            hit = await asyncio.shield(self._inflight[key])
        if hit is not None:
            self.metrics.cache_hits.inc()
            timings["total_ms"] = (time.perf_counter() - started) * 1e3
            return Result(hit, True, timings)
        self.metrics.cache_misses.inc()
        return await self._compute(encoder, key, fetched.data, started, timings)

    def _remember(self, alias: bytes, key: str) -> None:
        self._uri_keys[alias] = key
        self._uri_keys.move_to_end(alias)
        if len(self._uri_keys) > URI_ALIASES:
            self._uri_keys.popitem(last=False)

    async def _compute(
        self, encoder: Encoder, key: str, data: bytes, started: float, timings: dict[str, float]
    ) -> Result:
        future: asyncio.Future[Encoded] = asyncio.get_running_loop().create_future()
        self._inflight[key] = future
        try:
            t0 = time.perf_counter()
            image = await anyio.to_thread.run_sync(self._decode, data, limiter=self._decoders)
            timings["decode_ms"] = (time.perf_counter() - t0) * 1e3
            encoded, work = await self._tower_run(lambda: encoder.encode(image))
            timings |= work
            self.cache.put(key, encoded)
            self._observe(encoded, work)
            future.set_result(encoded)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: joiners (if any) re-raise it; none is not an error
            raise
        finally:
            del self._inflight[key]
        timings["total_ms"] = (time.perf_counter() - started) * 1e3
        return Result(encoded, False, timings)

    def _decode(self, data: bytes) -> Image.Image:
        return images.decode(data, self.settings.max_source_pixels)

    @contextlib.contextmanager
    def _admission(self) -> Iterator[None]:
        if self.pending >= 1 + self.settings.queue_size:
            waiting, limit = self.pending - 1, self.settings.queue_size
            raise QueueFull(f"encoder queue is full ({waiting} waiting, limit {limit}); retry later")
        self.pending += 1
        self.metrics.queue_depth.set(self.pending)
        try:
            yield
        finally:
            self.pending -= 1
            self.metrics.queue_depth.set(self.pending)

    async def _tower_run(
        self, work: Callable[[], tuple[Encoded, dict[str, float]]]
    ) -> tuple[Encoded, dict[str, float]]:
        t0 = time.perf_counter()
        result = await anyio.to_thread.run_sync(work, limiter=self._tower)
        result[1]["queue_ms"] = (time.perf_counter() - t0) * 1e3 - sum(result[1].values())
        return result

    def _observe(self, encoded: Encoded, work: dict[str, float]) -> None:
        self.metrics.encode_seconds.observe((work["preprocess_ms"] + work["encode_ms"]) / 1e3)
        self.metrics.megapixels.observe(encoded.megapixels)
        self.metrics.tokens.observe(encoded.tokens)
        self.metrics.cache_bytes.set(self.cache.bytes)
        self.metrics.cache_entries.set(len(self.cache))


async def _alias(uri: str) -> bytes:
    """The hash a data: URI's text is remembered by; a long one is hashed off the event loop. A lone surrogate
    hashes too (``surrogatepass``): the fetcher refuses it by name."""
    if len(uri) <= INLINE_DECODE:
        return _digest(uri)
    return await anyio.to_thread.run_sync(_digest, uri)


def _digest(uri: str) -> bytes:
    return hashlib.sha256(uri.encode("utf-8", "surrogatepass")).digest()
