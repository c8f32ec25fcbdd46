"""Upstream client benchmark (not a test): httpx.AsyncClient vs gateway.upstream.UpstreamPool.

    python -m tools.bench_upstream [--requests 20000] [--concurrency 32] [--rounds 2] [--loop asyncio]

The upstream is ``tools.bench_proxy:upstream_app`` under uvicorn in its own process, answering a fixed
249-byte chat completion. This process (uvloop by default, like the gateway) drives N concurrent workers
through each client in turn, interleaved, the same way the proxy does (POST, stream the body raw, close),
and reports the client's CPU time per request (``time.process_time``: user+system of this process only, so
the upstream's share of the 2 cores does not count) and throughput. Medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
import uvloop

from gateway.upstream import UpstreamPool
from tools.bench_proxy import BODY, cpu_seconds, upstream_argv
from tools.procs import child, free_port, wait_http

PATH = "/v1/chat/completions"
HEADERS = [(b"content-type", b"application/json"), (b"accept", b"*/*"), (b"x-request-id", b"bench")]
WARMUP = 1000

OneRequest = Callable[[], Awaitable[int]]


@dataclass
class Sample:
    client: str
    requests: int
    cpu_s: float
    wall_s: float
    upstream_cpu_s: float  # a sanity check: both clients should cost the upstream about the same

    @property
    def cpu_ms_per_request(self) -> float:
        return self.cpu_s / self.requests * 1e3

    @property
    def rps(self) -> float:
        return self.requests / self.wall_s

    @property
    def upstream_ms_per_request(self) -> float:
        return self.upstream_cpu_s / self.requests * 1e3


async def drive(one: OneRequest, requests: int, concurrency: int) -> tuple[float, float]:
    """Run ``requests`` calls of ``one`` over ``concurrency`` workers; (CPU seconds, wall seconds)."""
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            if await one() != 200:
                raise RuntimeError("upstream answered non-200")

    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.process_time() - cpu0, time.perf_counter() - wall0


def httpx_client(origin: str, raw: bytes) -> tuple[OneRequest, Callable[[], Awaitable[None]]]:
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=1024)
    client = httpx.AsyncClient(limits=limits, follow_redirects=False)
    url, headers = origin + PATH, [(k.decode(), v.decode()) for k, v in HEADERS]

    async def one() -> int:
        request = client.build_request("POST", url, content=raw, headers=headers)
        response = await client.send(request, stream=True)
        try:
            async for _chunk in response.aiter_raw():
                pass
        finally:
            await response.aclose()
        return response.status_code

    return one, client.aclose


def upstream_pool(origin: str, raw: bytes) -> tuple[OneRequest, Callable[[], Awaitable[None]]]:
    pool = UpstreamPool(connect_timeout=5.0)

    async def one() -> int:
        response = await pool.request("POST", origin, PATH, HEADERS, raw)
        try:
            async for _chunk in response.aiter_raw():
                pass
        finally:
            await response.aclose()
        return response.status

    return one, pool.aclose


CLIENTS = {"httpx.AsyncClient": httpx_client, "UpstreamPool": upstream_pool}


async def bench(origin: str, upstream_pid: int, args: argparse.Namespace) -> list[Sample]:
    raw = json.dumps(BODY).encode()
    samples: list[Sample] = []
    for n in range(1, args.rounds + 1):
        for name, make in CLIENTS.items():
            one, close = make(origin, raw)
            try:
                await drive(one, WARMUP, args.concurrency)  # open the pool's connections, warm the code paths
                upstream_cpu = cpu_seconds(upstream_pid)
                cpu, wall = await drive(one, args.requests, args.concurrency)
                upstream_cpu = cpu_seconds(upstream_pid) - upstream_cpu
            finally:
                await close()
            samples.append(Sample(name, args.requests, cpu, wall, upstream_cpu))
            print(f"  round {n}  {report(samples[-1:])}")
    return samples


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_upstream", description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--loop", choices=["uvloop", "asyncio"], default="uvloop", help="the client's event loop")
    args = ap.parse_args(argv)
    port = free_port()
    with child(upstream_argv(port)) as upstream:
        origin = f"http://127.0.0.1:{port}"
        wait_http(origin + "/", process=upstream)
        print(
            f"{args.requests:,} requests x {args.rounds} rounds, {args.concurrency} concurrent, interleaved:"
        )
        run = uvloop.run if args.loop == "uvloop" else asyncio.run
        samples = run(bench(origin, upstream.pid, args))
    print("\nmedians:")
    for name in CLIENTS:
        print(f"  {report([s for s in samples if s.client == name])}")
    return 0


def report(samples: list[Sample]) -> str:
    """One line for one client: medians over ``samples``."""
    cpu = statistics.median(s.cpu_ms_per_request for s in samples)
    rps = statistics.median(s.rps for s in samples)
    upstream = statistics.median(s.upstream_ms_per_request for s in samples)
    return (
        f"{samples[0].client:<18} client {cpu:.3f} ms CPU/request  {rps:>7,.0f} req/s"
        f"  (upstream {upstream:.3f} ms CPU/request)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
