"""The tap keeps the beginning of the first reply: what tells identical heads apart on their next turn."""

from __future__ import annotations

import json

from gateway.observe import ResponseTap
from routing.keys import REPLY_CHARS


def event(delta: dict[str, object]) -> bytes:
    return (
        f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]}, separators=(',', ':'))}\n\n".encode()
    )


def test_streamed_content_is_collected_across_chunk_boundaries() -> None:
    stream = event({"role": "assistant"}) + event({"content": "Hello"}) + event({"content": ' "world"'})
    tap = ResponseTap(reply=True)
    for i in range(0, len(stream), 5):
        tap.feed(stream[i : i + 5])
    assert tap.reply() == 'Hello "world"'


def test_collection_stops_at_reply_chars() -> None:
    tap = ResponseTap(reply=True)
    for _ in range(40):
        tap.feed(event({"content": "abcd"}))
    assert tap.reply() == ("abcd" * 40)[:REPLY_CHARS]
    assert not tap._seeking


def test_reasoning_is_skipped_and_tool_call_arguments_stand_in_for_missing_content() -> None:
    tap = ResponseTap(reply=True)
    tap.feed(event({"reasoning": "let me think"}))
    tap.feed(
        event({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": '{"p":'}}]})
    )
    tap.feed(event({"tool_calls": [{"index": 0, "function": {"arguments": '"x"}'}}]}))
    tap.feed(event({"tool_calls": [{"index": 1, "function": {"arguments": "other call"}}]}))
    assert tap.reply() == '{"p":"x"}'


def test_a_plain_json_body_gives_its_first_message() -> None:
    body = json.dumps({"choices": [{"message": {"role": "assistant", "content": "plain answer"}}]}).encode()
    tap = ResponseTap(reply=True)
    tap.feed(body[:10])
    tap.feed(body[10:])
    assert tap.reply() == "plain answer"


def test_nothing_is_kept_unless_asked_and_broken_events_are_ignored() -> None:
    tap = ResponseTap()
    tap.feed(event({"content": "x"}))
    assert tap.reply() is None
    tap = ResponseTap(reply=True)
    tap.feed(b'data: {"content": oops\n\n')
    assert tap.reply() is None


def test_crlf_and_cr_framed_streams_give_the_reply_too() -> None:
    for newline in (b"\r\n", b"\r"):
        stream = (
            event({"role": "assistant"}) + event({"content": "Hi"}) + event({"content": " there"})
        ).replace(b"\n\n", newline * 2)
        tap = ResponseTap(reply=True)
        for i in range(0, len(stream), 7):  # a CRLF cut between its CR and LF too
            tap.feed(stream[i : i + 7])
        assert tap.reply() == "Hi there"
