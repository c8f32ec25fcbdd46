"""CPU cost of the output guard per streamed chunk: the proxy's relay loop with the guard on and off.

    python -m tools.bench_guard [--chunks 2000] [--streams 40] [--repeats 5]

Each stream is vLLM-shaped SSE (compact JSON, one token per event, one event per read), relayed by the
real ``Proxy`` from an in-memory transport to a ``send`` that drops the bytes, so what is measured is the
gateway's own work per chunk. Reported: process CPU microseconds per chunk, the best of ``--repeats``
(the least disturbed by other load on the machine), and the guard's own ``feed`` alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from backends.registry import Registry
from config.settings import GuardConfig, Settings, load_settings
from gateway.context import RequestContext
from gateway.guard import OutputGuard, StreamGuard
from gateway.metrics import Metrics
from gateway.proxy import AdmitAll, Proxy
from gateway.shapes.table import CHAT
from gateway.state import MemoryAffinityStore
from routing.policies.round_robin import RoundRobinPolicy
from routing.types import BackendState

WORDS = ("the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ",", " and")


def sse_chunks(n: int) -> list[bytes]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    out = []
    for i in range(n):
        choice = {"index": 0, "delta": {"content": WORDS[i % len(WORDS)]}, "logprobs": None}
        choice["finish_reason"] = "stop" if i == n - 1 else None
        out.append(b"data: " + json.dumps({**head, "choices": [choice]}, separators=(",", ":")).encode())
        out[-1] += b"\n\n"
    out.append(b"data: [DONE]\n\n")
    return out


class _Response:
    status = 200
    headers: Sequence[tuple[bytes, bytes]] = ((b"content-type", b"text/event-stream"),)

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk

    async def aclose(self) -> None:
        return None


class _Transport:
    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def request(
        self, method: str, origin: str, path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes
    ) -> _Response:
        return _Response(self.chunks)

    async def aclose(self) -> None:
        return None


def make_proxy(settings: Settings, chunks: list[bytes]) -> Proxy:
    store = MemoryAffinityStore(settings.routing)
    registry = Registry(settings.backends, listener=store)
    for b in registry.backends.values():
        b.state = BackendState.READY
    metrics = Metrics(registry)
    modules = [OutputGuard(settings.guard, metrics)] if settings.guard.enabled else []
    return Proxy(settings.timeouts, registry, store, AdmitAll(), metrics, _Transport(chunks), modules)


async def relay_cpu_per_chunk(guard: bool, chunks: list[bytes], streams: int) -> float:
    settings = load_settings(
        None, backends=[{"id": "a", "url": "http://a", "models": ["m"]}], guard={"enabled": guard}
    )
    proxy = make_proxy(settings, chunks)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    raw = json.dumps(body).encode()
    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.disconnect"}

    async def send(_message: Any) -> None:
        return None

    started = time.process_time()
    for _ in range(streams):
        ctx = RequestContext(
            "POST", "/v1/chat/completions", raw, body, "m", "k", RoundRobinPolicy(), [], {}, CHAT
        )
        await proxy.forward(receive, send, ctx)
    return (time.process_time() - started) / (streams * len(chunks)) * 1e6


def feed_cpu_per_chunk(chunks: list[bytes], streams: int) -> float:
    cfg = GuardConfig()
    started = time.process_time()
    for _ in range(streams):
        guard = StreamGuard(cfg, text_key=CHAT.text_key)
        for chunk in chunks:
            guard.feed(chunk)
    return (time.process_time() - started) / (streams * len(chunks)) * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=2000, help="events per stream")
    p.add_argument("--streams", type=int, default=40)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    chunks = sse_chunks(args.chunks)
    off = min(asyncio.run(relay_cpu_per_chunk(False, chunks, args.streams)) for _ in range(args.repeats))
    on = min(asyncio.run(relay_cpu_per_chunk(True, chunks, args.streams)) for _ in range(args.repeats))
    feed = min(feed_cpu_per_chunk(chunks, args.streams) for _ in range(args.repeats))
    print(f"relay CPU per chunk: guard off {off:.2f} us, guard on {on:.2f} us (+{on - off:.2f} us)")
    print(f"StreamGuard.feed alone: {feed:.2f} us per chunk ({len(chunks[0])} B events)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
