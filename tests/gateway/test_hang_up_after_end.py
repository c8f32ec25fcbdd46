"""A client that hangs up as soon as it has its stream's terminal event (curl, some JS readers: ``[DONE]``,
``message_stop``, ``response.completed``) got its whole answer, even though the engine's body had not ended
yet: the request counts as answered and teaches what an answered turn teaches. A hang-up before that event
is a disconnect.

The engine here sends the whole stream and then never ends its body: the gateway can only learn the turn
from the client's hang-up."""

from __future__ import annotations

import asyncio
import functools
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from test_metrics import counts, requests

from routing.params import DEFAULT_PREFILL_TPS

from clusters import Cluster, ClusterFactory
from upstreams import FakeEngine


def _data(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _event(name: str, doc: dict[str, Any]) -> bytes:
    return f"event: {name}\n".encode() + _data({"type": name, **doc})


CHAT_STREAM = [
    _data({"choices": [{"index": 0, "delta": {"content": "hello there"}, "finish_reason": None}]}),
    _data({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
    _data({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}),
    b"data: [DONE]\n\n",
]
MESSAGES_STREAM = [
    _event(
        "message_start",
        {"message": {"id": "msg_1", "role": "assistant", "content": [], "usage": {"input_tokens": 7}}},
    ),
    _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
    _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "hello there"}}),
    _event("content_block_stop", {"index": 0}),
    _event("message_delta", {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 3}}),
    _event("message_stop", {}),
]
RESPONSES_STREAM = [
    _event("response.output_text.delta", {"delta": "hello there"}),
    _event(
        "response.completed",
        {"response": {"status": "completed", "usage": {"input_tokens": 7, "output_tokens": 3}}},
    ),
]
#: Per route: the request body, the engine's whole stream, the bytes that end it for the client.
CASES: dict[str, tuple[str, dict[str, Any], list[bytes]]] = {
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
        CHAT_STREAM,
    ),
    "messages": (
        "/v1/messages",
        {"max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
        MESSAGES_STREAM,
    ),
    "responses": ("/v1/responses", {"input": "hi"}, RESPONSES_STREAM),
}

#: Long answers: a terminal event past the tap's 4 KiB tail (Responses repeats the whole output in
#: ``response.completed``), and for the other shapes a long last event before a short terminal one.
TEXT = "x" * 20_000
LONG: dict[str, list[bytes]] = {
    "chat": [
        _data({"choices": [{"index": 0, "delta": {"content": TEXT}, "finish_reason": None}]}),
        *CHAT_STREAM[1:],
    ],
    "messages": [
        *MESSAGES_STREAM[:2],
        _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": TEXT}}),
        MESSAGES_STREAM[3],
        _event(  # a long final message_delta (a long stop sequence), its usage at its end
            "message_delta",
            {
                "delta": {"stop_reason": "end_turn", "stop_sequence": "y" * 6000},
                "usage": {"output_tokens": 3},
            },
        ),
        MESSAGES_STREAM[5],
    ],
    "responses": [
        RESPONSES_STREAM[0],
        _event(
            "response.completed",
            {
                "response": {
                    "status": "completed",
                    "output": [{"type": "message", "content": [{"type": "output_text", "text": TEXT}]}],
                    "usage": {"input_tokens": 7, "output_tokens": 3},
                }
            },
        ),
    ],
}


def _writes(script: list[bytes], how: str) -> list[bytes]:
    """The engine's writes: each event as one (``events``), the stream as one, or in 1000-byte parts (the
    gateway's splitter joins an event read in several)."""
    if how == "one-write":
        return [b"".join(script)]
    if how == "parts":
        whole = b"".join(script)
        return [whole[i : i + 1000] for i in range(0, len(whole), 1000)]
    return script


@dataclass
class EndlessEngine(FakeEngine):
    """Streams ``script`` on the three routes, then holds its body open until the gateway closes it."""

    script: list[bytes] = field(default_factory=list)
    sent: asyncio.Event | None = None

    def app(self) -> Starlette:
        routes = [Route(path, self._scripted, methods=["POST"]) for path in ("/v1/messages", "/v1/responses")]
        return Starlette(routes=routes + list(super().app().routes))

    async def _scripted(self, request: Request) -> Response:
        self.requests.append(json.loads(await request.body()))
        return StreamingResponse(self._endless(), media_type="text/event-stream")

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        async for chunk in self._endless():
            yield chunk

    async def _endless(self) -> AsyncIterator[bytes]:
        self.active += 1
        try:
            for chunk in self.script:
                yield chunk
            await asyncio.Event().wait()  # never ends its body: only the gateway's close stops it
        finally:
            self.active -= 1
            self.cancelled += 1


def _post_and_hang_up(c: Cluster, path: str, body: dict[str, Any], until: bytes) -> bytes:
    """A raw HTTP/1.1 client that closes its socket as soon as it has read ``until``; what it read."""
    host, port = c.url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(payload)}\r\n\r\n"
    ).encode()
    got = b""
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(head + payload)
        while until not in got:
            chunk = s.recv(65536)
            assert chunk, f"the gateway closed before {until!r}: {got!r}"
            got += chunk
    return got


