"""Prefix cache over fixed-size token blocks, modelled on vLLM's automatic prefix caching.

- Only full blocks are hashed and cached. A block's hash chains its parent's hash with its own tokens, so a
  hash names the whole prefix up to and including that block.
- A request's cache hit is the longest run of leading blocks present in the cache, capped (like vLLM) so at
  least the last prompt token is always computed.
- ``on_events`` (optional) hears what changed, as vLLM's KV cache events: ``BlockStored`` for each run of
  newly cached blocks (parent: the block before it), ``BlockRemoved`` for evicted ones, ``AllBlocksCleared``.
- Capacity is ``capacity_tokens // block_size`` blocks; beyond it the least recently used block goes first.
  Within one chain the tail is touched before the head, so eviction takes a chain's tail blocks before its
  prefix (vLLM frees a finished request's blocks in reverse order for the same reason). That keeps the
  invariant that a cached block's parent is normally cached too.
"""

from __future__ import annotations

import hashlib
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

ROOT_HASH = b"\x00" * 16

#: One KV cache event as vLLM publishes it (a map tagged by ``type``), before msgpack.
KvEvent = dict[str, Any]


def _block_hash(parent: bytes, block: Sequence[str]) -> bytes:
    # Tokens never contain whitespace (see tokens.tokenize), so a space-joined block is unambiguous.
    return hashlib.blake2b(parent + " ".join(block).encode(), digest_size=16).digest()


def block_hashes(tokens: Sequence[str], block_size: int, prefix: Sequence[bytes] = ()) -> list[bytes]:
    """Chained hashes of every full block of ``tokens``.

    ``prefix`` may hold hashes already computed for the leading blocks of ``tokens``; they are reused and the
    chain is extended from there.
    """
    hashes = list(prefix)
    parent = hashes[-1] if hashes else ROOT_HASH
    for start in range(len(hashes) * block_size, len(tokens) - block_size + 1, block_size):
        parent = _block_hash(parent, tokens[start : start + block_size])
        hashes.append(parent)
    return hashes


class PrefixCache:
    def __init__(
        self,
        capacity_tokens: int,
        block_size: int,
        on_events: Callable[[list[KvEvent]], None] | None = None,
    ) -> None:
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self.on_events = on_events
        # Least recently used first.
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: bytes) -> bool:
        return block in self._blocks

    def match(self, hashes: Sequence[bytes], num_tokens: int) -> int:
        """Cached tokens for a prompt of ``num_tokens`` whose full-block hashes are ``hashes``.

        Hit blocks count as used now.
        """
        limit = max(0, (num_tokens - 1) // self.block_size)
        hit = 0
        for block in hashes[:limit]:
            if block not in self._blocks:
                break
            hit += 1
        self._touch(hashes[:hit])
        return hit * self.block_size

    def insert(self, hashes: Sequence[bytes], tokens: Sequence[str] = ()) -> None:
        """Cache (or refresh) a chain of blocks, then evict down to capacity. ``tokens``: the chain's tokens
        (the events' ``token_ids``)."""
        events = self._stored(hashes, tokens) if self.on_events is not None else []
        self._touch(hashes)
        evicted = []
        while len(self._blocks) > self.capacity_blocks:
            evicted.append(self._blocks.popitem(last=False)[0])
        if self.on_events is not None:
            if evicted:
                events.append({"type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU"})
            if events:
                self.on_events(events)

    def clear(self) -> None:
        self._blocks.clear()
        if self.on_events is not None:
            self.on_events([{"type": "AllBlocksCleared"}])

    def _touch(self, hashes: Sequence[bytes]) -> None:
        for block in reversed(hashes):
            self._blocks[block] = None
            self._blocks.move_to_end(block)

    def _stored(self, hashes: Sequence[bytes], tokens: Sequence[str]) -> list[KvEvent]:
        """One ``BlockStored`` per run of blocks not cached yet, shaped as vLLM sends it."""
        events: list[KvEvent] = []
        bs = self.block_size
        i = 0
        while i < len(hashes):
            if hashes[i] in self._blocks:
                i += 1
                continue
            start = i
            while i < len(hashes) and hashes[i] not in self._blocks:
                i += 1
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": list(hashes[start:i]),
                    "parent_block_hash": hashes[start - 1] if start else None,
                    "token_ids": [token_id(t) for t in tokens[start * bs : i * bs]],
                    "block_size": bs,
                    "lora_id": None,
                    "medium": "GPU",
                    "lora_name": None,
                }
            )
        return events


def token_id(token: str) -> int:
    """A stable integer id for a simulated token (the simulator's tokens are strings)."""
    return zlib.crc32(token.encode()) & 0x7FFFFFFF
