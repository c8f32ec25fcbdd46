"""A stream paused at a read that ends inside an event: the client gets the whole events of that read and
nothing of the unfinished one (the continuation regenerates it), so the stream it sees stays well formed.
In-memory transport; waits on admission's announcements and on the bytes the client was sent."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from test_admission_gateway import SSE, Rig, context

from proxy_rig import ProxyClient
from transports import Reply

pytestmark = pytest.mark.anyio


def chunk(cid: str, delta: dict[str, Any], finish: str | None = None) -> bytes:
    doc = {"id": cid, "object": "chat.completion.chunk", "created": 1, "model": "m",
           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def test_a_pause_at_a_read_ending_inside_an_event_sends_only_whole_events() -> None:
    rig = Rig(
        classes={"interactive": {}, "batch": {"preemptible": True}},
        clients={"flood": "batch", "person": "interactive"},
    )
    cut_read, turn_done = asyncio.Event(), asyncio.Event()
    unfinished = chunk("c1", {"content": " lost"})
    first = chunk("c1", {"role": "assistant", "content": ""}) + chunk("c1", {"content": "one"})
    cut = chunk("c1", {"content": " two"}) + unfinished[:20]  # the read the pause lands on
    resumed = [chunk("c2", {"role": "assistant", "content": ""}), chunk("c2", {"content": " three"})]
    rig.fake.script(
        "http://a",
        Reply(200, SSE, [first, cut_read, cut, unfinished[20:]]),
        Reply(200, [(b"content-type", b"application/json")], [turn_done, b'{"ok": true}']),
        Reply(200, SSE, [*resumed, chunk("c2", {}, "length"), b"data: [DONE]\n\n"]),
    )
    batch = ProxyClient(rig, context("flood", "document", stream=True))
    await batch.sent_body(lambda data: b'"one"' in data)
    turn = ProxyClient(rig, context("person", "question"))  # seated at once: the batch stream is asked
    await rig.admission.until(lambda: rig.admission.scheduler.pausing("a") == 1)
    cut_read.set()
    await rig.queued(1)  # the batch stream stopped at that read and waits for its seat again
    turn_done.set()
    assert (await turn.answer())[0] == 200
    status, _, body = await batch.answer()
    assert status == 200
    events = body.split(b"\n\n")
    assert events[-1] == b"" and events[-2] == b"data: [DONE]"
    docs = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]  # each one whole JSON event
    text = "".join(d["choices"][0]["delta"].get("content") or "" for d in docs)
    assert text == "one two three"
    continuation = json.loads(rig.fake.requests[2].body)
    assert continuation["messages"][-1] == {"role": "assistant", "content": "one two"}
    await rig.idle()
