"""Load view over candidates: who is least loaded, with a deterministic, key-spread tie-break."""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

from routing.types import Candidate


def routable(candidates: Iterable[Candidate], exclude: frozenset[str] = frozenset()) -> list[Candidate]:
    return [c for c in candidates if c.routable and c.id not in exclude]


def find(candidates: Iterable[Candidate], backend: str | None) -> Candidate | None:
    """The candidate for ``backend`` (a pin's, say), routable or not; None for no backend or one not there."""
    if backend is None:
        return None
    for c in candidates:
        if c.id == backend:
            return c
    return None


def tie_break(key: str, backend: str) -> int:
    """Rendezvous hash: equal loads resolve the same way on every replica, but differently per key."""
    return rendezvous(key_seed(key), backend)


def least_loaded(candidates: Iterable[Candidate], key: str) -> Candidate | None:
    """Fewest (conversations + in-flight) per unit of weight; ties go by ``tie_break``."""
    seed = key_seed(key)  # hashed once per decision, not once per candidate
    best: Candidate | None = None
    best_rank: tuple[float, int] = (0.0, 0)
    for c in candidates:
        rank = (c.load, rendezvous(seed, c.id))
        if best is None or rank < best_rank:
            best, best_rank = c, rank
    return best


def key_seed(key: str) -> int:
    return xxhash.xxh3_64_intdigest(key.encode())


def rendezvous(seed: int, backend: str) -> int:
    return xxhash.xxh3_64_intdigest(backend.encode(), seed=seed)


def in_flight_per_weight(c: Candidate) -> float:
    return c.in_flight / c.weight
