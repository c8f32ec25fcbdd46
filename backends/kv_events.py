"""Engines' KV cache events: a ZMQ subscriber per engine and the msgpack decoder (the I/O edge).

Wire format (vLLM ``vllm/distributed/kv_events.py``, SGLang ``srt/disaggregation/kv_events.py``): a PUB socket
sends multipart ``[topic, sequence (8 bytes, big-endian), payload]``; the payload is a msgpack
``[ts, events, dp_rank?]`` (a msgspec ``array_like`` struct). vLLM (0.32) encodes each event as a map tagged
by ``"type"`` (``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ..., "token_ids": [...],
"block_size": 16, ...}``); SGLang and older vLLM as an array with the tag first (``["BlockStored",
hashes, parent, token_ids, block_size, lora_id, ...]``). Both are read; fields routing does not need are
ignored.
Block hashes are bytes (vLLM's sha256) or ints (SGLang, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).

Sequence numbers are checked: a batch past the next expected one means some were lost (the subscriber's
high-water mark, a reconnect); the replay socket (ROUTER: send the first missing sequence, receive
``[seq, payload]`` frames up to seq -1) is asked for them; what it cannot give makes the engine's index
lose what it knew (``routing.kvindex``). A lower sequence on the stream is a restarted engine: its cache is
empty, and so is the index.

Bounded: the SUB socket keeps at most ``RCV_HWM`` batches (more are dropped by ZMQ: a gap), and the index
has its own bounds. Decoding and applying run on the event loop between requests (msgpack's C decoder, a
few µs per block); nothing on the request path waits for this.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import Callable, Sequence
from enum import StrEnum
from typing import Any, Protocol

from config.settings import KvEventsConfig
from routing.kvindex import BlockHash, Cleared, EngineIndex, KvEvent, Removed, Stored

log = logging.getLogger("warmroute.kv_events")

#: Batches the SUB socket queues before ZMQ drops (the index sees a gap).
RCV_HWM = 10_000
#: A decoded batch with more events than this is refused (bounded work per message).
MAX_EVENTS = 100_000
_END_SEQ = -1
_RETRY_S = 1.0


class KvEventType(StrEnum):
    """Event kinds: metric label values."""

    STORED = "BlockStored"
    REMOVED = "BlockRemoved"
    CLEARED = "AllBlocksCleared"


class KvDecodeError(ValueError):
    """A message that is not a KV event batch."""


class KvEventsUnavailable(RuntimeError):
    """The ``kv`` extra (pyzmq, msgpack) is not installed."""


class KvEventMetrics(Protocol):
    """What the gateway counts (``gateway.metrics.KvEventsMetrics``). No I/O."""

    def received(self, backend: str, kind: KvEventType, n: int) -> None: ...

    def gap(self, backend: str, replayed: bool) -> None: ...


class _NoMetrics:
    def received(self, backend: str, kind: KvEventType, n: int) -> None:
        pass

    def gap(self, backend: str, replayed: bool) -> None:
        pass


def _module(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise KvEventsUnavailable(
            f"backends[].kv_events needs {name}: install the kv extra (pip install 'warmroute[kv]')"
        ) from exc


def require_kv_extra() -> None:
    """Raise ``KvEventsUnavailable`` unless pyzmq and msgpack import (checked once, at startup)."""
    _module("zmq")
    _module("msgpack")


# -- decoding ----------------------------------------------------------------------------------------------


def decode_batch(payload: bytes) -> tuple[list[KvEvent], dict[KvEventType, int]]:
    """The events of one payload, and how many of each kind. Raises ``KvDecodeError``."""
    msgpack = _module("msgpack")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types for malformed input
        raise KvDecodeError(f"not msgpack: {exc}") from None
    if not isinstance(batch, list | tuple) or len(batch) < 2 or not isinstance(batch[1], list | tuple):
        raise KvDecodeError("not an event batch [ts, events, ...]")
    raw_events = batch[1]
    if len(raw_events) > MAX_EVENTS:
        raise KvDecodeError(f"{len(raw_events)} events in one batch (at most {MAX_EVENTS})")
    events: list[KvEvent] = []
    counts: dict[KvEventType, int] = {}
    for raw in raw_events:
        event = decode_event(raw)
        if event is None:
            continue  # an event kind this gateway does not use
        kind = _KINDS[type(event)]
        counts[kind] = counts.get(kind, 0) + 1
        events.append(event)
    return events, counts


def decode_event(raw: object) -> KvEvent | None:
    """One event, map-tagged (vLLM) or array-tagged (SGLang, older vLLM); None for an unknown kind."""
    if isinstance(raw, dict):
        tag = raw.get("type")
        fields = raw
    elif isinstance(raw, list | tuple) and raw:
        tag = raw[0]
        names = _POSITIONAL.get(tag) if isinstance(tag, str) else None
        fields = dict(zip(names or (), raw[1:], strict=False))
    else:
        raise KvDecodeError("an event is neither a map nor a tagged array")
    if tag == KvEventType.STORED:
        size = fields.get("block_size")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise KvDecodeError("BlockStored without a positive block_size")
        parent = fields.get("parent_block_hash")
        return Stored(_hashes(fields.get("block_hashes")), None if parent is None else _hash(parent), size)
    if tag == KvEventType.REMOVED:
        return Removed(_hashes(fields.get("block_hashes")))
    if tag == KvEventType.CLEARED:
        return Cleared()
    if not isinstance(tag, str):
        raise KvDecodeError("an event without a type tag")
    return None


_POSITIONAL: dict[str, tuple[str, ...]] = {
    KvEventType.STORED: ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium"),
    KvEventType.REMOVED: ("block_hashes", "medium"),
    KvEventType.CLEARED: (),
}
_KINDS: dict[type, KvEventType] = {
    Stored: KvEventType.STORED,
    Removed: KvEventType.REMOVED,
    Cleared: KvEventType.CLEARED,
}


def _hash(value: object) -> BlockHash:
    if isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise KvDecodeError("a block hash is neither bytes nor an int")


def _hashes(value: object) -> tuple[BlockHash, ...]:
    if not isinstance(value, list | tuple):
        raise KvDecodeError("block_hashes is not a list")
    return tuple(_hash(v) for v in value)


def parse_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KvDecodeError("the sequence frame is not 8 bytes")
    return int.from_bytes(frame, "big", signed=True)


# -- the subscriber ----------------------------------------------------------------------------------------


class KvEventSubscriber:
    """Reads one engine's events into its ``EngineIndex``; one task. Decoding errors are logged and
    counted as a gap (the index cannot trust what follows a batch it could not read)."""

    def __init__(
        self,
        backend: str,
        cfg: KvEventsConfig,
        index: EngineIndex,
        metrics: KvEventMetrics | None = None,
        on_batch: Callable[[], None] | None = None,
    ) -> None:
        self.backend = backend
        self.cfg = cfg
        self.index = index
        self.metrics: KvEventMetrics = metrics or _NoMetrics()
        self.on_batch = on_batch  # called after every applied batch (tests wait on it)
        self.connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"warmroute-kv-events-{self.backend}")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        zmq_asyncio = _module("zmq.asyncio")
        zmq = _module("zmq")
        ctx = zmq_asyncio.Context()
        try:
            while True:
                sub = ctx.socket(zmq.SUB)
                try:
                    sub.setsockopt(zmq.RCVHWM, RCV_HWM)
                    sub.setsockopt(zmq.LINGER, 0)
                    sub.setsockopt(zmq.SUBSCRIBE, self.cfg.topic.encode())
                    sub.connect(self.cfg.endpoint)
                    self.connected.set()
                    await self._read(sub, ctx, zmq)
                except (OSError, zmq.ZMQError) as exc:
                    log.warning("kv events %s: %s; reconnecting", self.backend, exc)
                finally:
                    sub.close(linger=0)
                await asyncio.sleep(_RETRY_S)
        finally:
            ctx.term()

    async def _read(self, sub: Any, ctx: Any, zmq: Any) -> None:
        while True:
            frames = await sub.recv_multipart()
            try:
                if len(frames) != 3:
                    raise KvDecodeError(f"{len(frames)} frames, not [topic, seq, payload]")
                seq = parse_seq(frames[1])
                expected = self.index.expected_seq
                if expected is not None and seq > expected:
                    await self._fill(ctx, zmq, expected, seq)
                self._apply(seq, frames[2], replayed=False)
            except KvDecodeError as exc:
                log.warning(
                    "kv events %s: unreadable batch (%s): what it holds is unknown", self.backend, exc
                )
                self.index.lose()
                self.index.expected_seq = None
                self.metrics.gap(self.backend, replayed=False)

    def _apply(self, seq: int, payload: bytes, *, replayed: bool) -> None:
        events, counts = decode_batch(payload)
        if replayed:
            self.index.replayed(seq, events)
        else:
            gaps = self.index.gaps
            self.index.apply(seq, events)
            if self.index.gaps != gaps:
                log.info("kv events %s: batches lost before %d: what it holds is unknown", self.backend, seq)
                self.metrics.gap(self.backend, replayed=False)
        for kind, n in counts.items():
            self.metrics.received(self.backend, kind, n)
        if self.on_batch is not None:
            self.on_batch()

    async def _fill(self, ctx: Any, zmq: Any, first: int, upto: int) -> None:
        """Ask the replay socket for batches ``first`` .. ``upto - 1``; what it cannot give stays a gap."""
        if self.cfg.replay_endpoint is None:
            return
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.cfg.replay_endpoint)
            await sock.send_multipart([b"", first.to_bytes(8, "big")])
            async with asyncio.timeout(self.cfg.replay_timeout_s):
                await self._replayed(sock, upto)
        except (TimeoutError, OSError, zmq.ZMQError) as exc:
            log.warning("kv events %s: replay from %d failed: %s", self.backend, first, exc or "timeout")
        finally:
            sock.close(linger=0)
        if self.index.expected_seq == upto:
            self.metrics.gap(self.backend, replayed=True)

    async def _replayed(self, sock: Any, upto: int) -> None:
        while True:
            frames: Sequence[bytes] = await sock.recv_multipart()
            if len(frames) != 3 or frames[0] != b"":
                raise KvDecodeError("a replay reply is not [empty, seq, payload]")
            seq = parse_seq(frames[1])
            if seq == _END_SEQ:
                return
            if seq < upto:
                self._apply(seq, frames[2], replayed=True)
