"""Observations: the usage the engine reported, found in the relayed bytes, and handed to every observer."""

from __future__ import annotations

import json

import pytest
from test_proxy_phases import context, make_proxy, run

from gateway.observe import Observation, ResponseTap, Usage, parse_usage
from gateway.proxy import Proxy
from gateway.sse import MAX_EVENT_BYTES, EventSplitter

from transports import FakeTransport, Reply

pytestmark = pytest.mark.anyio

USAGE = {"prompt_tokens": 12, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}


def sse(*events: object) -> list[bytes | object]:
    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


class Recorder:
    def __init__(self) -> None:
        self.seen: list[Observation] = []

    def observe(self, obs: Observation) -> None:
        self.seen.append(obs)


def observed(fake: FakeTransport, *before: object) -> tuple[Proxy, Recorder]:
    recorder = Recorder()
    return make_proxy(fake, *before, recorder), recorder


def test_the_last_usage_object_wins_and_null_usages_are_skipped() -> None:
    chunks = b"".join(
        f"data: {json.dumps(e)}\n\n".encode()
        for e in ({"choices": [], "usage": None}, {"choices": [], "usage": USAGE})
    )
    assert parse_usage(chunks + b"data: [DONE]\n\n") == Usage(12, 3, 8)


@pytest.mark.parametrize(
    "tail",
    [
        b"",
        b'{"usage": null}',
        b'{"usage": {"prompt_tokens": 5}}',  # no completion_tokens
        b'{"usage": {"prompt_tokens": -1, "completion_tokens": 2}}',
        b'{"usage": {"prompt_tokens": true, "completion_tokens": 2}}',
        b'{"usage": {"prompt_tokens": 5, "completion_tok',  # cut off
        b'"usage" is a word in this content',
    ],
)
def test_no_usage_unless_a_whole_well_formed_one_is_there(tail: bytes) -> None:
    assert parse_usage(tail) is None


def test_cached_tokens_are_none_when_the_engine_does_not_report_them() -> None:
    assert parse_usage(b'{"usage":{"prompt_tokens":4,"completion_tokens":1}}') == Usage(4, 1, None)


def test_the_tap_keeps_a_bounded_tail_and_counts_events_across_chunk_boundaries() -> None:
    tap = ResponseTap()
    padding = b"data: " + b"x" * 10_000 + b"\n\n"
    tap.feed(padding)
    final = f"data: {json.dumps({'usage': USAGE})}\n\ndata: [DONE]\n\n".encode()
    for i in range(0, len(final), 7):  # the usage object arrives split over many chunks
        tap.feed(final[i : i + 7])
    assert tap.usage() == Usage(12, 3, 8)
    assert tap.body_bytes == len(padding) + len(final)
    assert len(tap._tail) <= 4096


async def test_a_streamed_answer_is_observed_with_its_usage_events_and_timings() -> None:
    fake = FakeTransport()
    events = sse({"choices": [{"delta": {"content": "a"}}]}, {"choices": [], "usage": USAGE})
    fake.script("http://a", Reply(200, [(b"content-type", b"text/event-stream")], events))
    proxy, recorder = observed(fake)
    await run(proxy, ctx := context())
    (obs,) = recorder.seen
    assert (obs.backend, obs.model, obs.key, obs.status, obs.outcome.value) == ("a", "m", "k", 200, "ok")
    assert (obs.streamed, obs.events, obs.usage) == (True, 3, Usage(12, 3, 8))
    assert obs.first_byte_s is not None and 0 <= obs.first_byte_s <= obs.duration_s
    assert ctx.lease is not None and ctx.lease.backend.in_flight == 0


async def test_a_json_answer_without_usage_and_a_failed_request_are_observed_too() -> None:
    fake = FakeTransport()
    fake.script("http://a", Reply.json({"choices": []}))
    fake.script("http://a", Reply.json({"error": "x"}, status=500))
    fake.script("http://b", Reply.json({"error": "x"}, status=500))
    proxy, recorder = observed(fake)
    await run(proxy, context())
    await run(proxy, context())
    first, failed = recorder.seen
    assert (first.streamed, first.usage, first.status) == (False, None, 200)
    assert (failed.status, failed.outcome.value) == (500, "http_5xx")


async def test_a_failing_observer_does_not_break_the_request() -> None:
    class Broken:
        def observe(self, obs: Observation) -> None:
            raise RuntimeError("defect")

    fake = FakeTransport()
    fake.script("http://a", Reply.json({"choices": []}))
    proxy, recorder = observed(fake, Broken())
    sent = await run(proxy, ctx := context())
    assert sent[0]["status"] == 200 and len(recorder.seen) == 1
    assert ctx.lease is not None and ctx.lease.backend.in_flight == 0


