"""Pin lookup, forgetting and statistics over either affinity store (memory or Redis).

Kept out of the ``AffinityStore`` port on purpose: the request path never needs these, and the port's
cost contract (at most two round trips a request) stays what it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.redis_store import RedisAffinityStore
from gateway.state import AffinityStore, MemoryAffinityStore


@dataclass(frozen=True, slots=True)
class Pin:
    backend: str
    expires_in_s: float | None


async def lookup(store: AffinityStore, key: str) -> Pin | None:
    if isinstance(store, RedisAffinityStore):
        found = await store.pin(key)
        return None if found is None else Pin(*found)
    if isinstance(store, MemoryAffinityStore):
        now = store.clock()
        backend = store.table.get(key, now)
        entry = store.table.entry(key)
        if backend is None or entry is None:
            return None
        return Pin(backend, max(0.0, entry[1] - now))
    return None


async def forget(store: AffinityStore, key: str) -> str | None:
    """Drop the pin of ``key``; the backend it named, or None if there was none."""
    if isinstance(store, RedisAffinityStore):
        return await store.forget(key)
    if isinstance(store, MemoryAffinityStore):
        store.table.expire(store.clock())
        return store.table.forget(key)
    return None


async def counts(store: AffinityStore) -> dict[str, int]:
    """Pinned conversations per backend, as routing sees them (every replica's, with Redis)."""
    view = await store.view(None)
    return {b: n for b, n in view.conversations.items() if n}