@pytest.fixture
def cluster(cluster: ClusterFactory) -> ClusterFactory:
    return functools.partial(
        cluster, backend={"native_shapes": ["chat", "completions", "messages", "responses"]}
    )


def _answered(c: Cluster, engine: EndlessEngine, shape: str) -> None:
    """The turn counted as answered: one ok request, its usage and finish reason, its TTFT learned."""
    c.wait_idle()  # the gateway closed the engine's body and let go of the request
    assert engine.cancelled == 1
    assert requests(c) == {("a", "ok"): 1}
    assert counts(c, "warmroute_prompt_tokens_total") == {("a", "m"): 7}
    assert counts(c, "warmroute_completion_tokens_total") == {("a", "m"): 3}
    finished = {} if shape == "responses" else {("a", "stop"): 1}  # Responses streams carry no finish reason
    assert counts(c, "warmroute_finish_reasons_total") == finished
    assert c.gateway.registry.backends["a"].prefill_tps != DEFAULT_PREFILL_TPS  # the turn taught its TTFT


@pytest.mark.parametrize("shape", sorted(CASES))
def test_a_hang_up_right_after_the_terminal_event_is_an_answered_turn(
    cluster: ClusterFactory, shape: str
) -> None:
    path, extra, script = CASES[shape]
    engine = EndlessEngine("a", script=script)
    c = cluster(engines=[engine])
    got = _post_and_hang_up(c, path, {"model": "m", "stream": True, **extra}, script[-1])
    assert b" 200 OK" in got.split(b"\r\n", 1)[0]
    _answered(c, engine, shape)


@pytest.mark.parametrize("shape", sorted(CASES))
def test_a_hang_up_before_the_terminal_event_is_a_disconnect(cluster: ClusterFactory, shape: str) -> None:
    path, extra, script = CASES[shape]
    engine = EndlessEngine("a", script=script[:-1])  # everything but the terminal event
    c = cluster(engines=[engine])
    _post_and_hang_up(c, path, {"model": "m", "stream": True, **extra}, script[-2])
    c.wait_idle()
    assert engine.cancelled == 1
    assert requests(c) == {("a", "client_disconnect"): 1}
    assert c.gateway.registry.backends["a"].prefill_tps == DEFAULT_PREFILL_TPS  # a disconnect teaches nothing


@pytest.mark.parametrize("how", ["events", "one-write", "parts"])
@pytest.mark.parametrize("shape", sorted(LONG))
def test_a_hang_up_right_after_a_long_last_event_is_an_answered_turn(
    cluster: ClusterFactory, shape: str, how: str
) -> None:
    """Past the tap's tail: Responses' 20 KB ``response.completed`` itself; a long last event before a short
    ``message_stop`` or ``[DONE]``."""
    path, extra, _ = CASES[shape]
    script = LONG[shape]
    engine = EndlessEngine("a", script=_writes(script, how))
    c = cluster(engines=[engine])
    got = _post_and_hang_up(c, path, {"model": "m", "stream": True, **extra}, script[-1])
    assert b" 200 OK" in got.split(b"\r\n", 1)[0]
    _answered(c, engine, shape)


def test_a_hang_up_in_the_middle_of_a_long_terminal_event_is_a_disconnect(cluster: ClusterFactory) -> None:
    """The client had part of ``response.completed``: the tap has none of it (held until it ends)."""
    path, extra, _ = CASES["responses"]
    delta, completed = LONG["responses"]
    engine = EndlessEngine("a", script=[delta, completed[:10_000]])
    c = cluster(engines=[engine])
    _post_and_hang_up(c, path, {"model": "m", "stream": True, **extra}, completed[9_900:10_000])
    c.wait_idle()
    assert engine.cancelled == 1
    assert requests(c) == {("a", "client_disconnect"): 1}
    assert counts(c, "warmroute_prompt_tokens_total") == {}
    assert c.gateway.registry.backends["a"].prefill_tps == DEFAULT_PREFILL_TPS


@pytest.mark.parametrize("shape", sorted(LONG))
def test_a_hang_up_before_a_long_last_event_ends_the_stream_is_a_disconnect(
    cluster: ClusterFactory, shape: str
) -> None:
    """Everything but the terminal event (Responses: the long one itself missing; the others: their long
    last event sent, the short terminal one not)."""
    path, extra, _ = CASES[shape]
    script = LONG[shape]
    engine = EndlessEngine("a", script=script[:-1])
    c = cluster(engines=[engine])
    _post_and_hang_up(c, path, {"model": "m", "stream": True, **extra}, script[-2])
    c.wait_idle()
    assert engine.cancelled == 1
    assert requests(c) == {("a", "client_disconnect"): 1}
    assert c.gateway.registry.backends["a"].prefill_tps == DEFAULT_PREFILL_TPS
