"""The result cache: keyed by content and settings, bounded in bytes, least recently used out first."""

from __future__ import annotations

import pytest
from vision_deps import require_vision

require_vision()
pytestmark = pytest.mark.needs("vision")

from sidecars.vision.cache import ByteLRU, Encoded, content_key  # noqa: E402


def entry(size: int) -> Encoded:
    return Encoded(
        b"x" * (size - 1), b"g", tokens=1, hidden=1, dtype="bfloat16", grid_thw=(1, 2, 2), megapixels=0.0
    )


def test_the_key_covers_the_bytes_and_the_settings_fingerprint() -> None:
    assert content_key(b"img", "f1") == content_key(b"img", "f1")
    assert len({content_key(b"img", "f1"), content_key(b"img2", "f1"), content_key(b"img", "f2")}) == 3


def test_eviction_is_by_bytes_least_recently_used_first() -> None:
    cache = ByteLRU(max_bytes=250)
    cache.put("a", entry(100))
    cache.put("b", entry(100))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put("c", entry(100))
    assert (cache.get("a") is not None, cache.get("b"), cache.get("c") is not None) == (True, None, True)
    assert cache.bytes == 200 and len(cache) == 2


def test_an_entry_larger_than_the_budget_is_not_stored() -> None:
    cache = ByteLRU(max_bytes=250)
    cache.put("a", entry(100))
    cache.put("huge", entry(251))
    assert cache.get("huge") is None and cache.get("a") is not None and cache.bytes == 100


def test_replacing_a_key_keeps_the_byte_count_exact() -> None:
    cache = ByteLRU(max_bytes=250)
    cache.put("a", entry(100))
    cache.put("a", entry(50))
    assert cache.bytes == 50 and len(cache) == 1
