"""Which backends recently prefilled a conversation head: key -> a bitmask of backend indexes.

Identical heads (same system prompt and first user message: best-of-N, parallel rollouts) are many
conversations under one key; every backend that served one of them holds the head in its prefix cache, so
another twin reads only the rest there. Bounded: past ``max_entries`` the least recently recorded keys go,
``max_entries // 64`` (at least one) at once (engines evict too). In batches because a dict's oldest key is
found by a scan from the front of its entries over every slot deleted there since it last resized: one key
at a time, each request past the bound paid that scan (45 us per record at 200,000 keys, 80 times a record
below the bound); a batch pays it once. A backend whose reported cached tokens show it lost the head is
dropped from it.

Each value also names the backend that served the head's latest *first* turn (``latest``): the fallback twin
hint for a follow-up whose first reply the gateway did not see. One int per key (the mask shifted left by
``_LATEST_BITS``, then 1 + that backend's index, 0 for none), so the dict is not tracked by the garbage
collector and one dict operation records both. Pure, no clock: recency is order.
"""

from __future__ import annotations

from itertools import islice

_LATEST_BITS = 10
_LATEST = (1 << _LATEST_BITS) - 1  # backends past index 1022 are held, never named latest
_MAX_SETS = 4096  # distinct holder sets kept for ``get`` (past it, built per call)
_TRIM_SHARE = 64  # past the bound, this share of ``max_entries`` goes at once


class HeadHolders:
    __slots__ = ("_batch", "_index", "_masks", "_names", "_sets", "max_entries")

    def __init__(self, max_entries: int = 100_000) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        self.max_entries = max_entries
        self._batch = max(1, max_entries // _TRIM_SHARE)
        self._masks: dict[str, int] = {}
        self._names: list[str] = []
        self._index: dict[str, int] = {}
        #: mask -> its backends' names: ``get`` runs on every ttft decision, and a head has few distinct
        #: sets of holders (names are only ever appended, so a mask's set never changes).
        self._sets: dict[int, frozenset[str]] = {}

    def __len__(self) -> int:
        return len(self._masks)

    def add(self, key: str, backend: str, first_turn: bool = False) -> None:
        """``backend`` prefilled the head ``key`` (on a first turn: it is also the latest such one)."""
        index = self._index.get(backend)  # ``_bit`` inline for a known backend: once per request
        if index is None:
            index = self._bit(backend)
        masks = self._masks
        value = masks.pop(key, 0)  # re-inserted last: the most recent
        latest = index + 1 if first_turn and index < _LATEST else value & _LATEST
        masks[key] = ((value >> _LATEST_BITS) | 1 << index) << _LATEST_BITS | latest
        if len(masks) > self.max_entries:
            self._trim()

    def drop(self, key: str, backend: str) -> None:
        index = self._index.get(backend)
        value = self._masks.get(key)
        if index is None or value is None:
            return
        mask = (value >> _LATEST_BITS) & ~(1 << index)
        latest = value & _LATEST
        if mask:
            self._masks[key] = mask << _LATEST_BITS | (0 if latest == index + 1 else latest)
        else:
            del self._masks[key]

    def get(self, key: str) -> frozenset[str]:
        mask = self._masks.get(key, 0) >> _LATEST_BITS
        if not mask:
            return frozenset()
        held = self._sets.get(mask)
        if held is None:
            held = frozenset(name for i, name in enumerate(self._names) if mask >> i & 1)
            if len(self._sets) < _MAX_SETS:
                self._sets[mask] = held
        return held

    def latest(self, key: str) -> str | None:
        """The backend that served the latest first turn of head ``key`` (and still holds it), or None."""
        latest = self._masks.get(key, 0) & _LATEST
        return self._names[latest - 1] if latest else None

    def _trim(self) -> None:
        """A batch of the oldest keys (a bound under 128: the oldest alone), in one scan of the front (see
        the module)."""
        masks = self._masks
        for key in list(islice(masks, len(masks) - self.max_entries - 1 + self._batch)):
            del masks[key]

    def _bit(self, backend: str) -> int:
        index = self._index.get(backend)
        if index is None:
            index = self._index[backend] = len(self._names)
            self._names.append(backend)
        return index
