"""Which backends recently prefilled a conversation head: key -> a bitmask of backend indexes.

Identical heads (same system prompt and first user message: best-of-N, parallel rollouts) are many
conversations under one key; every backend that served one of them holds the head in its prefix cache, so
another twin reads only the rest there. Bounded: past ``max_entries`` the least recently recorded key goes
(engines evict too). A backend whose reported cached tokens show it lost the head is dropped from it.
Values are ints, so the dict is not tracked by the garbage collector. Pure, no clock: recency is order.
"""

from __future__ import annotations


class HeadHolders:
    __slots__ = ("_index", "_masks", "_names", "max_entries")

    def __init__(self, max_entries: int = 100_000) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._masks: dict[str, int] = {}
        self._names: list[str] = []
        self._index: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._masks)

    def add(self, key: str, backend: str) -> None:
        bit = 1 << self._bit(backend)
        masks = self._masks
        mask = masks.pop(key, 0)  # re-inserted last: the most recent
        masks[key] = mask | bit
        if len(masks) > self.max_entries:
            del masks[next(iter(masks))]

    def drop(self, key: str, backend: str) -> None:
        index = self._index.get(backend)
        mask = self._masks.get(key)
        if index is None or mask is None:
            return
        mask &= ~(1 << index)
        if mask:
            self._masks[key] = mask
        else:
            del self._masks[key]

    def get(self, key: str) -> frozenset[str]:
        mask = self._masks.get(key, 0)
        if not mask:
            return frozenset()
        return frozenset(name for i, name in enumerate(self._names) if mask >> i & 1)

    def _bit(self, backend: str) -> int:
        index = self._index.get(backend)
        if index is None:
            index = self._index[backend] = len(self._names)
            self._names.append(backend)
        return index
