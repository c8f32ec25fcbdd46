"""The admin API over the Redis store: pins, shared counts, removal cleanup, explain without writes."""

from __future__ import annotations

import httpx

from routing.keys import chat_key
from tools.procs import free_port
from tools.redis_server import RedisServer

from admin_helpers import chat, chat_body
from clusters import ClusterFactory


def test_pins_counts_and_removal_in_redis(
    cluster: ClusterFactory, redis_server: RedisServer, redis_prefix: str
) -> None:
    c = cluster(
        ["a", "b"],
        redis={"url": redis_server.url, "prefix": redis_prefix, "timeout_s": 2.0},
        routing={"policy": "affinity"},
    )
    r = redis_server.client()
    served = chat(c.url, "conv-r").headers["x-warmroute-backend"]
    key = chat_key(chat_body("conv-r"))
    pin = httpx.get(f"{c.url}/admin/pins/{key}").json()
    assert (pin["backend"], pin["backend_configured"]) == (served, True)
    assert 3590 < pin["expires_in_s"] <= 3600
    view = httpx.get(f"{c.url}/admin/backends/{served}").json()
    assert (view["pinned_conversations"], view["in_flight"], view["in_flight_shared"]) == (1, 0, 0)
    stats = httpx.get(c.url + "/admin/affinity").json()
    assert (stats["store"], stats["pins"], stats["per_backend"]) == ("redis", 1, {served: 1})

    # Explain reads Redis but writes no pin.
    keys_before = sorted(r.keys(f"{redis_prefix}pin:*"))
    e = httpx.post(c.url + "/admin/route/explain", json={"body": chat_body("conv-new")}).json()
    assert e["reason"] == "new_least_loaded"
    assert sorted(r.keys(f"{redis_prefix}pin:*")) == keys_before == [f"{redis_prefix}pin:{key}"]

    # Forget: the pin and its place in the backend's set go.
    assert httpx.delete(f"{c.url}/admin/pins/{key}").json() == {"key": key, "backend": served}
    assert r.exists(f"{redis_prefix}pin:{key}") == 0 and r.zcard(f"{redis_prefix}convs:{served}") == 0
    assert httpx.get(f"{c.url}/admin/pins/{key}").status_code == 404

    # Removal: the backend's shared set goes; the pin stays until its conversation's next turn re-pins it.
    chat(c.url, "conv-r", 1)
    served = httpx.get(f"{c.url}/admin/pins/{key}").json()["backend"]
    assert r.zcard(f"{redis_prefix}convs:{served}") == 1
    assert httpx.delete(f"{c.url}/admin/backends/{served}").status_code == 200
    assert r.exists(f"{redis_prefix}convs:{served}") == 0
    assert httpx.get(f"{c.url}/admin/pins/{key}").json()["backend_configured"] is False
    turn = chat(c.url, "conv-r", 2)
    assert turn.headers["x-warmroute-route"] == "repin_removed"
    assert httpx.get(f"{c.url}/admin/pins/{key}").json()["backend"] == turn.headers["x-warmroute-backend"]
    record = r.hget(f"{redis_prefix}admin:backends", served)
    assert record == '{"config": null}' and r.get(f"{redis_prefix}admin:version") == "1"


def test_a_change_with_redis_down_stays_local_and_says_so(cluster: ClusterFactory) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    c = cluster(["a", "b"], redis={"url": dead, "timeout_s": 0.2})
    r = httpx.post(f"{c.url}/admin/backends/a/drain")
    assert r.status_code == 200
    assert (r.json()["propagated"], r.json()["backend"]["state"]) == (False, "draining")
    # Reset is never published: false with Redis configured (null only without Redis).
    assert httpx.post(f"{c.url}/admin/backends/a/reset").json()["propagated"] is False
    assert httpx.get(c.url + "/admin/affinity").json()["degraded"] is True
