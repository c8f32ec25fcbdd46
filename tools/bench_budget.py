"""What the gateway-enforced thinking budget costs: phase-2 TTFT on the warm engine vs a cold re-send.

    python -m tools.bench_budget                          # a simulator (time-scaled costs), 5 rounds
    python -m tools.bench_budget --engine http://127.0.0.1:8000 --model tiny-chat --prompt-words 3000

Each round streams one request with ``thinking_budget`` through a gateway whose backend is configured for the
gateway-enforced path, and records the client-side stall between the last reasoning token (end of phase 1)
and the first answer token (phase 2's first token, continuation on the same, warm engine). Then it sends the
very same phase-2 request straight to the engine after ``POST /reset_prefix_cache`` (cold: the prompt and
reasoning are prefilled again), and once more right after (warm, direct: no gateway in the way). Rounds use
distinct prompts. Medians are printed. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import uvicorn
from starlette.types import ASGIApp

from backends.sim import SimConfig, SimServer
from config.settings import ThinkingConfig, load_settings
from gateway.app import create_app
from gateway.continuation import Continuation, _Phase
from gateway.metrics import Metrics


@contextlib.contextmanager
def serve_in_thread(app: ASGIApp) -> Iterator[str]:
    """The gateway under uvicorn on a free local port, in a daemon thread; yields its root URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_budget", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", help="engine root URL (default: start a simulator)")
    p.add_argument("--model", default="sim-model")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=3000)
    p.add_argument("--max-tokens", type=int, default=64)
    return p.parse_args(argv)


def _prompt(words: int) -> list[dict[str, Any]]:
    tag = uuid.uuid4().hex[:8]
    text = " ".join(f"w{tag}{i % 97}" for i in range(words))
    return [{"role": "user", "content": f"{tag} {text}"}]


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Times of the first token, the last reasoning token and the first answer token; the texts."""
    start = time.perf_counter()
    out: dict[str, Any] = {"first": None, "last_reasoning": None, "first_content": None, "reasoning": ""}
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter() - start
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                thought = delta.get("reasoning") or delta.get("reasoning_content")
                if thought:
                    out["first"] = out["first"] or now
                    out["last_reasoning"] = now
                    out["reasoning"] += thought
                if delta.get("content"):
                    out["first"] = out["first"] or now
                    out["first_content"] = out["first_content"] or now
    return out


async def _round(
    client: httpx.AsyncClient, gw: str, engine: str, args: argparse.Namespace
) -> dict[str, float]:
    messages = _prompt(args.prompt_words)
    body = {
        "model": args.model,
        "messages": messages,
        "stream": True,
        "max_tokens": args.max_tokens,
        "thinking_budget": args.budget,
        "temperature": 0,
        "ignore_eos": True,
    }
    through = await _stream(client, gw + "/v1/chat/completions", body)
    cont = Continuation(ThinkingConfig(), Metrics.__new__(Metrics))
    phase = _Phase(reasoning=[through["reasoning"]], usage={"completion_tokens": args.budget})
    phase2 = cont.phase2_body({k: v for k, v in body.items() if k != "thinking_budget"}, phase, stream=True)
    await client.post(engine + "/reset_prefix_cache")
    cold = await _stream(client, engine + "/v1/chat/completions", phase2)
    warm = await _stream(client, engine + "/v1/chat/completions", phase2)
    return {
        "gateway_gap_s": (through["first_content"] or 0) - (through["last_reasoning"] or 0),
        "cold_ttft_s": cold["first"] or 0,
        "warm_ttft_s": warm["first"] or 0,
    }


async def run(args: argparse.Namespace, engine: str) -> list[dict[str, float]]:
    backends = [{"id": "e", "url": engine, "models": [args.model], "budget_enforcement": "gateway"}]
    app = create_app(load_settings(None, backends=backends))
    results = []
    with serve_in_thread(app) as gw:
        async with httpx.AsyncClient(timeout=300) as client:
            await _round(client, gw, engine, args)  # warm-up: connections, first-request costs
            for _ in range(args.rounds):
                try:
                    results.append(await _round(client, gw, engine, args))
                except RuntimeError as exc:
                    print(f"round skipped: {exc}", file=sys.stderr)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.engine:
        results = asyncio.run(run(args, args.engine.rstrip("/")))
    else:
        cfg = SimConfig(name="bench", reasoning=True, reasoning_tokens=(4 * args.budget, 4 * args.budget))
        with SimServer(cfg) as sim:
            results = asyncio.run(run(args, sim.base_url))
    for key in ("gateway_gap_s", "warm_ttft_s", "cold_ttft_s"):
        values = [r[key] for r in results]
        print(f"{key:>14}: median {statistics.median(values) * 1000:8.1f} ms  (n={len(values)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
