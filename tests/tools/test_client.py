"""tools/client.py: the routing benchmark's streamed chat client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from tools.client import chat_body, stream_chat

pytestmark = pytest.mark.anyio


def _sse(payload: object) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return f"data: {data}\n\n".encode()


class _Body(httpx.AsyncByteStream):
    """An SSE body that records how far the client read it."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks
        self.read = 0
        self.closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            self.read += 1
            yield chunk

    async def aclose(self) -> None:
        self.closed = True


async def test_the_stream_is_read_to_its_end_after_done() -> None:
    """As the openai SDK does on HTTP/1.1: a client that hangs up at [DONE], before the server ends the
    response, is one that left mid-answer to a gateway still reading its engine's end (it then counts a
    disconnect and learns nothing of that turn)."""
    delta = {"choices": [{"index": 0, "delta": {"content": "hello"}, "finish_reason": None}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    body = _Body([_sse(delta), _sse(usage) + _sse("[DONE]"), b": the end of the response\n\n", b"\n"])

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
        result = await stream_chat(client, "http://gw", chat_body("m", [{"role": "user", "content": "x"}], 4))
    assert (result.error, result.reply, result.prompt_tokens, result.completion_tokens) == (
        None,
        "hello",
        3,
        1,
    )
    assert result.ttft_s is not None
    assert (body.read, body.closed) == (4, True)  # every chunk, the ones after [DONE] included
