"""Test servers on 127.0.0.1: a small fake OpenAI engine and a helper that runs any ASGI app in a thread.

The fake engine is deliberately dumb; the engine simulator (backends/sim) and real vLLM (tests/e2e) are the
realistic upstreams. This one exists to script failures precisely.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp

from config.settings import DEFAULT_CONSISTENCY_PROMPT

#: The deadline of one health probe in tests. A test's engine (a fake in this process, a simulator process)
#: answers /health at once, but on a loaded machine (load 11 on 2 cores) a 1 s deadline was missed and a
#: healthy engine went down, which no test meant. A stopped engine refuses the connection and a sick one
#: answers 503, so neither waits for this deadline; a test of a slow /health sets its own.
PROBE_TIMEOUT_S = 10.0
#: Health checking for gateways in front of fake engines: a stopped or sick one is down within one interval.
FAST_HEALTH: dict[str, float] = {"interval_s": 0.2, "timeout_s": PROBE_TIMEOUT_S, "fail_threshold": 1}


@contextlib.contextmanager
def serve(app: ASGIApp, port: int = 0) -> Iterator[tuple[str, uvicorn.Server]]:
    """Run ``app`` under uvicorn in a daemon thread; yields (base_url, server)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    with served(config) as (bound, server):
        yield f"http://127.0.0.1:{bound}", server


