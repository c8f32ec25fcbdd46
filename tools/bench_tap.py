"""CPU per streamed chunk of the relay's ``ResponseTap``, with and without the first-reply capture.

python -m tools.bench_tap            # one SSE event per chunk, like an engine streaming token by token
"""

from __future__ import annotations

import json
import time

from gateway.observe import ResponseTap

EVENTS = 256
REPEATS = 400


def _stream() -> list[bytes]:
    def event(delta: dict[str, object]) -> bytes:
        doc = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}],
        }
        return f"data: {json.dumps(doc, separators=(',', ':'))}\n\n".encode()

    return [event({"role": "assistant", "content": ""})] + [
        event({"content": " word"}) for _ in range(EVENTS)
    ]


def per_chunk_ns(reply: bool, chunks: list[bytes]) -> float:
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter_ns()
        for _ in range(REPEATS):
            tap = ResponseTap(reply=reply)
            for chunk in chunks:
                tap.feed(chunk)
            tap.reply()
        best = min(best, (time.perf_counter_ns() - start) / (REPEATS * len(chunks)))
    return best


def main() -> None:
    chunks = _stream()
    off, on = per_chunk_ns(False, chunks), per_chunk_ns(True, chunks)
    print(f"{len(chunks)} chunks of ~{len(chunks[1])} bytes, best of 5 x {REPEATS} streams:")
    print(f"  tap without reply capture: {off:.0f} ns/chunk")
    print(
        f"  tap with reply capture:    {on:.0f} ns/chunk (+{on - off:.0f}; the capture stops after "
        f"{ResponseTap.__name__} has 64 characters)"
    )
    first = chunks[:14]
    print(f"  first 14 chunks only, with capture: {per_chunk_ns(True, first):.0f} ns/chunk")


if __name__ == "__main__":
    main()
