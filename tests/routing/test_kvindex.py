"""The per-engine KV block index and conversation checkpoints (routing.kvindex)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.kvindex import (
    MAX_CHECKPOINTS,
    PENDING_TRIES,
    Cleared,
    EngineIndex,
    KvEvent,
    KvIndex,
    Removed,
    Stored,
)

BS = 16


def chain(prefix: str, n: int, start: int = 0) -> tuple[bytes, ...]:
    return tuple(f"{prefix}{i}".encode() for i in range(start, start + n))


def stored(hashes: tuple[bytes, ...], parent: bytes | None = None) -> Stored:
    return Stored(hashes, parent, BS)


def test_depths_follow_the_parent_chain() -> None:
    e = EngineIndex()
    e.apply(0, [stored(chain("a", 3))])
    e.apply(1, [stored(chain("a", 2, 3), parent=b"a2")])
    assert [e.depth(h) for h in chain("a", 5)] == [16, 32, 48, 64, 80]
    e.apply(2, [stored((b"x",), parent=b"unseen")])
    assert e.depth(b"x") == -1
    assert e.depth(b"nope") is None


def test_removed_and_cleared() -> None:
    e = EngineIndex()
    e.apply(0, [stored(chain("a", 4))])
    e.apply(1, [Removed((b"a3", b"a2"))])
    assert len(e) == 2 and b"a2" not in e
    e.apply(2, [Cleared()])
    assert len(e) == 0


def test_replayed_batches_are_applied_once_and_a_gap_forgets_everything() -> None:
    e = EngineIndex()
    e.apply(5, [stored(chain("a", 2))])
    assert not e.replayed(5, [Removed((b"a0",))])  # a replay overlapping what was read
    assert e.replayed(6, [stored(chain("z", 1))])
    assert b"a0" in e and b"z0" in e and e.gaps == 0
    e.apply(8, [stored(chain("b", 1))])  # 7 was lost
    assert e.gaps == 1 and e.epoch == 1
    assert b"a0" not in e and b"b0" in e
    assert e.replayed(11, [])  # a replay that starts past the gap does not fill it
    assert e.gaps == 2


def test_a_restarted_engine_starts_its_sequence_again_with_an_empty_cache() -> None:
    e = EngineIndex()
    e.apply(40, [stored(chain("a", 2))])
    e.apply(0, [stored(chain("b", 1))])
    assert b"a0" not in e and b"b0" in e and e.gaps == 1 and e.expected_seq == 1


def _turn(kv: KvIndex, key: str, backend: str, seq: int, events: list[KvEvent], prompt: int) -> bool:
    mark = kv.mark(backend)
    kv.engine(backend).apply(seq, events)
    return kv.record((key,), backend, mark, prompt)


def test_a_conversation_is_held_until_its_checkpoints_are_evicted() -> None:
    kv = KvIndex()
    kv.engine("e1")
    assert kv.held("c", "e1") is None  # never recorded: unknown
    # turn 1: 40 prompt tokens -> two full blocks stored (and one more as decoding filled it)
    assert _turn(kv, "c", "e1", 0, [stored(chain("c", 2)), stored(chain("c", 1, 2), b"c1")], 40)
    assert kv.held("c", "e1") == 32
    # turn 2: 70 tokens; the first three blocks were cached, one more stored
    assert _turn(kv, "c", "e1", 1, [stored(chain("c", 1, 3), b"c2")], 70)
    assert kv.held("c", "e1") == 64
    kv.engine("e1").apply(2, [Removed((b"c3",))])  # the tail goes first
    assert kv.held("c", "e1") == 32
    kv.engine("e1").apply(3, [Removed((b"c2", b"c1", b"c0"))])
    assert kv.held("c", "e1") == 0
    assert kv.snapshot("c") == (("e1", 0, False),)


def test_identical_prompts_on_one_engine_share_one_checkpoint_different_ones_are_ambiguous() -> None:
    kv = KvIndex()
    e = kv.engine("e1")
    mark = kv.mark("e1")
    e.apply(0, [stored(chain("s", 2))])  # twin A stores the shared head; twin B hit it
    assert kv.record(("A",), "e1", mark, 35) and kv.record(("B",), "e1", mark, 33)
    assert kv.held("A", "e1") == kv.held("B", "e1") == 32
    mark = kv.mark("e1")
    e.apply(
        1, [stored(chain("x", 1, 2), b"s1"), stored(chain("y", 1, 2), b"s1")]
    )  # two different third blocks
    assert not kv.record(("A",), "e1", mark, 50)
    assert kv.held("A", "e1") == 32  # the earlier checkpoint stays


def test_a_gap_makes_earlier_records_unknown_until_the_next_turn_records() -> None:
    kv = KvIndex()
    assert _turn(kv, "c", "e1", 0, [stored(chain("c", 2))], 40)
    kv.engine("e1").apply(9, [])  # batches 1..8 lost
    assert kv.held("c", "e1") is None and kv.snapshot("c") == ()
    assert _turn(kv, "c", "e1", 10, [stored(chain("d", 3))], 50)
    assert kv.held("c", "e1") == 48


def test_no_events_or_no_full_block_records_nothing() -> None:
    kv = KvIndex()
    assert not kv.record(("c",), "e1", 0, 4000)  # an engine that publishes nothing
    assert not _turn(kv, "c", "e1", 0, [stored(chain("c", 1))], 10)


def test_checkpoints_per_conversation_are_bounded_and_keep_the_head() -> None:
    kv = KvIndex()
    parent = None
    for turn in range(12):
        block = f"t{turn}".encode()
        assert _turn(kv, "c", "e1", turn, [stored((block,), parent)], BS * (turn + 1) + 3)
        parent = block
    record = kv._records["c"]["e1"]
    assert len(record.checkpoints) == MAX_CHECKPOINTS
    assert record.checkpoints[0].depth == BS and record.checkpoints[-1].depth == 12 * BS
    kv.engine("e1").apply(12, [Removed(tuple(f"t{t}".encode() for t in range(1, 12)))])
    assert kv.held("c", "e1") == BS


# -- properties ------------------------------------------------------------------------------------------

HASHES = st.sampled_from([bytes([i]) for i in range(24)])
EVENTS = st.one_of(
    st.builds(
        Stored, st.lists(HASHES, min_size=1, max_size=5).map(tuple), st.one_of(st.none(), HASHES), st.just(BS)
    ),
    st.builds(Removed, st.lists(HASHES, max_size=5).map(tuple)),
    st.just(Cleared()),
)
BATCHES = st.lists(st.tuples(st.integers(0, 3), st.lists(EVENTS, max_size=4)), max_size=30)


def _feed(batches: list[tuple[int, list[KvEvent]]], max_blocks: int = 1000) -> EngineIndex:
    e = EngineIndex(max_blocks=max_blocks, recent=8)
    seq = 0
    for step, events in batches:
        seq += step  # a step of 0 is a replayed batch, of 2 or more loses batches
        if step == 0:
            e.replayed(seq, events)
        else:
            e.apply(seq, events)
    return e


def _state(e: EngineIndex) -> tuple[object, ...]:
    return (list(e._blocks.items()), e.epoch, e.gaps, e.marks, e.expected_seq)


@settings(max_examples=200, deadline=None)
@given(BATCHES)
def test_equal_event_sequences_give_equal_indexes(batches: list[tuple[int, list[KvEvent]]]) -> None:
    assert _state(_feed(batches)) == _state(_feed(batches))


@settings(max_examples=200, deadline=None)
@given(BATCHES, st.integers(1, 6))
def test_the_index_stays_within_its_bounds(batches: list[tuple[int, list[KvEvent]]], cap: int) -> None:
    e = _feed(batches, max_blocks=cap)
    assert len(e) <= cap and len(e._recent) <= 8


@settings(max_examples=200, deadline=None)
@given(BATCHES, st.integers(2, 5))
def test_a_gap_always_makes_earlier_records_unknown(
    batches: list[tuple[int, list[KvEvent]]], jump: int
) -> None:
    kv = KvIndex()
    e = kv.engine("e1")
    assert _turn(kv, "c", "e1", 0, [stored(chain("c", 3))], 50)
    seq = 0
    for _, events in batches:
        seq += 1
        e.apply(seq, events)
    e.apply(seq + jump, [])
    assert kv.held("c", "e1") is None


def test_blocks_announced_after_the_answer_are_attributed_on_the_next_batches() -> None:
    kv = KvIndex()
    e = kv.engine("e1")
    e.apply(0, [stored(chain("o", 1))])
    mark = kv.mark("e1")
    assert not kv.record(("c", "head"), "e1", mark, 40)  # finished; its BlockStored is still on its way
    e.apply(1, [stored(chain("z", 1))])  # someone else's
    kv.settle("e1")
    assert kv.held("c", "e1") is None
    e.apply(2, [stored(chain("c", 2))])
    kv.settle("e1")
    assert kv.held("c", "e1") == kv.held("head", "e1") == 32
    assert kv.snapshot("c") == (("e1", 32, True),)
    # one that never comes is given up after PENDING_TRIES batches
    assert not kv.record(("d",), "e1", kv.mark("e1"), 400)
    for seq in range(3, 3 + PENDING_TRIES + 1):
        e.apply(seq, [])
        kv.settle("e1")
    assert not kv._pending["e1"]


def test_conversations_are_bounded_least_recently_recorded_first() -> None:
    kv = KvIndex(max_conversations=2)
    for seq, key in enumerate("abc"):
        assert _turn(kv, key, "e1", seq, [stored(chain(key, 1))], 20)
    assert len(kv) == 2 and kv.held("a", "e1") is None and kv.held("c", "e1") == 16
