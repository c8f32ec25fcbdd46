"""Through the gateway: multi-turn conversations stay on the engine that caches them, and that pays.

Ground truth is each engine's own `vllm:prefix_cache_*` counters, read before and after every turn (turns are
sent one at a time, so a counter that moved belongs to that turn). The gateway's headers say where it routed.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import uuid

import pytest

from .engines import PrefixCacheStats, VllmEngine
from .gateways import BLOCK, Conversation, RunningGateway, Turn, ask, hit_rate

CONVERSATIONS = 3  # odd: with 2 engines a round-robin gateway moves every conversation at every turn
TURNS = 4
FIRST_TOKENS = 2000  # the history: 2.0k, 2.5k, 3.0k, 3.5k tokens at turns 1-4
TURN_TOKENS = 500
HIT_RATE_MARGIN = 0.15  # expected here: affinity ~0.65, round robin ~0.40 (it still reuses turn k-2's prefix)


def play(gw: RunningGateway, engines: list[VllmEngine], label: str) -> list[Conversation]:
    """Turn 1 of every conversation, then turn 2 of every one, ...; one request at a time."""
    client = gw.client()
    run = uuid.uuid4().hex[:8]
    convs = [
        Conversation(f"{label}-{run}-c{i}", first_tokens=FIRST_TOKENS, turn_tokens=TURN_TOKENS)
        for i in range(CONVERSATIONS)
    ]
    for _ in range(TURNS):
        for conv in convs:
            ask(client, conv, engines)
    assert gw.wait_idle() == 0, "the gateway still counts requests in flight"
    return convs


def turns(convs: list[Conversation], *, follow_ups: bool = False) -> list[Turn]:
    return [t for c in convs for t in c.turns if t.number > 1 or not follow_ups]


def describe(label: str, convs: list[Conversation]) -> str:
    later = statistics.mean(t.seconds for t in turns(convs, follow_ups=True))
    placement = " ".join(
        f"{c.tag.rsplit('-', 1)[1]}:{'/'.join(t.backend[-1] for t in c.turns)}" for c in convs
    )
    rates = f"{hit_rate(turns(convs)):.3f} (follow-ups {hit_rate(turns(convs, follow_ups=True)):.3f})"
    return f"{label}: hit rate {rates}, follow-up request mean {later:.3f}s, engines per turn {placement}"


@pytest.fixture(scope="module")
def affinity_run(affinity_gateway: RunningGateway, vllm_engines: list[VllmEngine]) -> list[Conversation]:
    convs = play(affinity_gateway, vllm_engines, "aff")
    print(f"\n[e2e] {describe('affinity', convs)}", file=sys.stderr)
    return convs


def test_each_conversation_stays_on_one_engine(
    affinity_run: list[Conversation], vllm_engines: list[VllmEngine]
) -> None:
    for conv in affinity_run:
        assert len(conv.backends) == 1, [(t.number, t.backend, t.route) for t in conv.turns]
        assert [t.route for t in conv.turns] == ["new_least_loaded"] + ["affinity_hit"] * (TURNS - 1)
    # New conversations go to the engine with the fewest pinned ones: with 3 conversations, both get some.
    assert set().union(*(c.backends for c in affinity_run)) == {e.name for e in vllm_engines}


def test_follow_ups_hit_only_the_pinned_engines_cache(affinity_run: list[Conversation]) -> None:
    for conv in affinity_run:
        first = conv.turns[0]
        assert first.served.queries >= first.prompt_tokens
        assert first.served.hits == 0, f"{conv.tag} turn 1 should be cold: {first.served}"
        for prev, turn in itertools.pairwise(conv.turns):
            where = f"{conv.tag} turn {turn.number} on {turn.backend}: {turn.cache}"
            assert turn.prompt_tokens >= prev.prompt_tokens + TURN_TOKENS // 2, where
            # The whole previous prompt is cached, less the partial last block and the few template tokens
            # after which the rendered history differs from the previous generation prompt.
            assert turn.served.hits >= prev.prompt_tokens - 2 * BLOCK, where
            for name, delta in turn.cache.items():
                if name != turn.backend:
                    assert delta == PrefixCacheStats(0.0, 0.0), where


def test_round_robin_hits_the_cache_less(
    affinity_run: list[Conversation], round_robin_gateway: RunningGateway, vllm_engines: list[VllmEngine]
) -> None:
    rr = play(round_robin_gateway, vllm_engines, "rr")
    print(f"\n[e2e] {describe('round_robin', rr)}", file=sys.stderr)
    assert {t.route for t in turns(rr)} == {"round_robin"}
    moves = sum(a.backend != b.backend for c in rr for a, b in itertools.pairwise(c.turns))
    assert moves >= CONVERSATIONS, "round robin should move conversations between engines"
    affinity_rate, rr_rate = hit_rate(turns(affinity_run)), hit_rate(turns(rr))
    assert affinity_rate > rr_rate + HIT_RATE_MARGIN, (affinity_rate, rr_rate)
