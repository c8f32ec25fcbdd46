from backends.sim.cache import PrefixCache, block_hashes


def toks(n: int, tag: str = "t") -> list[str]:
    return [f"{tag}{i}" for i in range(n)]


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(toks(15), 4)) == 3
    assert len(block_hashes(toks(16), 4)) == 4
    assert block_hashes(toks(3), 4) == []


def test_hashes_chain_on_the_parent() -> None:
    a = block_hashes(["x", "y", "z", "w"] * 2, 4)
    assert a[0] != a[1]  # same tokens, different parent
    b = block_hashes(["q", "q", "q", "q", "x", "y", "z", "w"], 4)
    assert b[1] != a[0]


def test_prefix_hashes_are_reused_and_extended() -> None:
    tokens = toks(40)
    assert block_hashes(tokens, 8, block_hashes(tokens[:20], 8)) == block_hashes(tokens, 8)


def test_hit_is_the_longest_cached_block_prefix() -> None:
    cache = PrefixCache(capacity_tokens=1000, block_size=4)
    cache.insert(block_hashes(toks(12), 4))
    assert cache.match(block_hashes(toks(20), 4), 20) == 12
    diverged = [*toks(6), "other", *toks(13)[7:]]
    assert cache.match(block_hashes(diverged, 4), len(diverged)) == 4
    assert cache.match(block_hashes(toks(20, "u"), 4), 20) == 0


def test_the_last_prompt_token_is_never_a_hit() -> None:
    cache = PrefixCache(capacity_tokens=1000, block_size=4)
    hashes = block_hashes(toks(8), 4)
    cache.insert(hashes)
    assert cache.match(hashes, 8) == 4  # like vLLM: at least one token is computed
    assert cache.match(block_hashes(toks(9), 4), 9) == 8


def test_lru_eviction_at_capacity_takes_tails_first() -> None:
    cache = PrefixCache(capacity_tokens=16, block_size=4)  # 4 blocks
    a, b = block_hashes(toks(12, "a"), 4), block_hashes(toks(12, "b"), 4)
    cache.insert(a)
    cache.insert(b)
    assert len(cache) == 4
    assert [h in cache for h in a] == [True, False, False]  # A's prefix outlives its tail
    assert all(h in cache for h in b)
    assert cache.match(block_hashes(toks(13, "a"), 4), 13) == 4


def test_a_hit_refreshes_recency() -> None:
    cache = PrefixCache(capacity_tokens=16, block_size=4)
    a, b, c = (block_hashes(toks(8, tag), 4) for tag in "abc")
    cache.insert(a)
    cache.insert(b)
    assert cache.match(a, 9) == 8  # touch A: B is now the oldest
    cache.insert(c)
    assert all(h in cache for h in a + c)
    assert not any(h in cache for h in b)


def test_zero_capacity_caches_nothing() -> None:
    cache = PrefixCache(capacity_tokens=0, block_size=4)
    cache.insert(block_hashes(toks(8), 4))
    assert len(cache) == 0
