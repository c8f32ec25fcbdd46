"""Shared-state cost benchmark (not a test): Redis vs in-memory affinity store, per routed request.

    python -m tools.bench_redis [--requests 3000] [--seconds 5] [--redis-url redis://127.0.0.1:6379/0]

Without ``--redis-url`` it starts a throwaway redis-server on a free 127.0.0.1 port (no persistence).

1. Store operations, as the proxy makes them for one routed request (view, policy, commit, started,
   finished), with 4 ready backends and a workload of 5-turn conversations (1 new turn in 5): time per
   request p50/p99 at 1 and at 32 concurrent requests, Redis round trips per request (counted on the
   client's connections) and commands Redis executed per request (INFO commandstats, script internals
   included).
2. End to end: a minimal upstream, the gateway (``warmroute serve``, one worker) with memory then Redis
   state, and a Python client sending one request at a time: p50/p99 latency and the difference.

Everything runs on 127.0.0.1 on this machine; on a busy machine numbers are noisy, so compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from backends.registry import Registry
from config.settings import BackendConfig, RedisConfig, RoutingConfig
from gateway.app import routing_params
from gateway.redis_store import RedisAffinityStore, redis_pool
from gateway.state import AffinityStore, MemoryAffinityStore
from routing.policies import make_policy
from routing.types import BackendState, PinAction, RouteRequest
from tools.bench_proxy import upstream_argv
from tools.bench_report import percentile
from tools.procs import child, free_port, python, wait_http
from tools.redis_server import CountingConnection, RedisServer, find_binary

BACKENDS = ("gpu-a", "gpu-b", "gpu-c", "gpu-d")
TURNS = 5


@dataclass
class StoreRun:
    name: str
    concurrency: int
    p50_us: float
    p99_us: float
    per_s: float
    round_trips: float | None = None
    commands: float | None = None


def _stats(samples: list[float], wall: float) -> tuple[float, float, float]:
    """p50 and p99 in microseconds, and requests per second over the run's wall time."""
    return (*_percentiles(samples), len(samples) / wall)


def _percentiles(samples: list[float]) -> tuple[float, float]:
    """p50 and p99 in microseconds."""
    p50, p99 = percentile(samples, 50), percentile(samples, 99)
    assert p50 is not None and p99 is not None, "no samples"
    return p50 * 1e6, p99 * 1e6


async def _route_one(store: AffinityStore, registry: Registry, policy: Any, key: str) -> float:
    """What the proxy does with the store for one request, minus the upstream call; returns seconds."""
    t = time.perf_counter()
    view = await store.view(key)
    decision = policy.select(
        registry.candidates(None, view.conversations, view.in_flight, t), RouteRequest(key, view.pinned), t
    )
    assert decision.backend is not None
    backend = decision.backend
    if decision.pin is not PinAction.NONE:
        backend = await store.commit(key, decision)
    store.started(backend)
    store.finished(backend)
    return time.perf_counter() - t


async def _drive(store: AffinityStore, requests: int, concurrency: int, tag: str) -> list[float]:
    registry = Registry(BackendConfig(id=b, url="http://127.0.0.1:1", models=("bench",)) for b in BACKENDS)
    for b in registry.backends.values():
        b.state = BackendState.READY
    policy = make_policy(routing_params(RoutingConfig()))
    # Conversation c's turns are requests c*TURNS .. c*TURNS+4, interleaved over many live conversations.
    keys = [f"{tag}-conv-{(i % 200) + 200 * (i // (200 * TURNS))}" for i in range(requests)]
    lat: list[float] = []
    queue = iter(keys)

    async def worker() -> None:
        for key in queue:
            lat.append(await _route_one(store, registry, policy, key))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return lat


async def bench_stores(url: str, requests: int) -> list[StoreRun]:
    runs: list[StoreRun] = []
    admin = redis.Redis.from_url(url, decode_responses=True)
    counting = CountingConnection.fresh()
    for concurrency in (1, 32):
        memory = MemoryAffinityStore(RoutingConfig())
        await _drive(memory, 500, concurrency, "warm")
        t = time.perf_counter()
        lat = await _drive(memory, requests, concurrency, "m")
        runs.append(StoreRun("memory", concurrency, *_stats(lat, time.perf_counter() - t)))
        # A generous timeout: on a busy machine a starved event loop must not turn into a fallback mid-run.
        prefix = f"bench-{os.getpid()}-{concurrency}:"
        cfg = RedisConfig(url=url, prefix=prefix, timeout_s=2.0, heartbeat_s=30, lease_ttl_s=60)
        store = RedisAffinityStore(
            cfg, RoutingConfig(), BACKENDS, pool=redis_pool(cfg, connection_class=counting)
        )
        await store.start()
        await _drive(store, 500, concurrency, "warm")
        sent, calls = counting.sent, _command_calls(admin)
        t = time.perf_counter()
        lat = await _drive(store, requests, concurrency, "r")
        wall = time.perf_counter() - t
        trips = (counting.sent - sent) / requests
        commands = (_command_calls(admin) - calls - 1) / requests  # minus our own INFO
        runs.append(StoreRun("redis", concurrency, *_stats(lat, wall), trips, commands))
        assert not store.status()["degraded"], store.status()
        await store.aclose()
    admin.close()
    return runs


