"""A read of whole events (``Whole``) is not a list: a filter takes its ``raw`` bytes or asks for its
``events()``, never mistakes it for an empty list; a read every filter takes raw is relayed without an
``Event`` being built."""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_reasoning_relay import SSE, Client, Feed, chunk, context

from backends.registry import Backend, Registry
from config.settings import BackendConfig, GuardConfig, ReasoningFields, ThinkingConfig, load_settings
from gateway import sse
from gateway.context import Attempt, Draft
from gateway.continuation import Continuation
from gateway.guard import OutputGuard
from gateway.metrics import Metrics
from gateway.observe import ResponseTap
from gateway.pausing import Pausable
from gateway.phases import BodyFilter
from gateway.proxy import Proxy
from gateway.reasoning import ReasoningRelay
from gateway.sse import Event, EventSplitter, Piece, Pieces, Whole, as_list
from gateway.state import MemoryAffinityStore
from gateway.thinking import Thinking
from gateway.translation import TRANSLATORS, _Stream
from routing.types import BackendState

from transports import FakeTransport, Reply

pytestmark = pytest.mark.anyio

TWO = (
    b"data: "
    + chunk({"content": "a"})
    + b"\n\n"
    + b": ping\n\n\n"
    + b"data: "
    + chunk({"content": "b"})
    + b"\n\n"
)


def test_a_whole_read_is_no_list_and_says_so_when_used_as_one() -> None:
    read = EventSplitter().feed(TWO)
    assert type(read) is Whole and read.raw == TWO and not read.cut
    assert not isinstance(read, list) and read  # truthy without cutting
    assert not read.cut
    with pytest.raises(TypeError):
        read[0]  # type: ignore[index]
    with pytest.raises(TypeError):
        read + []  # type: ignore[operator]  # noqa: RUF005
    for method in ("append", "extend", "insert", "pop", "remove", "sort", "clear", "copy", "index"):
        assert not hasattr(read, method), method
    assert not read.cut  # none of that cut it
    events = read.events()
    assert read.cut and read.events() is events  # cut once, cached
    assert [p.raw for p in events] == [TWO[: TWO.index(b"\n\n") + 2], b": ping\n\n", b"\n", events[-1].raw]
    assert b"".join(p.raw for p in events) == TWO
    assert list(read) == events and len(read) == 4 and read == events and as_list(read) is events
    assert read == Whole(TWO) and read != Whole(TWO + b"\n")


def test_as_list_hands_a_list_on_as_it_is() -> None:
    pieces: list[Piece] = [Event(b"data: x\n\n")]
    assert as_list(pieces) is pieces


def _filters() -> dict[str, BodyFilter]:
    """One of each product body filter that reads SSE events, for a chat stream on backend a."""
    backend = Backend(BackendConfig(id="a", url="http://a", models=["m"]))
    ctx = context(stream=True)
    attempt = Attempt(backend, Draft(ctx.body))
    metrics = Metrics.__new__(Metrics)
    out: dict[str, Any] = {
        "guard": OutputGuard(GuardConfig(), metrics).body_filter(ctx, attempt, 200, sse=True),
        "reasoning": ReasoningRelay(ReasoningFields.BOTH, lambda _m: True).body_filter(
            ctx, attempt, 200, True
        ),
        "translation": _Stream(TRANSLATORS["messages"].stream({"model": "m"}), "a"),
    }
    enforced = Draft({**ctx.body, "max_tokens": 5})
    enforced.enforced = Thinking(5, None, True)
    out["continuation"] = Continuation(ThinkingConfig(), metrics).body_filter(
        ctx, Attempt(backend, enforced), 200, sse=True
    )

    async def pause() -> None:
        return None

    class Seat:
        asked, heard = False, 0.0

    out["pausing"] = Pausable(attempt, Seat(), pause, lambda: None)  # type: ignore[arg-type]
    return out


STREAM = [
    b"data: " + chunk({"role": "assistant", "content": ""}) + b"\n\n",
    b"data: " + chunk({"content": "one"}) + b"\n\n" + b"data: " + chunk({"reasoning": "hm"}) + b"\n\n",
    b": keep-alive\n\n\n",
    b"data: " + chunk({"content": " two"}) + b"\n\ndata: [DONE]\n\n",
]


def _relayed(f: BodyFilter, whole: bool) -> list[bytes]:
    out: list[bytes] = []
    for read in STREAM:
        pieces: Pieces = Whole(read) if whole else Whole(read).events()
        got = f.events(pieces)
        out += [p.raw for p in got]
    return out


@pytest.mark.parametrize("name", ["guard", "reasoning", "translation", "continuation", "pausing"])
async def test_every_filter_relays_a_whole_read_as_it_relays_its_events(name: str) -> None:
    # The filter contract: given a read still whole, or the same read's events as a list, a filter sends
    # the same bytes (a filter that took a Whole for a list would see nothing).
    relayed = _relayed(_filters()[name], whole=False)
    assert relayed and _relayed(_filters()[name], whole=True) == relayed


def test_the_tap_takes_a_whole_read_raw_once_it_has_the_reply() -> None:
    tap = ResponseTap(reply=True)
    first = Whole(STREAM[1])
    tap.take(first)
    assert first.cut and tap.reply() == "one"  # seeking the reply: it reads the events
    for _ in range(200):  # past the events a reply is sought in
        tap.take(Whole(STREAM[1]))
    later = Whole(STREAM[3])
    tap.take(later)
    assert not later.cut and tap.body_bytes == 201 * len(STREAM[1]) + len(STREAM[3])


async def test_a_stream_every_filter_takes_raw_builds_no_event(monkeypatch: pytest.MonkeyPatch) -> None:
    cuts: list[bytes] = []
    lf_events = sse._lf_events

    def counted(chunk: bytes) -> list[Piece]:
        cuts.append(chunk)
        return lf_events(chunk)

    monkeypatch.setattr(sse, "_lf_events", counted)
    reads = [b"data: " + chunk({"content": f"w{i}"}) + b"\n\n" for i in range(6)] + [b"data: [DONE]\n\n"]
    reasoning = b"data: " + chunk({"reasoning": "hm"}) + b"\n\n"
    fake = FakeTransport()
    fake.script("http://a", Reply(200, SSE, reads), Reply(200, SSE, [*reads[:3], reasoning, *reads[3:]]))
    settings = load_settings(None, backends=[{"id": "a", "url": "http://a", "models": ["m"]}])
    registry = Registry(settings.backends, listener=(store := MemoryAffinityStore(settings.routing)))
    registry.backends["a"].state = BackendState.READY
    metrics = Metrics(registry)
    modules = (
        metrics,
        OutputGuard(GuardConfig(), metrics),
        ReasoningRelay(ReasoningFields.BOTH, lambda _m: True),
    )
    proxy = Proxy(settings.timeouts, registry, store, Feed(), metrics, fake, modules)
    await (client := Client()).run(proxy, ctx := context(stream=True))
    assert client.body == b"".join(reads) and ctx.outcome.value == "ok"
    assert ctx.tap is not None and ctx.tap.events == len(reads)  # the tap saw every read
    assert cuts == []  # guard, reasoning filter and tap took each read raw: no Event built
    await (client := Client()).run(proxy, context(stream=True))
    assert cuts == [reasoning]  # only the read the reasoning filter rewrites is cut
    doc = json.loads(client.chunks[3].removeprefix(b"data: "))
    assert doc["choices"][0]["delta"] == {"reasoning": "hm", "reasoning_content": "hm"}
