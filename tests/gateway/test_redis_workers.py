"""``warmroute serve --workers 2`` with Redis, as a real process group: shared affinity, then a SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from config.settings import RedisConfig, RoutingConfig
from gateway.redis_keys import RedisKeys
from gateway.redis_store import RedisAffinityStore
from tools.procs import child, free_port, ok, python, wait_http
from tools.redis_server import RedisServer

from upstreams import FAST_HEALTH, FakeEngine, serve

ROOT = Path(__file__).resolve().parents[2]
SYS = {"role": "system", "content": "You are a coding agent."}


def until(check: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not reached before the deadline"
        time.sleep(0.05)


@contextlib.contextmanager
def warmroute_serve(config: Path, port: int, workers: int) -> Iterator[subprocess.Popen[bytes]]:
    """The real CLI in its own process group, so the test can SIGKILL the supervisor and its workers."""
    args = python("-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port))
    with child([*args, "--workers", str(workers)], stdout=None, stderr=None, cwd=ROOT, group=True) as proc:
        yield proc


def shared_in_flight(cfg: RedisConfig, backends: list[str]) -> int:
    """In-flight requests as another replica would see them (others' live leases)."""

    async def read() -> int:
        store = RedisAffinityStore(cfg, RoutingConfig(), backends)
        try:
            view = await store.view(None)
            assert view.in_flight is not None, "observer could not reach Redis"
            return sum(view.in_flight.values())
        finally:
            await store.aclose()

    return asyncio.run(read())


def chat(url: str, conv: str, turn: int) -> httpx.Response:
    messages = [SYS, {"role": "user", "content": conv}]
    for j in range(turn):
        messages += [{"role": "assistant", "content": f"a{j}"}, {"role": "user", "content": f"u{j}"}]
    return httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages}, timeout=30)


def test_workers_share_affinity_and_a_killed_gateways_leases_expire(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    engines = [FakeEngine("a"), FakeEngine("b")]
    with contextlib.ExitStack() as stack:
        urls = {e.name: stack.enter_context(serve(e.app()))[0] for e in engines}
        redis_cfg = RedisConfig(
            url=redis_server.url, prefix=redis_prefix, timeout_s=2.0, lease_ttl_s=1.0, heartbeat_s=0.2
        )
        port = free_port()
        config = tmp_path / "warmroute.yaml"
        config.write_text(
            json.dumps(  # JSON is YAML
                {
                    "server": {"log_level": "warning"},
                    "backends": [{"id": n, "url": u, "models": ["m"]} for n, u in urls.items()],
                    "health": FAST_HEALTH,
                    "routing": {"policy": "affinity"},  # pins shared through Redis are the subject
                    "redis": redis_cfg.model_dump(),
                }
            )
        )
        gw = f"http://127.0.0.1:{port}"
        keys = RedisKeys(redis_prefix)
        r = redis_server.client()
        proc = stack.enter_context(warmroute_serve(config, port, workers=2))
        wait_http(gw + "/readyz", ok, timeout_s=30, process=proc)
        until(lambda: r.zcard(keys.replicas) == 2, 10, "both workers registered")

        # 1. Turns of one conversation stick, whichever worker accepts the connection (a new one each time).
        placed: dict[str, str] = {}
        for i in range(12):
            conv = f"conv {i % 6}"
            resp = chat(gw, conv, i // 6)
            assert resp.status_code == 200, resp.text
            assert (
                placed.setdefault(conv, resp.headers["x-warmroute-backend"])
                == resp.headers["x-warmroute-backend"]
            )

        def both_workers_served() -> (
            bool
        ):  # a replica's publication counter moves with each request it serves
            seqs = [r.hget(keys.in_flight(rep), "_seq") for rep in r.zrange(keys.replicas, 0, -1)]
            if len(seqs) == 2 and all(int(s or 0) > 0 for s in seqs):
                return True
            resp = chat(gw, "conv 0", 3)  # more traffic until the kernel has handed both workers some
            assert resp.headers["x-warmroute-backend"] == placed["conv 0"]
            return False

        until(both_workers_served, 15, "both workers serving")

        # 2. Requests in flight through the gateway are visible to other replicas...
        for e in engines:
            e.stall_s = 30
        for i in range(4):
            threading.Thread(target=lambda i=i: _ignore_errors(chat, gw, f"slow {i}", 0), daemon=True).start()
        until(lambda: shared_in_flight(redis_cfg, list(urls)) == 4, 10, "4 requests in flight")

        # 3. ...and when the whole gateway dies without a word, its leases lapse within the lease TTL.
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        killed = time.monotonic()
        until(lambda: shared_in_flight(redis_cfg, list(urls)) == 0, 10, "leases expired")
        assert time.monotonic() - killed < redis_cfg.lease_ttl_s + 5  # a loaded machine's slack
        for e in engines:
            e.stall_s = 0


def _ignore_errors(fn: Callable[..., object], *args: object) -> None:
    with contextlib.suppress(httpx.HTTPError):
        fn(*args)
