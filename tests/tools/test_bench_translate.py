"""The translation microbenchmark's streams translate whole: every engine event is fed, the answer ends."""

from __future__ import annotations

import json

import pytest

from gateway.sse import EventSplitter
from gateway.translation import TRANSLATORS, _Stream
from tools import bench_translate


def test_the_benchmark_streams_translate_to_complete_answers() -> None:
    for tool in (False, True):
        reads = bench_translate.stream(tool)
        assert len(reads) == bench_translate.EVENTS + 3  # role, the events, usage, [DONE]
        for shape in ("messages", "responses"):
            splitter, f = EventSplitter(), _Stream(TRANSLATORS[shape].stream({"model": "m"}), "a")
            out = [p.raw for read in reads for p in f.events(splitter.feed(read))] + [p.raw for p in f.end()]
            last = json.loads(out[-1].split(b"data: ", 1)[1])
            assert last["type"] == ("message_stop" if shape == "messages" else "response.completed")
            kinds = [json.loads(e.split(b"data: ", 1)[1])["type"] for e in out]
            assert (
                ("content_block_start" in kinds)
                if shape == "messages"
                else ("response.output_item.added" in kinds)
            )


def test_a_quick_run_reports_every_shape(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_translate.main(["--quick"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and lines[0].startswith("splitter alone:")
    assert all("µs/event" in line for line in lines)
