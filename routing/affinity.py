"""AffinityTable: conversation key -> backend, with a TTL and an LRU bound.

Pure and synchronous: the caller passes ``now``. Entries live in an OrderedDict kept in last-use order, and
every use refreshes the TTL, so the oldest entry is always the first to expire: expiry and eviction both pop
from the front, amortised O(1). Per-backend counts of pinned conversations are maintained incrementally.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping


class AffinityTable:
    __slots__ = ("_counts", "_entries", "max_entries", "ttl_s")

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError("ttl_s must be > 0 and max_entries >= 1")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()  # key -> (backend, expires_at)
        self._counts: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, now: float) -> str | None:
        """The pinned backend, or None. Does not refresh the entry (``touch`` does)."""
        self.expire(now)
        entry = self._entries.get(key)
        return entry[0] if entry is not None else None

    def touch(self, key: str, now: float) -> None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries[key] = (entry[0], now + self.ttl_s)
            self._entries.move_to_end(key)

    def claim(self, key: str, backend: str, now: float) -> str:
        """First assignment: pin ``key`` to ``backend`` unless already pinned. Returns the winner."""
        self.expire(now)
        entry = self._entries.get(key)
        if entry is not None:
            self.touch(key, now)
            return entry[0]
        self._insert(key, backend, now)
        return backend

    def move(self, key: str, backend: str, now: float) -> None:
        """Pin ``key`` to ``backend`` whatever it was pinned to."""
        self.expire(now)
        self._remove(key)
        self._insert(key, backend, now)

    def forget_backend(self, backend: str) -> int:
        """Drop every pin to ``backend`` (it was removed from the config). Returns how many."""
        doomed = [k for k, (b, _) in self._entries.items() if b == backend]
        for k in doomed:
            self._remove(k)
        return len(doomed)

    def entry(self, key: str) -> tuple[str, float] | None:
        """(backend, expires_at) of ``key`` as stored, without expiring or refreshing anything."""
        return self._entries.get(key)

    def items(self) -> list[tuple[str, str, float]]:
        """A copy of every (key, backend, expires_at), oldest first: to write the table to a shared store."""
        return [(key, backend, expires_at) for key, (backend, expires_at) in self._entries.items()]

    def counts(self) -> Mapping[str, int]:
        """Pinned conversations per backend (a live view; copy it to keep it)."""
        return self._counts

    def expire(self, now: float) -> None:
        entries = self._entries
        while entries:
            key, (backend, expires_at) = next(iter(entries.items()))
            if expires_at > now:
                return
            del entries[key]
            self._decrement(backend)

    def _insert(self, key: str, backend: str, now: float) -> None:
        self._entries[key] = (backend, now + self.ttl_s)
        self._counts[backend] += 1
        while len(self._entries) > self.max_entries:
            _, (old_backend, _) = self._entries.popitem(last=False)
            self._decrement(old_backend)

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._decrement(entry[0])

    def _decrement(self, backend: str) -> None:
        n = self._counts[backend] - 1
        if n > 0:
            self._counts[backend] = n
        else:
            del self._counts[backend]