@pytest.mark.parametrize(
    ("relayed", "ended"),
    [
        (b'data: {"x": 1}\n\ndata: [DONE]\n\n', True),
        (b'data: {"x": 1}\r\n\r\ndata: [DONE]\r\n\r\n', True),
        (b"data: [DONE]\n\n", True),  # the whole stream is that one event
        (b'data: {"x": 1}\n\n', False),
        (b'data: {"x": 1}\n\ndata: [DONE]\n\ndata: {"late": 1}\n\n', False),  # the last event is not it
        (b"data: [DO", False),
        (b"", False),
    ],
)
def test_the_tap_knows_whether_the_last_event_relayed_ends_the_stream(relayed: bytes, ended: bool) -> None:
    tap = ResponseTap()
    tap.feed(relayed)
    assert tap.ended((b"data: [DONE]",)) is ended


def test_fed_bytes_keep_only_the_tail() -> None:
    """A plain body's reads (``feed``) are not events: an event that began before the tail is not told."""
    tap = ResponseTap()
    tap.feed(b"event: response.completed\ndata: " + b"x" * 8192 + b"\n\n")
    assert not tap.ended((b"event: response.completed",))


RESPONSES_END = (b"event: response.completed", b"event: response.incomplete")
DELTA = b'event: response.output_text.delta\ndata: {"delta": "hi"}\n\n'


def _completed(size: int, eol: bytes = b"\n") -> bytes:
    doc = b'{"response": {"output": "' + b"x" * size + b'", "usage": {"input_tokens": 7}}}'
    return b"event: response.completed" + eol + b"data: " + doc + eol + eol


def _relayed(*reads: bytes, max_event: int = MAX_EVENT_BYTES) -> ResponseTap:
    """A tap fed as the relay feeds it: each engine read through one splitter, its pieces (if any) taken."""
    tap, splitter = ResponseTap(), EventSplitter(max_event)
    for read in reads:
        if pieces := splitter.feed(read):
            tap.take(pieces)
    return tap


def _cut(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


@pytest.mark.parametrize(
    ("reads", "ended"),
    [
        ([DELTA, _completed(20_000)], True),  # one read each (a ``Whole``)
        ([DELTA + _completed(20_000)], True),  # the delta and the long event in one read
        (_cut(DELTA + _completed(20_000), 1000), True),  # the splitter joins it from twenty reads
        (_cut(DELTA + _completed(20_000, b"\r\n"), 1000), True),  # CRLF
        ([DELTA, _completed(20_000, b"\r\n")[:-1], b"\n"], True),  # its last LF alone, after its CR ended it
        ([DELTA, _completed(4090)], True),  # just about the tail's size
        ([DELTA, _completed(20_000).replace(b"completed", b"incomplete", 1)], True),
        ([DELTA, _completed(20_000), b"\n\n\n"], True),  # blank lines after it are no event
        ([DELTA, _completed(20_000), DELTA], False),  # an event after it
        ([DELTA, _completed(20_000).replace(b"completed", b"in_progress", 1)], False),  # not a terminal one
        ([DELTA, _completed(20_000)[:-1]], False),  # not ended: held back by the splitter, never relayed
        ([_completed(20_000)], True),  # the whole stream is that one event
    ],
    ids=[
        "own-read",
        "one-read",
        "twenty-reads",
        "crlf",
        "crlf-lf-alone",
        "tail-size",
        "incomplete",
        "blank-lines-after",
        "event-after",
        "not-terminal",
        "unended",
        "only-event",
    ],
)
def test_a_terminal_event_longer_than_the_tail_is_found_in_its_read(reads: list[bytes], ended: bool) -> None:
    assert _relayed(*reads).ended(RESPONSES_END) is ended


def test_a_terminal_event_past_the_splitters_bound_is_not_taken_for_an_ended_one() -> None:
    """Parts of an event over the bound are relayed as they come: a hang-up in the middle of one whose
    beginning looks terminal is still a disconnect (its reads do not end an event)."""
    long = _completed(20_000)
    assert not _relayed(DELTA + long[:6000], max_event=1024).ended(RESPONSES_END)
    assert not _relayed(DELTA + long[:6000], long[6000:12000], max_event=1024).ended(RESPONSES_END)


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"], ids=["lf", "crlf"])
def test_a_last_event_about_the_tails_size_is_found(eol: bytes) -> None:
    """Around 4 KiB, the blank line before the event falls out of the tail: the event's own read holds it."""
    for size in range(3950, 4150):
        event = _completed(size, eol)
        assert _relayed(DELTA * 3, event).ended(RESPONSES_END), len(event)
        assert not _relayed(DELTA * 3, event, DELTA).ended(RESPONSES_END), len(event)
