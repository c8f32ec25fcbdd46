"""The pausing body filter (gateway/pausing.py) on its own: fed SSE events, asked to pause, continued.

What the client sees must read as one stream: the first part as the engine sent it, the continuation with
the first part's envelope, no second role chunk, and usage counting the prompt once."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backends.registry import Backend
from config.settings import BackendConfig
from gateway import pausing
from gateway.context import Attempt, Draft
from gateway.pausing import Pausable, resumable_body
from gateway.sse import Event, Piece

pytestmark = pytest.mark.anyio
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10, "stream": True}


class Seat:
    def __init__(self) -> None:
        self.asked, self.heard, self.waited, self.kept = False, 0.0, 0, 0

    async def pause(self) -> None:
        self.waited += 1

    def keep(self) -> None:
        self.asked = False
        self.kept += 1


def event(doc: dict[str, Any] | str) -> Event:
    data = doc if isinstance(doc, str) else json.dumps(doc)
    return Event(f"data: {data}\n\n".encode())


def chunk(cid: str, delta: dict[str, Any], finish: str | None = None) -> Event:
    return event({"id": cid, "object": "chat.completion.chunk", "created": 1, "model": "m",
                  "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})  # fmt: skip


def rig(body: dict[str, Any] = BODY) -> tuple[Pausable, Seat, Attempt]:
    seat = Seat()
    attempt = Attempt(Backend(BackendConfig(id="a", url="http://a", models=["m"])), Draft(body))
    return Pausable(attempt, seat, seat.pause, seat.keep), seat, attempt


def texts(pieces: list[Piece]) -> list[dict[str, Any]]:
    return [json.loads(p.data() or b"") for p in pieces if isinstance(p, Event) and p.data() != b"[DONE]"]


async def test_a_cut_stream_continues_as_one() -> None:
    f, seat, attempt = rig()
    first = [chunk("c1", {"role": "assistant", "content": ""}), chunk("c1", {"content": "one"})]
    assert f.events(first) == first and f.follow_up() is None  # as the engine sent it
    seat.asked = True
    second = [chunk("c1", {"content": " two"})]
    assert f.events(second) == second and attempt.cut  # this read goes on, then the exchange ends
    assert f.events([chunk("c1", {"content": " three"})]) == []  # read after the cut: regenerated
    follow = f.follow_up()
    assert follow is not None
    assert follow["messages"][-1] == {"role": "assistant", "content": "one two"}
    assert (follow["max_tokens"], follow["continue_final_message"], follow["add_generation_prompt"]) == (
        8,
        True,
        False,
    )
    f.continued()
    await f.before_follow_up()
    assert seat.waited == 1 and not attempt.cut and seat.heard == 0.0
    usage = {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20}
    out = f.events([
        chunk("c2", {"role": "assistant", "content": ""}),  # its role chunk: dropped
        chunk("c2", {"content": " three"}),
        chunk("c2", {}, "length"),
        event({"id": "c2", "object": "chat.completion.chunk", "created": 2, "model": "m", "choices": [],
               "usage": usage}),
        event("[DONE]"),
    ])  # fmt: skip
    docs = texts(out)
    assert [d["id"] for d in docs] == ["c1"] * 3 and {d["created"] for d in docs} == {1}
    assert docs[0]["choices"][0]["delta"] == {"content": " three"}
    assert docs[2]["usage"] == {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}
    assert out[-1].data() == b"[DONE]"


async def test_a_stream_that_sent_reasoning_is_kept_running_and_never_asked_again() -> None:
    f, seat, attempt = rig()
    f.events([chunk("c1", {"reasoning_content": "hmm"})])
    seat.asked = True
    f.events([chunk("c1", {"content": "x"})])
    assert (attempt.cut, seat.kept, seat.asked) == (False, 1, False)
    seat.asked = True  # even if asked again: it runs on
    f.events([chunk("c1", {"content": "y"})])
    assert (attempt.cut, seat.kept) == (False, 1)


async def test_a_stream_whose_end_arrived_is_not_cut() -> None:
    f, seat, attempt = rig()
    f.events([chunk("c1", {"content": "x"}), chunk("c1", {}, "stop")])
    seat.asked = True
    f.events([event("[DONE]")])
    assert not attempt.cut and f.follow_up() is None


async def test_events_are_folded_into_text_past_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pausing, "COMPACT_EVENTS", 3)
    f, seat, _ = rig()
    for word in ("a", " b", " c", " d", " e"):
        f.events([chunk("c1", {"content": word})])
    assert len(f.raw) < 3 and f.tokens == 3  # the first three folded, the rest kept as bytes
    seat.asked = True
    f.events([chunk("c1", {"content": " f"})])
    follow = f.follow_up()
    assert follow is not None and follow["messages"][-1]["content"] == "a b c d e f"


async def test_only_a_plain_streamed_chat_can_be_resumed() -> None:
    assert resumable_body(BODY)
    assert not resumable_body({**BODY, "stream": False})
    assert not resumable_body({**BODY, "n": 2})
    assert not resumable_body(
        {**BODY, "messages": [*BODY["messages"], {"role": "assistant", "content": "a"}]}
    )
    assert not resumable_body({**BODY, "continue_final_message": True})
