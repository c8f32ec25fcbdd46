"""The simulator's KV cache events: what the prefix cache announces, and the wire batches its publisher
sends (read back by the gateway's own decoder into its index, which must mirror the cache exactly)."""

from __future__ import annotations

import asyncio

import zmq

from backends.kv_events import decode_batch, parse_seq
from backends.sim.cache import KvEvent, PrefixCache, block_hashes, token_id
from backends.sim.config import SimConfig
from backends.sim.engine import RequestUsage, SimEngine
from backends.sim.text import FinishReason, OutputPlan
from routing.kvindex import EngineIndex


def toks(n: int, tag: str = "t") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def test_the_cache_announces_new_runs_evictions_and_clears() -> None:
    heard: list[list[KvEvent]] = []
    cache = PrefixCache(capacity_tokens=24, block_size=4, on_events=heard.append)
    a = toks(12)
    ha = block_hashes(a, 4)
    cache.insert(ha, a)
    assert heard == [
        [
            {"type": "BlockStored", "block_hashes": ha, "parent_block_hash": None,
             "token_ids": [token_id(t) for t in a], "block_size": 4, "lora_id": None, "medium": "GPU",
             "lora_name": None},
        ]
    ]  # fmt: skip
    heard.clear()
    cache.insert(ha, a)  # all cached: nothing to say
    b = [*a, *toks(16, "b")]
    hb = block_hashes(b, 4)
    cache.insert(hb, b)  # 4 new blocks after a's 3: 7 > 6, so the least recently used goes
    (stored, removed) = heard[0]
    assert stored["block_hashes"] == hb[3:] and stored["parent_block_hash"] == ha[2]
    assert stored["token_ids"] == [token_id(t) for t in b[12:28]]
    assert removed == {"type": "BlockRemoved", "block_hashes": [hb[-1]], "medium": "GPU"}
    cache.clear()
    assert heard[-1] == [{"type": "AllBlocksCleared"}]


def test_published_batches_rebuild_the_cache_in_the_gateways_index() -> None:
    cfg = SimConfig(time_scale=0, cache_tokens=64, block_size=4, kv_events_endpoint="tcp://127.0.0.1:*")
    engine = SimEngine(cfg)
    assert engine.kv_publisher is not None
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"kv")
        sub.connect(engine.kv_publisher.endpoint)
        assert engine.kv_publisher.wait_subscriber()

        async def turns() -> None:
            for n, tag in ((30, "x"), (50, "y"), (30, "x")):
                usage = RequestUsage(prompt_tokens=n)
                async for _ in engine.generate(
                    toks(n, tag), OutputPlan((), ("a", "b", "c", "d"), FinishReason.STOP), usage
                ):
                    pass

        asyncio.run(turns())
        before = set(engine.cache._blocks)
        engine.cache.clear()
        sent = engine.kv_publisher.sent
        index = EngineIndex()
        seqs = []
        for _ in range(sent):
            topic, seq, payload = sub.recv_multipart()
            assert topic == b"kv"
            seqs.append(parse_seq(seq))
            index.apply(seqs[-1], decode_batch(payload)[0])
            if seqs[-1] == sent - 2:  # before the clear: the index holds what the cache holds
                assert set(index._blocks) == before and len(index) == 16  # full: evictions happened
        assert seqs == list(range(sent)) and index.gaps == 0 and len(index) == 0
    finally:
        sub.close(linger=0)
        ctx.term()
        engine.close()
