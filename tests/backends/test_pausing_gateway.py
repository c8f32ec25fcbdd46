"""Pausing a batch stream for an interactive turn, with engine simulators as real processes.

One simulator runs two requests at a time (``--max-running 2``, the gateway's ``max_in_flight`` 2); the batch
class is preemptible. Two batch streams fill it; an interactive turn then pauses one of them (its engine
request is aborted), takes its slot, and the paused stream resumes as a continuation. The batch client must
see one complete stream: the same words, byte for byte, that an uninterrupted run of the same request gives
(the simulator continues an assistant prefix as greedy decoding does), one role chunk, one id, the usage of
one answer; and every counter returns to zero. Waits are on admission's announcements and on the streams'
own chunks; the batch answers are long enough (200 tokens at 50 tokens/s) that they are still running when
the turn arrives whatever the machine's speed.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from simprocs import SimFactory
from test_gateway_engines import backend, gateway

from gateway.app import Gateway

pytestmark = pytest.mark.anyio
SLOW = ["--max-running", "2", "--time-scale", "1", "--decode-tps", "50", "--seed", "7"]
KEYS = [{"name": "flood", "key": "key-flood"}, {"name": "person", "key": "key-person"}]
ADMISSION = {
    "enabled": True,
    "max_in_flight": 2,
    "clients": {"flood": "batch", "person": "interactive"},
    "default_class": "batch",
    "classes": {"interactive": {}, "batch": {"preemptible": True}},
}


def chat(text: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class Stream:
    """One streamed answer, read as it comes: its parsed chunks; ``first`` is set at the first content."""

    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.done = 0
        self.first = asyncio.Event()

    async def read(self, c: httpx.AsyncClient, url: str, body: dict[str, Any], key: str | None) -> None:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        async with c.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.done += 1
                    continue
                chunk = json.loads(line[6:])
                self.chunks.append(chunk)
                if any(ch["delta"].get("content") for ch in chunk["choices"]):
                    self.first.set()

    def text(self) -> str:
        return "".join(ch["delta"].get("content") or "" for c in self.chunks for ch in c["choices"])

    def roles(self) -> int:
        return sum(1 for c in self.chunks for ch in c["choices"] if "role" in ch["delta"])

    def usage(self) -> dict[str, Any]:
        return next(c["usage"] for c in self.chunks if c.get("usage"))


def running(gw: Gateway) -> int:
    assert gw.admission is not None
    return gw.admission.scheduler.running("sim")


async def test_an_interactive_turn_pauses_a_batch_stream_which_resumes_whole(sims: SimFactory) -> None:
    slow, reference = sims(SLOW, ["--seed", "7"])  # the same seed: the same words, instantly
    async with (
        gateway([backend("sim", slow)], auth={"client_keys": KEYS}, admission=ADMISSION) as (url, gw),
        httpx.AsyncClient(timeout=60) as c,
    ):
        admission = gw.admission
        assert admission is not None
        old, new = Stream(), Stream()
        older = asyncio.create_task(old.read(c, url, chat("summarise document 1", 200), "key-flood"))
        await old.first.wait()
        newer = asyncio.create_task(new.read(c, url, chat("summarise document 2", 200), "key-flood"))
        await new.first.wait()
        assert running(gw) == 2
        turn = Stream()
        await turn.read(c, url, chat("question", 8), "key-person")  # while both batch streams run
        assert turn.usage()["completion_tokens"] == 8
        await asyncio.gather(older, newer)
        paused = gw.metrics.registry.get_sample_value("warmroute_admission_paused_total", {"class": "batch"})
        assert paused == 1.0

        for stream, text in ((old, "summarise document 1"), (new, "summarise document 2")):
            whole = Stream()  # the same request, uninterrupted, on an engine of the same seed
            await whole.read(c, reference, chat(text, 200), None)
            assert stream.text() == whole.text() and len(stream.text().split()) == 200
            usage = stream.usage()
            assert usage == {**whole.usage(), "prompt_tokens_details": usage["prompt_tokens_details"]}
            ids = {ch["id"] for ch in stream.chunks}
            assert (stream.roles(), stream.done, ids) == (1, 1, {stream.chunks[0]["id"]})
            finishes = [
                ch["finish_reason"] for c_ in stream.chunks for ch in c_["choices"] if ch["finish_reason"]
            ]
            assert finishes == ["length"]

        await admission.until(lambda: running(gw) == 0)
        assert gw.registry.total_in_flight() == 0
        assert all(admission.scheduler.depth(k) == 0 for k in admission.scheduler.classes())
        stats = (await c.get(slow + "/sim/stats")).json()
        assert (stats["running"], stats["waiting"], stats["finished"]["abort"]) == (0, 0, 1)  # the pause


class RawStream(Stream):
    """A stream read byte for byte: its SSE comments too (``commented`` is set at the first)."""

    def __init__(self) -> None:
        super().__init__()
        self.raw = bytearray()
        self.commented = asyncio.Event()

    async def read(self, c: httpx.AsyncClient, url: str, body: dict[str, Any], key: str | None) -> None:
        headers = {"authorization": f"Bearer {key}"}
        async with c.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for data in r.aiter_bytes():
                self.raw += data
                if self.raw.count(b"data: ") >= 3:  # the role chunk and content
                    self.first.set()
                if self.raw.find(b"\n: ") >= 0:
                    self.commented.set()
        for event in bytes(self.raw).split(b"\n\n"):
            if event == b"data: [DONE]":
                self.done += 1
            elif event.startswith(b"data: "):
                self.chunks.append(json.loads(event[6:]))


async def test_a_paused_stream_is_kept_alive_with_comments_and_then_resumes_whole(sims: SimFactory) -> None:
    """One slot: the turn pauses the batch stream and holds the engine until the test has seen the paused
    stream's keep-alive comment; then the turn's client leaves, and the batch stream resumes."""
    one = ["--max-running", "1", "--time-scale", "1", "--decode-tps", "50", "--seed", "7"]
    slow, reference = sims(one, ["--seed", "7"])
    admission = {**ADMISSION, "max_in_flight": 1, "keepalive_s": 0.05}
    async with (
        gateway([backend("sim", slow)], auth={"client_keys": KEYS}, admission=admission) as (url, gw),
        httpx.AsyncClient(timeout=60) as c,
    ):
        batch = RawStream()
        reading = asyncio.create_task(batch.read(c, url, chat("summarise document 1", 200), "key-flood"))
        await batch.first.wait()
        assert not batch.commented.is_set()

        async def turn() -> None:  # runs (read as it comes) until the paused stream was kept alive
            headers = {"authorization": "Bearer key-person"}
            body = chat("question", 1000)  # 20 s: long past the first comment, however slow the machine
            async with c.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
                async for _ in r.aiter_bytes():
                    if batch.commented.is_set():
                        break  # its client leaves: the engine stops it, the slot frees
            assert batch.commented.is_set()

        await turn()
        await reading
        paused = gw.metrics.registry.get_sample_value("warmroute_admission_paused_total", {"class": "batch"})
        assert paused == 1.0
        events = bytes(batch.raw).split(b"\n\n")
        comments = [e for e in events if e.startswith(b": ")]
        assert comments and all(e.startswith(b": paused, waiting for sim (") for e in comments)
        assert all(b"\n" not in e for e in comments)  # each a whole event of its own, between data events
        first = next(i for i, e in enumerate(events) if e.startswith(b": "))
        assert first > 0 and events[first + len(comments)].startswith(b"data: ")  # the stream went on after

        whole = Stream()  # the same request, uninterrupted, on an engine of the same seed
        await whole.read(c, reference, chat("summarise document 1", 200), None)
        assert batch.text() == whole.text() and len(batch.text().split()) == 200
        ids = {ch["id"] for ch in batch.chunks}
        assert (batch.roles(), batch.done, ids) == (1, 1, {batch.chunks[0]["id"]})
        assert gw.admission is not None
        await gw.admission.until(lambda: running(gw) == 0)
        assert gw.registry.total_in_flight() == 0
