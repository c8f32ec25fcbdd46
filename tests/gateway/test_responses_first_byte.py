"""A Responses stream's first byte is its first event after the opening ones: vLLM (and the simulator) send
``response.created`` and ``response.in_progress`` as the request arrives, before its prefill, so stamping
the first byte on them ended the request's queued prefill at once and taught the ttft learner prefill
rates of ~100k tokens/s on engines doing 4k."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import MutableMapping
from typing import Any

import pytest
from test_proxy_phases import make_proxy

from gateway.context import RequestContext
from gateway.shapes.responses import RESPONSES, opening
from routing.policies.least_loaded import LeastLoadedPolicy

from transports import FakeTransport, Reply

pytestmark = pytest.mark.anyio
SSE = [(b"content-type", b"text/event-stream")]


def event(kind: str, named: bool = True, **data: object) -> bytes:
    body = json.dumps({"type": kind, **data}).encode()
    return (b"event: %s\n" % kind.encode() if named else b"") + b"data: " + body + b"\n\n"


CREATED = event("response.created", response={"id": "resp_1", "status": "in_progress"})
IN_PROGRESS = event("response.in_progress", response={"id": "resp_1", "status": "in_progress"})
DELTA = event("response.output_text.delta", delta="hi")


def test_only_reads_of_opening_events_are_opening() -> None:
    assert opening(CREATED) and opening(IN_PROGRESS) and opening(CREATED + IN_PROGRESS)
    unnamed = event("response.created", named=False, response={})
    assert opening(unnamed) and opening(b'data: {"type": "response.in_progress"}\n\n')
    assert not opening(CREATED + IN_PROGRESS + DELTA)  # coalesced with the first delta: that is the byte
    assert not opening(DELTA) and not opening(event("response.output_item.added", named=False))
    assert not opening(b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n')  # a chat engine's
    assert opening(b"") and opening(CREATED[:20])  # nothing, or the head of an opening event, yet
    assert opening(CREATED[20:]) and not opening(DELTA[:20]) and not opening(DELTA[20:])  # reads cut anywhere


async def test_the_first_byte_of_a_responses_stream_is_after_its_opening_events() -> None:
    prefilled, opened = asyncio.Event(), asyncio.Event()
    fake = FakeTransport()
    fake.script("http://a", Reply(200, SSE, [CREATED, IN_PROGRESS, prefilled, DELTA]))
    proxy = make_proxy(fake)
    body = {"model": "m", "input": "hi", "stream": True}
    ctx = RequestContext("POST", "/v1/responses", json.dumps(body).encode(), body, "m", "k",
                         LeastLoadedPolicy(), [], {}, RESPONSES)  # fmt: skip
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)
        if IN_PROGRESS in message.get("body", b""):
            opened.set()

    task = asyncio.create_task(proxy.forward(receive, send, ctx))
    await opened.wait()  # both opening events relayed to the client
    assert ctx.first_byte_at is None and ctx.lease is not None
    ctx.lease.prefill(500)  # queued as the ttft learner queues it when sending: still prefilling
    backend = ctx.lease.backend
    released = time.monotonic()
    prefilled.set()
    await task
    assert ctx.first_byte_at is not None and ctx.first_byte_at >= released
    assert backend.prefilling == 0 and backend.in_flight == 0
    relayed = b"".join(m.get("body", b"") for m in sent[1:])
    assert relayed == CREATED + IN_PROGRESS + DELTA  # every byte as the engine sent it
