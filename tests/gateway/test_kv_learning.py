"""What the routing inputs say each engine holds, from the KV index (``RoutingFeedback._kv_held``)."""

from __future__ import annotations

from test_proxy_phases import make_proxy

from gateway.learning import RoutingFeedback
from routing.kvindex import KvIndex, Removed, Stored
from routing.params import RoutingParams

from transports import FakeTransport

BS = 16


def feedback() -> tuple[RoutingFeedback, KvIndex]:
    kv = KvIndex()
    return RoutingFeedback(
        make_proxy(FakeTransport()).registry, RoutingParams("ttft", 2.0, 8, False), kv=kv
    ), kv


def turn(kv: KvIndex, keys: tuple[str, ...], backend: str, blocks: list[bytes], parent: bytes | None) -> None:
    e = kv.engine(backend)
    mark = kv.mark(backend)
    e.apply(e.expected_seq or 0, [Stored(tuple(blocks), parent, BS)])
    depth = (e.depth(blocks[-1]) or 0) + 3  # a prompt ending 3 tokens into the next block
    assert kv.record(keys, backend, mark, depth)


def test_the_home_is_judged_by_its_own_record_others_also_by_the_head() -> None:
    fb, kv = feedback()
    turn(kv, ("head",), "b", [b"h0", b"h1"], None)  # a twin prefilled the head on b
    turn(kv, ("c", "head"), "a", [b"h0", b"h1"], None)  # this conversation's turn 1 on a
    turn(kv, ("c",), "a", [b"c2"], b"h1")  # and its turn 2
    # Home a holds its latest checkpoint: inference judges it (that counts the reply too); b holds the head.
    assert fb._kv_held("c", "head", "a") == (("b", 32),)
    kv.engine("a").apply(2, [Removed((b"c2",))])
    assert fb._kv_held("c", "head", "a") == (("a", 32), ("b", 32))  # a lost the tail: judged by events now
    kv.engine("a").apply(3, [Removed((b"h1", b"h0"))])
    assert fb._kv_held("c", "head", "a") == (("a", 0), ("b", 32))  # a evicted it all: cold
    # Not its home: the longer of its own record and the head's.
    assert fb._kv_held("c", "head", None) == (("a", 0), ("b", 32))


def test_a_home_without_a_record_here_is_left_to_inference() -> None:
    fb, kv = feedback()
    turn(kv, ("head",), "a", [b"h0"], None)  # only the head is known on a (another replica served c)
    assert fb._kv_held("c", "head", "a") == ()
    assert fb._kv_held("c", "head", "b") == (("a", 16),)
