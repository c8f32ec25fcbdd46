from __future__ import annotations

import pytest

from routing.affinity import AffinityTable


def test_claim_is_first_writer_wins() -> None:
    t = AffinityTable(ttl_s=10, max_entries=10)
    assert t.claim("k", "a", now=0) == "a"
    assert t.claim("k", "b", now=1) == "a"
    assert t.get("k", now=1) == "a"
    assert dict(t.counts()) == {"a": 1}


def test_move_repins_and_keeps_counts_right() -> None:
    t = AffinityTable(ttl_s=10, max_entries=10)
    t.claim("k", "a", now=0)
    t.move("k", "b", now=1)
    assert t.get("k", now=1) == "b"
    assert dict(t.counts()) == {"b": 1}


def test_ttl_expires_and_touch_refreshes() -> None:
    t = AffinityTable(ttl_s=10, max_entries=10)
    t.claim("old", "a", now=0)
    t.claim("kept", "b", now=0)
    t.touch("kept", now=8)
    assert t.get("old", now=10.5) is None
    assert t.get("kept", now=10.5) == "b"
    assert dict(t.counts()) == {"b": 1}
    assert t.get("kept", now=18.1) is None
    assert len(t) == 0 and dict(t.counts()) == {}


def test_lru_bound_evicts_least_recently_used() -> None:
    t = AffinityTable(ttl_s=100, max_entries=3)
    for i, k in enumerate("abc"):
        t.claim(k, "x", now=i)
    t.touch("a", now=3)  # a is now the most recent
    t.claim("d", "y", now=4)  # evicts b
    assert t.get("b", now=4) is None
    assert [t.get(k, now=4) for k in "acd"] == ["x", "x", "y"]
    assert dict(t.counts()) == {"x": 2, "y": 1}


def test_memory_stays_bounded_under_a_flood_of_keys() -> None:
    t = AffinityTable(ttl_s=1e9, max_entries=1000)
    for i in range(100_000):
        t.claim(f"{i:032x}", f"b{i % 3}", now=float(i))
    assert len(t) == 1000
    assert sum(t.counts().values()) == 1000


def test_forget_backend() -> None:
    t = AffinityTable(ttl_s=10, max_entries=10)
    t.claim("1", "a", 0)
    t.claim("2", "b", 0)
    t.claim("3", "a", 0)
    assert t.forget_backend("a") == 2
    assert dict(t.counts()) == {"b": 1}


def test_rejects_nonsense_bounds() -> None:
    with pytest.raises(ValueError):
        AffinityTable(ttl_s=0, max_entries=1)
    with pytest.raises(ValueError):
        AffinityTable(ttl_s=1, max_entries=0)