class AnnouncedServer(uvicorn.Server):
    """uvicorn's server, announcing the end of its start-up (``up``) instead of leaving a flag to poll."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.up = threading.Event()  # set once listening, or once start-up failed (``started`` says which)

    async def startup(self, sockets: Any = None) -> None:
        try:
            await super().startup(sockets)
        finally:
            self.up.set()


@contextlib.contextmanager
def served(config: uvicorn.Config) -> Iterator[tuple[int, uvicorn.Server]]:
    """Run ``config`` in a daemon thread; yields (port, server)."""
    server = AnnouncedServer(config)

    def run() -> None:
        try:
            server.run()
        finally:
            server.up.set()  # a start-up that raised before ``startup`` ran

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not server.up.wait(10) or not server.started:
        raise RuntimeError("test server did not start")
    port: int = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield port, server
    finally:
        server.should_exit = True
        thread.join(10)


@dataclass
class FakeEngine:
    """Scriptable OpenAI-ish engine. Counters are read by tests from another thread (ints: atomic enough)."""

    name: str
    models: tuple[str, ...] = ("m",)
    chunks: int = 3
    chunk_delay_s: float = 0.0
    fail_next: int = 0  # answer 500 to the next N generation requests
    answer_status: int | None = None  # answer every generation request with this error status instead
    api_key: str | None = None  # configured as the backend's own api_key by the cluster fixture
    die_after: int | None = None  # break the connection after this many streamed chunks
    stall_s: float = 0.0  # wait this long before answering
    healthy: bool = True
    gate: threading.Event | None = None  # if set, the stream waits on it after the first chunk
    canary_answer: str | None = None  # what it answers the gateway's canary (None: a passing answer)
    canaries: int = 0  # canary requests answered (kept out of every other counter and fault)
    scrapes: int = (
        0  # GET /metrics answered (the default routing policy scrapes engines; kept out of the rest)
    )
    extra_headers: dict[str, str] = field(default_factory=dict)  # added to every generation response
    requests: list[dict[str, Any]] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)  # the exact body bytes of every request it received
    paths: list[str] = field(default_factory=list)  # raw request target of every request (catch-all too)
    headers: list[dict[str, str]] = field(default_factory=list)
    active: int = 0
    cancelled: int = 0
    completed: int = 0

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self._health),
                Route("/metrics", self._metrics),
                Route("/v1/models", self._models),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._chat, methods=["POST"]),
                Route("/v1/embeddings", self._embeddings, methods=["POST"]),
                Route("/{rest:path}", self._echo, methods=["GET", "POST", "DELETE", "HEAD"]),
            ]
        )

    async def _echo(self, request: Request) -> Response:
        """Any other path: 200 with what arrived (raw target, method, body), so tests see what was sent."""
        target = request.scope["raw_path"].decode("latin-1")
        if request.scope["query_string"]:
            target += "?" + request.scope["query_string"].decode("latin-1")
        self.paths.append(target)
        raw = await request.body()
        self.raw.append(raw)
        echo = {"target": target, "method": request.method, "body": raw.decode(), "served_by": self.name}
        return JSONResponse(echo, headers=self.extra_headers)

    async def _metrics(self, _request: Request) -> Response:
        self.scrapes += 1
        return Response(b"", media_type="text/plain; version=0.0.4")

    async def _health(self, _request: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)

    async def _models(self, _request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _embeddings(self, request: Request) -> Response:
        body = await request.json()
        self.requests.append(body)
        return JSONResponse(
            {"object": "list", "data": [{"embedding": [0.1], "index": 0}], "served_by": self.name}
        )

    async def _chat(self, request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw)
        if _is_canary(body):
            # The gateway's default admission check (same greedy prompt twice): answered at once and
            # consistently, outside the scripted faults, so tests count and script only their own traffic.
            self.canaries += 1
            answer = self.canary_answer or "Mercury, Venus, Earth, Mars, Jupiter"
            message = {"role": "assistant", "content": answer}
            return JSONResponse({"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})
        self.raw.append(raw)
        self.paths.append(request.scope["raw_path"].decode("latin-1"))
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        if self.fail_next > 0:
            self.fail_next -= 1
            return JSONResponse({"error": {"message": "engine exploded", "type": "server_error"}}, 500)
        if self.answer_status is not None:
            error = {"error": {"message": f"engine says {self.answer_status}", "type": "engine_error"}}
            return JSONResponse(error, self.answer_status, headers=self.extra_headers)
        if self.stall_s and await self._stall(request):
            self.cancelled += 1
            return Response(status_code=499)
        if body.get("stream"):
            return StreamingResponse(
                self._stream(body), media_type="text/event-stream", headers=self.extra_headers
            )
        self.completed += 1
        return JSONResponse(self._completion(body), headers=self.extra_headers)

    async def _stall(self, request: Request) -> bool:
        """Sleep ``stall_s`` like a slow engine; True if the client (the gateway) hung up meanwhile."""
        self.active += 1
        try:
            deadline = time.monotonic() + self.stall_s
            while time.monotonic() < deadline:
                if await request.is_disconnected():
                    return True
                await asyncio.sleep(0.02)
            return False
        finally:
            self.active -= 1

    def _completion(self, body: dict[str, Any]) -> dict[str, Any]:
        text = " ".join(f"{self.name}-{i}" for i in range(self.chunks))
        return {
            "id": "cmpl-1",
            "object": "chat.completion",
            "created": 0,
            "model": body.get("model"),
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            ],
            "usage": {"prompt_tokens": 1, "completion_tokens": self.chunks, "total_tokens": 1 + self.chunks},
        }

    async def _stream(self, body: dict[str, Any]) -> AsyncIterator[bytes]:
        self.active += 1
        done = False
        try:
            for i in range(self.chunks):
                if self.die_after is not None and i >= self.die_after:
                    raise ConnectionAbortedError("fake engine died mid-stream")
                chunk = {
                    "id": "cmpl-1",
                    "object": "chat.completion.chunk",
                    "created": 0,
                    "model": body.get("model"),
                    "choices": [
                        {"index": 0, "delta": {"content": f"{self.name}-{i} "}, "finish_reason": None}
                    ],
                }
                yield f"data: {json.dumps(chunk)}\n\n".encode()
                if i == 0 and self.gate is not None:
                    while not self.gate.is_set():  # noqa: ASYNC110 - a threading.Event set by the test thread
                        await asyncio.sleep(0.01)
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            yield b"data: [DONE]\n\n"
            done = True
            self.completed += 1
        finally:
            self.active -= 1
            if not done:
                self.cancelled += 1


def _is_canary(body: dict[str, Any]) -> bool:
    messages = body.get("messages")
    return (
        isinstance(messages, list)
        and len(messages) == 1
        and isinstance(messages[0], dict)
        and messages[0].get("content") == DEFAULT_CONSISTENCY_PROMPT
    )
