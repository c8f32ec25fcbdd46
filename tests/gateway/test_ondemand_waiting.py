"""The waiting room's parts without sockets: ``EarlyHeadSend`` and ``EngineNotReady``'s Retry-After."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.relay import body, send_error
from gateway.shapes.base import OPENAI_ERRORS
from gateway.waiting import EarlyHeadSend, EngineNotReady

pytestmark = pytest.mark.anyio

Message = dict[str, Any]


class Recorder:
    def __init__(self) -> None:
        self.messages: list[Message] = []

    async def __call__(self, message: Message) -> None:
        self.messages.append(message)


async def test_before_the_early_head_every_message_passes_through() -> None:
    out = Recorder()
    send = EarlyHeadSend(out)
    start = {"type": "http.response.start", "status": 503, "headers": []}
    await send(start)
    await send(body(b"x", more=False))
    assert out.messages == [start, body(b"x", more=False)]


async def test_after_the_early_head_the_relays_200_head_is_dropped_and_the_body_streams() -> None:
    out = Recorder()
    send = EarlyHeadSend(out)
    await send.head()
    await send.comment("waiting for a to start (0 s)")
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    )
    await send(body(b"data: {}\n\n", more=True))
    await send(body(b"", more=False))
    assert out.messages == [
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
        },
        body(b": waiting for a to start (0 s)\n\n", more=True),
        body(b"data: {}\n\n", more=True),
        body(b"", more=False),
    ]


async def test_an_error_after_the_early_head_becomes_one_sse_error_event_and_done() -> None:
    out = Recorder()
    send = EarlyHeadSend(out)
    await send.head()
    await send_error(
        send, EngineNotReady("backend a failed to start: boom", "engine_start_failed", None), OPENAI_ERRORS
    )
    assert out.messages[1:] == [
        body(
            b'event: error\ndata: {"error":{"message":"backend a failed to start: boom",'
            b'"type":"server_error","param":null,"code":"engine_start_failed"}}\n\ndata: [DONE]\n\n',
            more=False,
        )
    ]


async def test_an_engines_multi_line_json_error_is_compacted_to_one_sse_data_line() -> None:
    out = Recorder()
    send = EarlyHeadSend(out)
    await send.head()
    error = json.dumps({"error": {"message": "bad field", "code": 400}}, indent=2).encode()
    await send(
        {"type": "http.response.start", "status": 400, "headers": [(b"content-type", b"application/json")]}
    )
    await send(body(error[:10], more=True))
    await send(body(error[10:], more=False))
    (last,) = out.messages[1:]
    assert last["body"] == (
        b'event: error\ndata: {"error":{"message":"bad field","code":400}}\n\ndata: [DONE]\n\n'
    )


async def test_a_plain_text_error_is_wrapped_in_openais_shape() -> None:
    out = Recorder()
    send = EarlyHeadSend(out)
    await send.head()
    await send({"type": "http.response.start", "status": 502, "headers": [(b"content-type", b"text/plain")]})
    await send(body(b"Bad Gateway", more=False))
    data = out.messages[-1]["body"].split(b"data: ", 1)[1].split(b"\n\n", 1)[0]
    assert json.loads(data)["error"]["message"] == "the engine answered HTTP 502: Bad Gateway"


def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one() -> None:
    assert EngineNotReady("m", "c", 6.2).headers() == [(b"retry-after", b"7")]
    assert EngineNotReady("m", "c", 0.0).headers() == [(b"retry-after", b"1")]
    assert EngineNotReady("m", "c", None).headers() == []
    err = EngineNotReady("m", "engine_held", 3)
    assert (err.status, json.loads(err.body())["error"]["code"]) == (503, "engine_held")
