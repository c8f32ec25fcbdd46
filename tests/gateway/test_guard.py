"""gateway.guard: repetition and finish_reason from raw SSE bytes, with chunk boundaries anywhere."""

from __future__ import annotations

import json

import pytest

from config.settings import GuardConfig
from gateway.guard import StreamGuard, _BodyFinish
from gateway.shapes.table import CHAT, COMPLETIONS


def event(content: str | None = None, finish: str | None = None, *, compact: bool = True) -> bytes:
    delta = {} if content is None else {"content": content}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    seps = (",", ":") if compact else (", ", ": ")
    return b"data: " + json.dumps({"choices": [choice]}, separators=seps).encode() + b"\n\n"


def completion_event(text: str) -> bytes:
    return b"data: " + json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": None}]}).encode()


def guard(repeat_count: int = 4, max_period: int = 3, *, completions: bool = False) -> StreamGuard:
    cfg = GuardConfig(repeat_count=repeat_count, max_period=max_period)
    return StreamGuard(cfg, text_key=(COMPLETIONS if completions else CHAT).text_key)


def trips_at(g: StreamGuard, chunks: list[bytes]) -> int | None:
    for i, chunk in enumerate(chunks):
        if g.feed(chunk):
            return i
    return None


@pytest.mark.parametrize("compact", [True, False])  # vLLM/sim spell JSON compactly, json.dumps does not
def test_one_token_repeated_trips_on_the_nth_repeat(compact: bool) -> None:
    g = guard(repeat_count=4)
    chunks = [event("Hello", compact=compact)] + [event(" duct", compact=compact)] * 6
    assert trips_at(g, chunks) == 4  # "Hello", then the 4th " duct"
    assert g.tripped == b"duct"


def test_a_short_unit_repeated_trips_and_normal_text_does_not() -> None:
    unit = ["I", " am", "."]
    assert trips_at(guard(repeat_count=4, max_period=3), [event(t) for t in unit * 4]) == 11
    prose = "the quick brown fox jumps over the lazy dog and then the fox sleeps"
    g = guard(repeat_count=3, max_period=3)
    assert trips_at(g, [event(" " + w) for w in prose.split()]) is None
    assert g.tripped is None


def test_a_run_broken_by_another_token_starts_over() -> None:
    chunks = [event("a"), event("a"), event("a"), event("b"), event("a"), event("a"), event("a")]
    assert trips_at(guard(repeat_count=4, max_period=1), chunks) is None


def test_role_and_empty_deltas_are_skipped() -> None:
    chunks = [event(""), event("x"), event(""), event("x"), event(None), event("x"), event("x")]
    assert trips_at(guard(repeat_count=4, max_period=1), chunks) == 6


def test_events_split_across_reads_and_packed_into_one_read() -> None:
    stream = event("go") + event(" on") * 5 + event(None, "length") + b"data: [DONE]\n\n"
    whole = guard(repeat_count=5, max_period=1)
    assert whole.feed(stream) is True
    bytewise = guard(repeat_count=5, max_period=1)
    hits = [i for i in range(len(stream)) if bytewise.feed(stream[i : i + 1])]
    assert len(hits) == 1  # once, on the read that completed the 5th " on" event
    assert stream[: hits[0] + 1].endswith(event(" on"))


def test_the_read_that_trips_has_its_finish_reason_counted_too() -> None:
    # Under load the engine's last events come in one read with the tripping one (``record`` sends them on).
    g = guard(repeat_count=4, max_period=1)
    assert g.feed(event("go") + event(" duct") * 4 + event(None, "length") + b"data: [DONE]\n\n") is True
    assert g.tripped == b"duct" and g.finish == ["length"]


def test_finish_reasons_are_counted_once_and_bounded() -> None:
    stream = (
        event("a") + event("b", None) + event(None, "length") + event(None, "weird") + b"data: [DONE]\n\n"
    )
    g = guard()
    for i in range(0, len(stream), 7):
        g.feed(stream[i : i + 7])
    assert g.finish == ["length", "other"]


def test_escaped_quotes_inside_content_are_one_string() -> None:
    g = guard(repeat_count=3, max_period=1)
    tricky = event('say \\"hi\\" "') * 3
    assert g.feed(tricky) is True
    assert g.tripped == json.dumps('say \\"hi\\" "')[1:-1].encode()


def test_completions_look_at_text() -> None:
    g = guard(repeat_count=3, max_period=1, completions=True)
    assert trips_at(g, [completion_event("3") + b"\n\n"] * 3) == 2


class Finished:
    def __init__(self) -> None:
        self.seen: list[tuple[str, list[str]]] = []

    def finished(self, backend: str, reasons: list[str]) -> None:
        self.seen.append((backend, list(reasons)))


def test_a_json_body_only_counts_finish_reasons() -> None:
    body = json.dumps(
        {"choices": [{"message": {"content": "x x x x x x"}, "finish_reason": "stop"}] * 2}
    ).encode()
    metrics = Finished()
    f = _BodyFinish(metrics, CHAT.finish, "a")  # type: ignore[arg-type]  # only ``finished`` is called
    assert f.body(body) is body  # the engine's own bytes, no repetition looked for
    f.close()
    assert metrics.seen == [("a", ["stop", "stop"])]


def test_a_finish_reason_after_null_ones_in_the_same_read_is_counted() -> None:
    g = guard()
    g.feed(event("a") + event("b") + event(None, "length") + b"data: [DONE]\n\n")
    assert g.finish == ["length"]


@pytest.mark.parametrize("newline", [b"\r\n", b"\r"], ids=["crlf", "cr"])
def test_crlf_and_cr_framed_streams_are_watched_too(newline: bytes) -> None:
    def framed(content: str) -> bytes:
        return event(content).replace(b"\n\n", newline * 2)

    stream = framed("Hello") + framed(" duct") * 4 + framed("x")
    g = guard(repeat_count=4, max_period=1)
    hits = [i for i in range(0, len(stream), 5) if g.feed(stream[i : i + 5])]
    assert len(hits) == 1 and g.tripped == b"duct"
    assert stream[: hits[0] + 5].count(framed(" duct")[:-1]) == 4  # on the read that ended the 4th one


def test_an_event_larger_than_the_bound_is_not_held_or_looked_at() -> None:
    g = guard(repeat_count=2, max_period=1)
    huge = b'data: {"choices":[{"delta":{"content":"' + b"z" * 70_000 + b'"}}]}\n\n'
    assert not g.feed(huge[:40_000]) and not g.feed(huge[40_000:])
    assert g._events.buffered == 0
    assert g.feed(event("a") + event("a")) is True  # framing resumes after it
