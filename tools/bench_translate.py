"""CPU per streamed chat event of the translation body filter (gateway/translation.py): the engine's chat
chunks, split into SSE events, parsed and re-emitted as Anthropic Messages or OpenAI Responses events.

python -m tools.bench_translate          # both shapes, text-only and with a tool call
python -m tools.bench_translate --quick  # fewer repeats (a smoke run)
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

from gateway.sse import EventSplitter
from gateway.translation import TRANSLATORS, _Stream

EVENTS = 256


def _event(delta: dict[str, object], finish: str | None = None) -> bytes:
    doc = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n".encode()


def stream(tool: bool) -> list[bytes]:
    """One event per read, as an engine streaming token by token: text, then (``tool``) a call's fragments."""
    reads = [_event({"role": "assistant", "content": ""})]
    words = EVENTS // 2 if tool else EVENTS
    reads += [_event({"content": " word"}) for _ in range(words)]
    if tool:
        call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "ls", "arguments": ""}}
        reads.append(_event({"tool_calls": [call]}))
        fragment = {"index": 0, "function": {"arguments": '"x",'}}
        reads += [_event({"tool_calls": [fragment]}) for _ in range(EVENTS - words - 1)]
    usage = {
        "prompt_tokens": 900,
        "completion_tokens": EVENTS,
        "prompt_tokens_details": {"cached_tokens": 512},
    }
    reads.append(f'data: {{"id":"chatcmpl-1","choices":[],"usage":{json.dumps(usage)}}}\n\n'.encode())
    reads.append(b"data: [DONE]\n\n")
    return reads


def per_event_ns(shape: str, reads: list[bytes], repeats: int) -> float:
    """Best of five runs: ns per engine event, splitter included (the relay runs one for any filter)."""
    translator = TRANSLATORS[shape]
    req = {"model": "m", "stream": True}
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(repeats):
            splitter = EventSplitter()
            f = _Stream(translator.stream(req), "a")
            for read in reads:
                f.events(splitter.feed(read))
            f.end()
        best = min(best, (time.perf_counter_ns() - start) / (repeats * len(reads)))
    return best


def baseline_ns(reads: list[bytes], repeats: int) -> float:
    """The splitter alone: what any filter on a stream already costs."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(repeats):
            splitter = EventSplitter()
            for read in reads:
                splitter.feed(read)
        best = min(best, (time.perf_counter_ns() - start) / (repeats * len(reads)))
    return best


def floor_ns(reads: list[bytes], repeats: int) -> float:
    """One ``json.loads`` and one ``json.dumps`` per event: the least any translation that parses costs."""
    docs = [read[6:-2] for read in reads[:-1]]
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(repeats):
            for doc in docs:
                json.dumps(json.loads(doc))
        best = min(best, (time.perf_counter_ns() - start) / (repeats * len(docs)))
    return best


def main(argv: Sequence[str] | None = None) -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_known_args(argv)[1]
    repeats = 5 if "--quick" in args else 40
    text, tool = stream(False), stream(True)
    print(f"splitter alone: {baseline_ns(text, repeats) / 1000:.2f} µs/event")
    print(f"json floor (loads + dumps): {floor_ns(text, repeats) / 1000:.2f} µs/event")
    for shape in ("messages", "responses"):
        for name, reads in (("text", text), ("tool call", tool)):
            ns = per_event_ns(shape, reads, repeats)
            print(f"{shape:>9} {name:>9}: {ns / 1000:.2f} µs/event ({len(reads)} events per answer)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
