"""/admin/backends: read, add, remove, operator commands, weight, canary; state asserted exactly."""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import httpx
import pytest

from backends.sim.app import create_sim_app
from backends.sim.config import SimConfig
from config.settings import load_settings
from gateway.admin import api as admin_api
from gateway.app import create_app

from admin_helpers import chat, metric_lines, until
from clusters import Cluster, ClusterFactory
from upstreams import FakeEngine, serve


def admin(url: str, method: str, path: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, url + "/admin" + path, timeout=10, **kwargs)


def test_list_and_get_backends(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"])
    r = admin(c.url, "GET", "/backends")
    assert r.status_code == 200
    items = {b["id"]: b for b in r.json()["backends"]}
    assert sorted(items) == ["a", "b"]
    a = items["a"]
    assert (a["state"], a["routable"], a["in_flight"], a["pinned_conversations"]) == ("ready", True, 0, 0)
    assert (a["source"], a["models"], a["weight"], a["circuit"]) == ("config", ["m"], 1.0, "closed")
    assert a["canary"]["passed"] is True and a["in_flight_shared"] is None
    one = admin(c.url, "GET", "/backends/b")
    assert one.status_code == 200 and one.json()["id"] == "b"
    missing = admin(c.url, "GET", "/backends/nope")
    assert missing.status_code == 404
    assert missing.json()["error"] == {
        "message": "no backend 'nope'",
        "type": "invalid_request_error",
        "param": "id",
        "code": "backend_not_found",
    }


def test_added_backend_takes_traffic_after_its_canary(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    extra = FakeEngine("c", models=("m2",))
    with serve(extra.app()) as (url, _server):
        r = admin(c.url, "POST", "/backends", json={"id": "c", "url": url, "models": ["m2"]})
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["backend"]["id"] == "c" and body["backend"]["source"] == "runtime"
        assert body["propagated"] is None  # no Redis configured: this replica only, and nothing failed
        c.wait_for(lambda: _state(c, "c") == "ready", "c ready")
        assert extra.canaries == 2  # the consistency canary asks twice before admitting it
        answer = httpx.post(
            c.url + "/v1/chat/completions",
            json={"model": "m2", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        )
        assert answer.status_code == 200 and answer.headers["x-warmroute-backend"] == "c"
        assert httpx.get(c.url + "/v1/models").json()["data"][1]["id"] == "m2"
        dup = admin(c.url, "POST", "/backends", json={"id": "c", "url": url, "models": ["m2"]})
        assert dup.status_code == 409 and dup.json()["error"]["param"] == "id"
        assert dup.json()["error"]["code"] == "conflict"
        admin(c.url, "DELETE", "/backends/c")


def test_removal_repins_cleans_up_and_reports(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"])
    first = chat(c.url, "conv-1")
    pinned = first.headers["x-warmroute-backend"]
    other = "a" if pinned == "b" else "b"
    url = c.gateway.registry.backends[pinned].cfg.url
    assert c.gateway.transport.connections(url) == 1  # the pooled keep-alive connection
    assert any(f'backend="{pinned}"' in line for line in metric_lines(c.url, "warmroute_requests_total"))
    r = admin(c.url, "DELETE", f"/backends/{pinned}")
    assert r.status_code == 200, r.text
    assert r.json() == {
        "id": pinned,
        "propagated": None,
        "in_flight_at_removal": 0,
        "models_left_without_backend": [],
        "connections_closed": 1,
        "warnings": [],
    }
    assert pinned not in c.gateway.registry.backends and pinned not in c.gateway.fleet.controllers
    until(lambda: c.gateway.transport.connections(url) == 0, what="its connection closed")  # aborted: gone
    text = httpx.get(c.url + "/metrics").text
    assert f'backend="{pinned}"' not in text  # every series labelled with it is gone
    assert admin(c.url, "GET", f"/backends/{pinned}").status_code == 404
    again = chat(c.url, "conv-1", turn=1)
    assert again.status_code == 200
    assert (again.headers["x-warmroute-backend"], again.headers["x-warmroute-route"]) == (
        other,
        "repin_removed",
    )
    assert chat(c.url, "conv-1", turn=2).headers["x-warmroute-route"] == "affinity_hit"
    assert c.in_flight() == 0
    assert admin(c.url, "DELETE", f"/backends/{pinned}").status_code == 404


def test_removing_the_last_backend_of_a_model_is_allowed_and_reported(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a"), FakeEngine("z", models=("solo",))])
    r = admin(c.url, "DELETE", "/backends/z")
    assert r.status_code == 200
    assert r.json()["models_left_without_backend"] == ["solo"]
    assert r.json()["warnings"] == [
        "model 'solo' has no backend now: its requests get 404 until one is added"
    ]
    gone = httpx.post(
        c.url + "/v1/chat/completions", json={"model": "solo", "messages": [{"role": "user", "content": "x"}]}
    )
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"


def test_operator_commands_reach_the_lifecycle(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"])
    for command, state, flags in [
        ("drain", "draining", (True, False)),
        ("undrain", "ready", (False, False)),
        ("cordon", "cordoned", (False, True)),
        ("uncordon", "ready", (False, False)),
    ]:
        r = admin(c.url, "POST", f"/backends/a/{command}")
        assert r.status_code == 200, r.text
        view = r.json()["backend"]
        assert (view["state"], (view["drained"], view["cordoned"])) == (state, flags), command
        assert c.gateway.registry.backends["a"].state.value == state
    admin(c.url, "POST", "/backends/a/drain")
    for turn in range(3):
        assert chat(c.url, f"new-{turn}").headers["x-warmroute-backend"] == "b"
    assert admin(c.url, "POST", "/backends/nope/drain").status_code == 404
    assert admin(c.url, "GET", "/backends/a/drain").status_code == 405


def test_reset_is_local_and_says_so(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    r = admin(c.url, "POST", "/backends/a/reset")
    assert r.status_code == 200
    assert r.json()["warnings"] == ["reset acts on this replica only (each replica probes its own engines)"]
    assert r.json()["backend"]["state"] == "ready"  # a READY backend stays READY (its breaker is cleared)


def test_reset_closes_an_open_circuit_and_the_backend_takes_traffic_again(cluster: ClusterFactory) -> None:
    # Defect: reset acted on DOWN backends only, so an open (or wedged-open) circuit outlived it.
    breaker = {"failure_threshold": 1, "open_s": 600, "open_max_s": 600}
    c = cluster(engines=[FakeEngine("a", die_after=1)], breaker=breaker)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    r = httpx.post(c.url + "/v1/chat/completions", json=body, timeout=10)
    assert b"event: error" in r.content  # broke mid-stream: a breaker failure
    a = admin(c.url, "GET", "/backends/a").json()
    assert (a["state"], a["circuit"], a["routable"]) == ("ready", "open", False)
    assert chat(c.url, "refused").status_code == 503
    c.engines["a"].die_after = None
    r = admin(c.url, "POST", "/backends/a/reset")
    assert r.status_code == 200
    view = r.json()["backend"]
    assert (view["state"], view["circuit"], view["routable"]) == ("ready", "closed", True)
    assert [chat(c.url, f"after-{i}").status_code for i in range(3)] == [200, 200, 200]
    assert c.gateway.fleet.controllers["a"].breaker.consecutive_failures == 0


def test_without_redis_every_change_says_propagated_null(cluster: ClusterFactory) -> None:
    """Null, not false: false means Redis was configured and failed (tests/admin/test_redis_admin.py)."""
    c = cluster(["a", "b"])
    changes = [("POST", f"/backends/a/{cmd}") for cmd in ("drain", "undrain", "cordon", "uncordon", "reset")]
    for method, path in changes:
        r = admin(c.url, method, path)
        assert (r.status_code, r.json()["propagated"]) == (200, None), (path, r.text)
    r = admin(c.url, "PATCH", "/backends/b", json={"weight": 2})
    assert (r.status_code, r.json()["propagated"]) == (200, None)


def test_patch_weight(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"])
    r = admin(c.url, "PATCH", "/backends/a", json={"weight": 3})
    assert r.status_code == 200 and r.json()["backend"]["weight"] == 3.0
    assert c.gateway.registry.backends["a"].cfg.weight == 3.0
    for bad, param in [
        ({"weight": 0}, "weight"),
        ({"weight": "x"}, "weight"),
        ({}, "weight"),
        ({"weight": 1, "url": "x"}, "url"),
    ]:
        r = admin(c.url, "PATCH", "/backends/a", json=bad)
        assert r.status_code == 422, bad
        assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == "validation_error"
    assert c.gateway.registry.backends["a"].cfg.weight == 3.0
    assert admin(c.url, "PATCH", "/backends/nope", json={"weight": 2}).status_code == 404


def test_canary_rerun_reports_without_changing_state(cluster: ClusterFactory) -> None:
    engine = FakeEngine("a")
    c = cluster(engines=[engine])
    before = engine.canaries
    r = admin(c.url, "POST", "/backends/a/canary")
    assert r.status_code == 200
    assert (r.json()["passed"], r.json()["state"], engine.canaries - before) == (True, "ready", 2)
    engine.canary_answer = "3333333333333333"
    r = admin(c.url, "POST", "/backends/a/canary")
    assert r.json()["passed"] is False and r.json()["state"] == "ready"
    assert "3333" in r.json()["result"]["answered_text"]
    assert admin(c.url, "GET", "/backends/a").json()["canary"]["passed"] is False  # the last run is shown
    assert admin(c.url, "POST", "/backends/nope/canary").status_code == 404


def test_add_rejects_bad_bodies_naming_the_field(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    good = {"id": "n", "url": "http://127.0.0.1:9", "models": ["m"]}
    cases: list[tuple[Any, int, str | None]] = [
        ({**good, "url": None}, 422, "url"),
        ({k: v for k, v in good.items() if k != "url"}, 422, "url"),
        ({**good, "url": "ftp://x"}, 422, "url"),
        ({**good, "url": "http://"}, 422, "url"),
        ({**good, "url": "http://h:99999"}, 422, "url"),
        ({**good, "models": []}, 422, "models"),
        ({**good, "weight": -1}, 422, "weight"),
        ({**good, "id": "bad id/"}, 422, "id"),
        ({**good, "surprise": 1}, 422, "surprise"),
        ({**good, "managed": {"command": "sleep 1000"}}, 422, "managed"),
        ([good], 400, None),
    ]
    for body, status, param in cases:
        r = admin(c.url, "POST", "/backends", json=body)
        assert r.status_code == status, (body, r.text)
        assert r.json()["error"]["param"] == param, body
    raw_cases = [
        b"{",
        b"",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"weight": 1e999}',
        b'{"id": "\\ud800"}',
        b"1" * 5000,
    ]
    for raw in raw_cases:
        r = admin(c.url, "POST", "/backends", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw[:20], r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    big = admin(c.url, "POST", "/backends", content=b" " * (300 * 1024))
    assert big.status_code == 413
    assert sorted(c.gateway.registry.backends) == ["a"]


@pytest.mark.anyio
async def test_a_client_leaving_mid_body_is_dropped_quietly(caplog: pytest.LogCaptureFixture) -> None:
    """Starlette raises ClientDisconnect from ``request.stream()``; it must not reach the catch-all (whose
    middleware logs it with a traceback and re-raises it to the server)."""
    app = create_app(load_settings(None))
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/admin/backends",
        "raw_path": b"/admin/backends",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 8080),
    }
    messages = [{"type": "http.request", "body": b'{"id":', "more_body": True}, {"type": "http.disconnect"}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with caplog.at_level(logging.DEBUG):
        await app(scope, receive, send)  # raised ClientDisconnect before the fix
    assert "Traceback" not in caplog.text and "unexpected error" not in caplog.text
    assert [r.levelno for r in caplog.records if r.name.startswith("warmroute")] == [logging.DEBUG]


def test_a_request_routed_just_before_a_removal_still_finds_its_backend() -> None:
    from backends.registry import Registry
    from config.settings import BackendConfig

    registry = Registry([BackendConfig(id="a", url="http://127.0.0.1:1", models=("m",))])
    removed = registry.remove("a")
    assert (
        "a" not in registry.backends and registry.backends.get("a") is None and list(registry.backends) == []
    )
    lease = registry.lease("a")  # what the proxy does after the routing decision named "a"
    assert registry.backends["a"] is removed and removed.in_flight == 1
    lease.release()
    assert removed.in_flight == 0
    with pytest.raises(KeyError):
        registry.lease("never-known")


def test_removing_a_managed_backend_stops_its_process(cluster: ClusterFactory) -> None:
    c = cluster(["a"], admin={"allow_managed": True})
    engine = FakeEngine("e")
    with serve(engine.app()) as (url, _server):
        body = {"id": "e", "url": url, "models": ["m"], "managed": {"command": ["sleep", "600"]}}
        assert admin(c.url, "POST", "/backends", json=body).status_code == 201
        c.wait_for(lambda: _state(c, "e") == "ready", "managed e ready")
        pid = admin(c.url, "GET", "/backends/e").json()["managed"]["pid"]
        assert isinstance(pid, int) and os.path.exists(f"/proc/{pid}")
        assert admin(c.url, "DELETE", "/backends/e").status_code == 200
        until(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), what="engine process stopped")


def _state(c: Cluster, backend_id: str) -> str | None:
    """The state the admin API reports for a backend (read on the gateway's loop)."""
    backend = c.gateway.registry.backends.get(backend_id)
    return None if backend is None else backend.state.value


def _zombie(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return open(f"/proc/{pid}/stat").read().split(") ", 1)[1].startswith("Z")
    return True


def test_engine_signals_are_read_from_the_engines_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    # The admin reads the engine's /metrics within a 1 s bound; on a loaded machine the in-process engine can
    # take longer to answer, which is the bound working, not what this test is about.
    monkeypatch.setattr(admin_api, "SCRAPE_TIMEOUT_S", 60.0)
    sim = create_sim_app(SimConfig(models=("m",), time_scale=0.0))
    with serve(sim) as (url, _server):
        backends = [{"id": "s", "url": url, "models": ["m"]}]
        settings = load_settings(None, backends=backends, canary={"enabled": False})
        with serve(create_app(settings)) as (gw, _gw):
            assert chat(gw, "warm the cache").status_code == 200
            assert chat(gw, "warm the cache", turn=1).status_code == 200
            signals = admin(gw, "GET", "/backends/s").json()["engine_signals"]
            listed = admin(gw, "GET", "/backends").json()["backends"][0]["engine_signals"]
    assert set(signals) >= {"vllm:num_requests_running", "vllm:prefix_cache_queries_total"}
    assert signals["vllm:num_requests_running"] == 0.0
    assert 0 < signals["vllm:prefix_cache_hits_total"] < signals["vllm:prefix_cache_queries_total"]
    assert listed == signals