def _command_calls(admin: redis.Redis) -> int:
    stats: dict[str, dict[str, int]] = admin.info("commandstats")
    return sum(v["calls"] for v in stats.values())


# -- end to end -----------------------------------------------------------------------------------------


def _sequential(url: str, seconds: float) -> tuple[int, float, float]:
    lat: list[float] = []
    conv = 0
    with httpx.Client() as client:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            conv += 1
            messages = [{"role": "user", "content": f"conversation {conv // TURNS}"}]
            t = time.perf_counter()
            client.post(url, json={"model": "bench", "messages": messages}).raise_for_status()
            lat.append(time.perf_counter() - t)
    p50, p99 = _percentiles(lat)
    return len(lat), p50 / 1e3, p99 / 1e3


def bench_end_to_end(url: str, seconds: float, tmp: Path) -> dict[str, tuple[int, float, float]]:
    up = free_port()
    out: dict[str, tuple[int, float, float]] = {}
    with child(upstream_argv(up), stderr=None) as upstream:
        wait_http(f"http://127.0.0.1:{up}/", process=upstream)
        for name, redis_section in (
            ("memory", {}),
            ("redis", {"url": url, "prefix": f"bench-e2e-{os.getpid()}:"}),
        ):
            port = free_port()
            config = tmp / f"{name}.yaml"
            config.write_text(
                json.dumps(
                    {
                        "server": {"log_level": "warning"},
                        "backends": [{"id": "up", "url": f"http://127.0.0.1:{up}", "models": ["bench"]}],
                        "health": {"interval_s": 60},
                        "redis": {**redis_section, "timeout_s": 2.0} if redis_section else {},
                    }
                )
            )
            serve = python("-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port))
            with child(serve, stderr=None) as gateway:
                base = f"http://127.0.0.1:{port}"
                wait_http(base + "/readyz", process=gateway)
                _sequential(base + "/v1/chat/completions", 1.0)  # warm up
                out[name] = _sequential(base + "/v1/chat/completions", seconds)
                state = httpx.get(base + "/readyz").json()["shared_state"]
                assert state["degraded"] is False, state
    return out


@contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    binary = find_binary()
    if binary is None:
        raise SystemExit("redis-server not found: install it or pass --redis-url")
    with RedisServer(binary) as server:
        yield server.url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_redis", description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--requests", type=int, default=3000, help="routed requests per store run")
    ap.add_argument("--seconds", type=float, default=5.0, help="end-to-end run length per gateway")
    ap.add_argument("--redis-url", help="an existing Redis (default: start a throwaway redis-server)")
    ap.add_argument("--skip-e2e", action="store_true")
    args = ap.parse_args(argv)
    with _redis(args.redis_url) as url:
        print(f"store operations per routed request ({len(BACKENDS)} backends, {TURNS}-turn conversations):")
        for r in asyncio.run(bench_stores(url, args.requests)):
            extra = f"  round trips {r.round_trips:.2f}  commands {r.commands:.1f}" if r.round_trips else ""
            timing = f"p50 {r.p50_us:8.1f} us  p99 {r.p99_us:8.1f} us  {r.per_s:8.0f} req/s"
            print(f"  {r.name:6} x{r.concurrency:<2}  {timing}{extra}")
        if args.skip_e2e:
            return 0
        with tempfile.TemporaryDirectory() as tmp:
            e2e = bench_end_to_end(url, args.seconds, Path(tmp))
        print("end to end, 1 request at a time, non-streaming, minimal upstream, 1 gateway worker:")
        for name, (n, p50, p99) in e2e.items():
            print(f"  {name:6}  p50 {p50:.3f} ms  p99 {p99:.3f} ms  ({n} requests)")
        (_, m50, m99), (_, r50, r99) = e2e["memory"], e2e["redis"]
        print(f"  redis adds  p50 {r50 - m50:+.3f} ms  p99 {r99 - m99:+.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
