"""Two real gateway processes sharing one real redis-server: a change made on one reaches the other."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tools.procs import child, free_port, ok, python, wait_http
from tools.redis_server import RedisServer

from admin_helpers import chat, until_announced
from upstreams import FAST_HEALTH, FakeEngine, serve

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "replica-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
A = {"headers": AUTH}


@contextlib.contextmanager
def replica(config: Path) -> Iterator[str]:
    port = free_port()
    args = python("-m", "gateway.cli", "serve", "--config", str(config), "--port", str(port))
    with child(args, stdout=None, stderr=None, cwd=ROOT, group=True) as proc:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/readyz", ok, timeout_s=30, process=proc)
        yield url


def backends(url: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(url + "/admin/backends", headers=AUTH, timeout=5)
    assert r.status_code == 200, r.text
    return {b["id"]: b for b in r.json()["backends"]}


def served_by(url: str, conv: str) -> str:
    r = chat(url, conv)
    assert r.status_code == 200, r.text
    return r.headers["x-warmroute-backend"]


def test_a_change_on_one_replica_reaches_the_other(
    redis_server: RedisServer, redis_prefix: str, tmp_path: Path
) -> None:
    engines = {n: FakeEngine(n) for n in ("a", "b", "c")}
    with contextlib.ExitStack() as stack:
        urls = {n: stack.enter_context(serve(e.app()))[0] for n, e in engines.items()}
        config = tmp_path / "warmroute.yaml"
        config.write_text(
            json.dumps(
                {
                    "server": {"log_level": "warning"},
                    "backends": [{"id": n, "url": urls[n], "models": ["m"]} for n in ("a", "b")],
                    "health": FAST_HEALTH,
                    "routing": {"policy": "affinity"},  # pins shared through Redis are the subject
                    "redis": {"url": redis_server.url, "prefix": redis_prefix, "timeout_s": 2.0},
                    "admin": {"token": TOKEN, "sync_interval_s": 0.1},
                }
            )
        )
        one = stack.enter_context(replica(config))
        two = stack.enter_context(replica(config))

        # 1. Add on replica 1: replica 2 registers it, probes it, canaries it and routes to it.
        added = httpx.post(
            one + "/admin/backends",
            headers=AUTH,
            json={"id": "c", "url": urls["c"], "models": ["m"], "weight": 2},
        )
        assert added.status_code == 201 and added.json()["propagated"] is True
        until_announced(two, lambda: backends(two).get("c", {}).get("state") == "ready", "c ready on 2", **A)
        assert backends(two)["c"]["source"] == "runtime" and backends(two)["c"]["weight"] == 2.0
        on_c = next(conv for conv in (f"conv-{i}" for i in range(40)) if served_by(two, conv) == "c")
        r = redis_server.client()
        assert r.zcard(f"{redis_prefix}convs:c") >= 1

        # 2. Drain on replica 1: draining on replica 2; undrain comes back the same way.
        assert httpx.post(one + "/admin/backends/a/drain", headers=AUTH).json()["propagated"] is True
        until_announced(two, lambda: backends(two)["a"]["state"] == "draining", "a draining on 2", **A)
        httpx.post(one + "/admin/backends/a/undrain", headers=AUTH)
        until_announced(two, lambda: backends(two)["a"]["state"] == "ready", "a ready again on 2", **A)

        # 3. Weight on replica 1.
        httpx.patch(one + "/admin/backends/b", headers=AUTH, json={"weight": 5})
        until_announced(two, lambda: backends(two)["b"]["weight"] == 5.0, "b's weight on 2", **A)

        # 4. A replica started after the changes comes up with them.
        three = stack.enter_context(replica(config))
        assert backends(three)["b"]["weight"] == 5.0 and "c" in backends(three)

        # 5. Remove on replica 2 (the shared counts go with it): gone everywhere.
        removed = httpx.delete(two + "/admin/backends/c", headers=AUTH)
        assert removed.status_code == 200 and removed.json()["propagated"] is True
        for url in (one, three):
            until_announced(url, lambda url=url: "c" not in backends(url), f"c gone on {url}", **A)
        assert r.exists(f"{redis_prefix}convs:c") == 0
        turn = chat(one, on_c, 1)
        assert (turn.headers["x-warmroute-route"], turn.headers["x-warmroute-backend"] in ("a", "b")) == (
            "repin_removed",
            True,
        )
        assert json.loads(r.hget(f"{redis_prefix}admin:backends", "c") or "{}") == {
            "config": None,
            "cordoned": None,
            "drained": None,
        }
