"""Pin lookup, forgetting and statistics for the admin API, over the ``AffinityStore`` port (either store).

The port's ``pin``/``forget`` are admin-only: the request path never calls them, so the port's cost
contract (at most two round trips a request) does not cover them.
"""

from __future__ import annotations

from gateway.state import AffinityStore, Pin

__all__ = ["Pin", "counts", "forget", "lookup"]


async def lookup(store: AffinityStore, key: str) -> Pin | None:
    return await store.pin(key)


async def forget(store: AffinityStore, key: str) -> str | None:
    """Drop the pin of ``key``; the backend it named, or None if there was none."""
    return await store.forget(key)


async def counts(store: AffinityStore) -> dict[str, int]:
    """Pinned conversations per backend, as routing sees them (every replica's, with Redis)."""
    view = await store.view(None)
    return {b: n for b, n in view.conversations.items() if n}
