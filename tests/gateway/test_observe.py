"""Observations: the usage the engine reported, found in the relayed bytes, and handed to every observer."""

from __future__ import annotations

import json

import pytest
from test_proxy_phases import context, make_proxy, run

from gateway.observe import Observation, ResponseTap, Usage, parse_usage
from gateway.proxy import Proxy

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


def test_a_terminal_event_longer_than_the_tail_is_not_recognised() -> None:
    """Only the tail is kept: an event that began before it cannot be told apart (a disconnect, as before)."""
    tap = ResponseTap()
    tap.feed(b"event: response.completed\ndata: " + b"x" * 8192 + b"\n\n")
    assert not tap.ended((b"event: response.completed",))
