"""Engines' KV cache events: the decoder (bytes as vLLM's and SGLang's publishers encode them) and the
subscriber over real ZMQ sockets on 127.0.0.1 (sequence gaps, the replay socket, restarts, bad input)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgpack
import pytest
import zmq
import zmq.asyncio

from backends.kv_events import (
    KvDecodeError,
    KvEventSubscriber,
    KvEventType,
    decode_batch,
    decode_event,
    parse_seq,
)
from config.settings import KvEventsConfig
from routing.kvindex import Cleared, EngineIndex, Removed, Stored

# Encoded by vLLM 0.32's own classes (vllm.distributed.kv_events: KVEventBatch of BlockStored x2 (the second
# with group_idx and session_id), BlockRemoved, AllBlocksCleared; data_parallel_rank 0) with
# msgspec.msgpack.Encoder, exactly as its ZmqEventPublisher does.
VLLM_BATCH = bytes.fromhex(
    "93cb41d954fc402000009488a474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392c420"
    + "01" * 32
    + "c420"
    + "02" * 32
    + "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0020000102030405060708090a0b0c0d0e0f"
    "101112131415161718191a1b1c1d1e1faa626c6f636b5f73697a6510a76c6f72615f6964c0a66d656469756da3475055a9"
    "6c6f72615f6e616d65c08aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c420"
    + "03" * 32
    + "b1706172656e745f626c6f636b5f68617368c420"
    + "02" * 32
    + "a9746f6b656e5f696473dc0010202122232425262728292a2b2c2d2e2faa626c6f636b5f73697a6510a76c6f72615f6964"
    "c0a66d656469756da3475055a96c6f72615f6e616d65c0a967726f75705f69647800aa73657373696f6e5f6964a2733183"
    "a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391c420"
    + "03" * 32
    + "a66d656469756da347505581a474797065b0416c6c426c6f636b73436c656172656400"
)
# SGLang's classes (srt/disaggregation/kv_events.py: array_like, tagged; int hashes, one above 2**63).
SGLANG_BATCH = bytes.fromhex(
    "92cb41d954fc404000009496ab426c6f636b53746f726564920bcf8000000000000005c098000102030405060704c096ab"
    "426c6f636b53746f726564910dcf80000000000000059408090a0b04c092ac426c6f636b52656d6f766564910d91b0416c"
    "6c426c6f636b73436c6561726564"
)


def test_decodes_vllm_batches() -> None:
    events, counts = decode_batch(VLLM_BATCH)
    a, b, c = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32
    assert events == [Stored((a, b), None, 16), Stored((c,), b, 16), Removed((c,)), Cleared()]
    assert counts == {KvEventType.STORED: 2, KvEventType.REMOVED: 1, KvEventType.CLEARED: 1}


def test_decodes_sglang_batches() -> None:
    events, _ = decode_batch(SGLANG_BATCH)
    big = 2**63 + 5
    assert events == [Stored((11, big), None, 4), Stored((13,), big, 4), Removed((13,)), Cleared()]


def test_unknown_event_kinds_are_skipped() -> None:
    payload = msgpack.packb([1.0, [{"type": "BlockPinned", "x": 1}, ["AllBlocksCleared"]]])
    assert decode_batch(payload)[0] == [Cleared()]


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # not msgpack
        msgpack.packb({"ts": 1.0}),
        msgpack.packb([1.0]),
        msgpack.packb([1.0, [7]]),
        msgpack.packb([1.0, [{"block_hashes": []}]]),  # no tag
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [b"x"], "block_size": 0}]]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1.5], "block_size": 16}]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": "ab"}]]),
        msgpack.packb([1.0, [["BlockStored", [True], None, [], 16, None]]]),
    ],
)
def test_bad_batches_raise_one_error(payload: bytes) -> None:
    with pytest.raises(KvDecodeError):
        decode_batch(payload)


def test_sequence_frames() -> None:
    assert parse_seq((7).to_bytes(8, "big")) == 7
    with pytest.raises(KvDecodeError):
        parse_seq(b"\x00")
    assert decode_event(["BlockRemoved", [1, 2]]) == Removed((1, 2))


# -- the subscriber, against a publisher on 127.0.0.1 ---------------------------------------------------


def batch(*events: object) -> bytes:
    return msgpack.packb([1.0, list(events), 0])


def stored(*hashes: bytes, parent: bytes | None = None) -> dict[str, object]:
    fields = {"token_ids": [], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent, **fields}


class Publisher:
    """A vLLM-like PUB socket (and optional ROUTER replay socket) on ephemeral 127.0.0.1 ports. An XPUB
    (a PUB to its subscribers) so the test can wait for the subscription instead of guessing."""

    def __init__(self, ctx: zmq.asyncio.Context, replay: bool) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.router = ctx.socket(zmq.ROUTER) if replay else None
        self.replay_endpoint = None
        if self.router is not None:
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
        self.buffer: list[tuple[int, bytes]] = []
        self.requests: list[int] = []

    async def send(self, seq: int, payload: bytes, *, keep: bool = True) -> None:
        if keep:
            self.buffer.append((seq, payload))
        await self.pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])

    async def serve_one_replay(self) -> None:
        assert self.router is not None
        client, _empty, start = await self.router.recv_multipart()
        first = int.from_bytes(start, "big")
        self.requests.append(first)
        for seq, payload in self.buffer:
            if seq >= first:
                await self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), payload])
        await self.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)


class Counts:
    def __init__(self) -> None:
        self.received: dict[KvEventType, int] = {}
        self.gaps: list[bool] = []

    def received_(self, backend: str, kind: KvEventType, n: int) -> None:
        self.received[kind] = self.received.get(kind, 0) + n

    def gap(self, backend: str, replayed: bool) -> None:
        self.gaps.append(replayed)


class Harness:
    def __init__(self, pub: Publisher, topic: str = "kv") -> None:
        self.pub = pub
        self.index = EngineIndex()
        self.counts = Counts()
        self.applied = asyncio.Queue[int]()
        cfg = KvEventsConfig(
            endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, topic=topic, replay_timeout_s=5.0
        )
        self.sub = KvEventSubscriber("e1", cfg, self.index, _Metrics(self.counts), self._on_batch)

    def _on_batch(self) -> None:
        self.applied.put_nowait(self.index.expected_seq or 0)

    async def ready(self) -> None:
        """Start the subscriber and wait for its subscription to reach the publisher."""
        self.sub.start()
        assert await self.pub.pub.recv() == b"\x01kv"


class _Metrics:
    def __init__(self, counts: Counts) -> None:
        self.counts = counts

    def received(self, backend: str, kind: KvEventType, n: int) -> None:
        self.counts.received_(backend, kind, n)

    def gap(self, backend: str, replayed: bool) -> None:
        self.counts.gap(backend, replayed)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()


async def _harness(zctx: zmq.asyncio.Context, replay: bool) -> Harness:
    h = Harness(Publisher(zctx, replay))
    await h.ready()
    return h


async def _close(h: Harness) -> None:
    await h.sub.aclose()
    h.pub.close()


@pytest.mark.anyio
async def test_batches_in_sequence_build_the_index(zctx: zmq.asyncio.Context) -> None:
    h = await _harness(zctx, replay=False)
    try:
        await h.pub.send(1, batch(stored(b"a", b"b")))
        await h.pub.send(2, batch({"type": "BlockRemoved", "block_hashes": [b"b"], "medium": "GPU"}))
        assert await h.applied.get() == 2 and await h.applied.get() == 3
        assert b"a" in h.index and b"b" not in h.index and h.index.depth(b"a") == 16
        assert h.counts.received == {KvEventType.STORED: 1, KvEventType.REMOVED: 1}
        assert h.counts.gaps == [] and h.index.gaps == 0
    finally:
        await _close(h)


@pytest.mark.anyio
async def test_a_gap_is_filled_from_the_replay_socket(zctx: zmq.asyncio.Context) -> None:
    h = await _harness(zctx, replay=True)
    try:
        await h.pub.send(1, batch(stored(b"a")))
        assert await h.applied.get() == 2
        h.pub.buffer.append((2, batch(stored(b"b", parent=b"a"))))  # published while the subscriber missed it
        served = asyncio.create_task(h.pub.serve_one_replay())
        await h.pub.send(3, batch(stored(b"c", parent=b"b")))
        await served
        # 2 from the replay socket (it sent 3 too: left to the stream), then 3 from the stream
        assert [await h.applied.get() for _ in range(2)] == [3, 4]
        assert h.pub.requests == [2]
        assert [h.index.depth(x) for x in (b"a", b"b", b"c")] == [16, 32, 48]
        assert h.index.gaps == 0 and h.counts.gaps == [True]
    finally:
        await _close(h)


@pytest.mark.anyio
async def test_without_replay_a_gap_forgets_what_was_held(zctx: zmq.asyncio.Context) -> None:
    h = await _harness(zctx, replay=False)
    try:
        await h.pub.send(1, batch(stored(b"a")))
        await h.pub.send(5, batch(stored(b"z")))
        assert await h.applied.get() == 2 and await h.applied.get() == 6
        assert b"a" not in h.index and b"z" in h.index
        assert h.index.gaps == 1 and h.counts.gaps == [False]
    finally:
        await _close(h)


@pytest.mark.anyio
async def test_an_unreadable_batch_is_a_gap_and_the_stream_goes_on(
    zctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    h = await _harness(zctx, replay=False)
    try:
        await h.pub.send(1, batch(stored(b"a")))
        assert await h.applied.get() == 2
        await h.pub.send(2, b"\xc1garbage")
        await h.pub.send(3, batch(stored(b"b")))
        assert await h.applied.get() == 4
        assert b"a" not in h.index and b"b" in h.index and h.counts.gaps == [False]
        assert sum("unreadable batch" in r.getMessage() for r in caplog.records) == 1
    finally:
        await _close(h)


@pytest.mark.anyio
async def test_a_message_of_the_wrong_shape_is_a_gap_too(zctx: zmq.asyncio.Context) -> None:
    h = await _harness(zctx, replay=False)
    try:
        await h.pub.send(1, batch(stored(b"a")))
        assert await h.applied.get() == 2
        await h.pub.pub.send_multipart([b"kv", (2).to_bytes(8, "big")])  # no payload frame
        await h.pub.pub.send_multipart([b"kv", b"\x01", batch()])  # a sequence that is not 8 bytes
        await h.pub.send(3, batch(stored(b"b")))
        assert await h.applied.get() == 4
        assert b"a" not in h.index and b"b" in h.index and h.counts.gaps == [False, False]
    finally:
        await _close(h)
