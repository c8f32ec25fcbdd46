"""What every generation route shares: fault checks and the output plan before it runs, disconnect watching
for JSON answers, the mid-stream crash fault for streamed ones."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from backends.sim.engine import RequestUsage, SimEngine
from backends.sim.protocol import SimError, SimRequest
from backends.sim.text import OutputPlan, continue_plan, plan_output

T = TypeVar("T")


class SimulatedCrash(RuntimeError):
    """Raised in a streamed body so the server breaks the connection (``die_mid_stream_after`` fault)."""


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(receive: Receive, work: Awaitable[T]) -> tuple[bool, T | None]:
    """Run ``work`` unless the client goes away first; returns (completed, result)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    if task.cancelled():
        return False, None
    return True, task.result()


class AbortingStream(StreamingResponse):
    """A streamed answer whose generation stops the moment its client disconnects, as vLLM's API server
    aborts one (``with_cancellation`` listens for the disconnect), not when the next token fails to send:
    Starlette listens only for servers older than ASGI 2.4, so this one says it is one."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        asgi = {**scope.get("asgi", {}), "spec_version": "2.3"}
        await super().__call__({**scope, "asgi": asgi}, receive, send)


async def break_after(chunks: AsyncGenerator[bytes, None], limit: int | None) -> AsyncGenerator[bytes, None]:
    async with aclosing(chunks):
        sent = 0
        async for chunk in chunks:
            if limit is not None and sent >= limit:
                raise SimulatedCrash(f"simulated engine death after {limit} chunks")
            yield chunk
            sent += 1


async def start(engine: SimEngine, req: SimRequest) -> OutputPlan:
    """Apply the before-the-first-byte faults (raising the injected failure), then plan the output."""
    faults = engine.faults
    if faults.take_failure():
        engine.stats.injected_failures += 1
        raise SimError(500, "simulated engine failure", "simulated_failure", "server_error")
    if faults.current.stall_s:
        await asyncio.sleep(faults.current.stall_s)
    cfg = engine.cfg
    if req.continues is not None and not faults.current.repeat_token:
        before, prefix = req.continues
        plan = continue_plan(
            before,
            prefix,
            req.spec,
            seed=cfg.seed,
            answer_tokens=cfg.answer_tokens,
            reasoning_tokens=cfg.reasoning_tokens,
        )
        if plan is not None:
            return plan
    return plan_output(
        req.prompt_text,
        req.spec,
        seed=cfg.seed,
        answer_tokens=cfg.answer_tokens,
        reasoning_tokens=cfg.reasoning_tokens,
        repeat_token=faults.current.repeat_token,
    )


async def run_to_end(engine: SimEngine, req: SimRequest, plan: OutputPlan, usage: RequestUsage) -> None:
    async with aclosing(engine.generate(req.prompt_tokens, plan, usage, req.priority)) as pieces:
        async for _ in pieces:
            pass
