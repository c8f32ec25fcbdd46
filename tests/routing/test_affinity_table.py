from __future__ import annotations

import gc

import pytest

from routing.affinity import GENERATIONS, AffinityTable

TTL = 8.0
WIDTH = TTL / GENERATIONS  # a pin expires TTL after the latest use in its generation: TTL..TTL + WIDTH


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
    assert len(t) == 1


def test_a_pin_lives_at_least_ttl_and_at_most_ttl_plus_one_generation() -> None:
    t = AffinityTable(ttl_s=TTL, max_entries=10)
    t.claim("old", "a", now=0)
    t.claim("kept", "b", now=0)
    t.claim("late", "c", now=0.75)  # same generation ([0, 1)): it keeps the whole generation to 0.75 + TTL
    t.touch("kept", now=6.5)  # moves into the generation that opens at 6.5
    assert t.get("old", now=TTL) == "a"  # never forgotten before ttl_s
    assert t.get("old", now=0.75 + TTL - 0.01) == "a"  # nor before its generation's latest use + ttl_s
    assert t.get("old", now=0.75 + TTL) is None  # ttl_s + 0.75 after its last use: at most TTL + WIDTH
    assert t.get("late", now=0.75 + TTL) is None
    assert t.get("kept", now=0.75 + TTL) == "b"
    assert dict(t.counts()) == {"b": 1}
    assert t.get("kept", now=6.5 + TTL - 0.01) == "b"
    assert t.get("kept", now=6.5 + TTL) is None
    assert len(t) == 0 and dict(t.counts()) == {}


def test_entry_reports_when_the_pin_expires() -> None:
    t = AffinityTable(ttl_s=TTL, max_entries=10)
    t.claim("k", "a", now=3.0)
    assert t.entry("k") == ("a", 3.0 + TTL)  # just used: exactly ttl_s from now
    assert t.entry("nope") is None
    t.claim("j", "b", now=3.5)  # same generation as k: k lives as long as j now
    assert (t.entry("k"), t.entry("j")) == (("a", 3.5 + TTL), ("b", 3.5 + TTL))
    t.claim("l", "a", now=5.0)  # a newer one
    t.touch("l", now=5.25)  # a use in the current generation extends it too
    assert t.items() == [
        ("k", "a", 3.5 + TTL),
        ("j", "b", 3.5 + TTL),
        ("l", "a", 5.25 + TTL),
    ]


def test_bound_evicts_from_the_oldest_generation_first() -> None:
    t = AffinityTable(ttl_s=100, max_entries=3)
    width = 100 / GENERATIONS
    t.claim("a", "x", now=0)
    t.claim("b", "x", now=0)
    t.claim("c", "x", now=width)  # a newer generation
    t.touch("a", now=2 * width)  # a is now the most recent
    t.claim("d", "y", now=2 * width)  # evicts b, the only pin left in the oldest generation
    assert [t.get(k, now=2 * width) for k in "abcd"] == ["x", None, "x", "y"]
    assert dict(t.counts()) == {"x": 2, "y": 1}
    assert len(t) == 3


def test_memory_stays_bounded_under_a_flood_of_keys() -> None:
    t = AffinityTable(ttl_s=1e9, max_entries=1000)
    for i in range(100_000):
        t.claim(f"{i:032x}", f"b{i % 3}", now=float(i))
    assert len(t) == 1000
    assert sum(t.counts().values()) == 1000


def test_the_table_is_invisible_to_the_garbage_collector() -> None:
    # A full collection must not walk a million pins: generations hold only str keys and small ints.
    t = AffinityTable(ttl_s=100, max_entries=10_000)
    for i in range(5000):
        t.claim(f"{i:032x}", f"b{i % 3}", now=i / 100)
    gens = [g for g in gc.get_referents(*t._gens) if isinstance(g, dict)]
    assert gens and not any(gc.is_tracked(g) for g in gens)


def test_forget_backend() -> None:
    t = AffinityTable(ttl_s=10, max_entries=10)
    t.claim("1", "a", 0)
    t.claim("2", "b", 0)
    t.claim("3", "a", 5)
    assert t.forget_backend("a") == 2
    assert t.forget_backend("never-seen") == 0
    assert dict(t.counts()) == {"b": 1}
    assert len(t) == 1


def test_rejects_nonsense_bounds() -> None:
    with pytest.raises(ValueError):
        AffinityTable(ttl_s=0, max_entries=1)
    with pytest.raises(ValueError):
        AffinityTable(ttl_s=1, max_entries=0)


def test_recent_counts_count_whole_generations_used_since_a_time() -> None:
    t = AffinityTable(ttl_s=TTL, max_entries=10)
    assert t.width_s == WIDTH
    t.move("old", "a", now=0.0)
    t.move("mid", "a", now=3 * WIDTH)
    t.move("new", "b", now=5 * WIDTH)
    t.move("new2", "a", now=5 * WIDTH + 0.1)  # the same generation as "new"
    assert t.recent_counts(5 * WIDTH) == {"b": 1, "a": 1}
    assert t.recent_counts(5 * WIDTH + 0.05) == {"b": 1, "a": 1}  # its latest use is later: whole
    assert t.recent_counts(3 * WIDTH) == {"b": 1, "a": 2}
    assert t.recent_counts(-1.0) == {"b": 1, "a": 3} == dict(t.counts())
    assert t.recent_counts(6 * WIDTH) == {}
    t.discard("new")
    assert t.recent_counts(5 * WIDTH) == {"a": 1}
