"""/admin/route/explain (a dry run), /admin/pins, /admin/affinity and /admin/openapi.json."""

from __future__ import annotations

from typing import Any

import httpx

from gateway.admin.explain import _candidate
from routing.keys import chat_key, session_key
from routing.types import BackendState, Candidate

from admin_helpers import chat, chat_body, metric_lines
from clusters import ClusterFactory


def explain(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/admin/route/explain", json=body, timeout=10)


def test_explain_computes_the_endpoints_key_and_commits_nothing(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"], routing={"policy": "affinity"})
    sample = chat_body("conv-x")
    decisions_before = metric_lines(c.url, "warmroute_routing_decisions_total")
    r = explain(c.url, {"body": sample})
    assert r.status_code == 200, r.text
    e = r.json()
    assert e["key"] == chat_key(sample) and e["model"] == "m" and e["policy"] == "affinity"
    assert (e["pinned"], e["reason"], e["pin_action"]) == (None, "new_least_loaded", "claim")
    assert e["backend"] in ("a", "b")
    assert sorted(cand["id"] for cand in e["candidates"]) == ["a", "b"]
    assert all(
        (cand["in_flight"], cand["conversations"], cand["routable"]) == (0, 0, True)
        for cand in e["candidates"]
    )
    # No side effects: no pin, no lease, no decision counted, nothing sent to an engine.
    assert httpx.get(f"{c.url}/admin/pins/{e['key']}").status_code == 404
    assert c.in_flight() == 0
    assert metric_lines(c.url, "warmroute_routing_decisions_total") == decisions_before
    assert sum(len(engine.requests) for engine in c.engines.values()) == 0
    # A real request for the same conversation is pinned; explain now says it would stay there.
    served = chat(c.url, "conv-x").headers["x-warmroute-backend"]
    later = explain(c.url, {"body": chat_body("conv-x", turn=3)}).json()
    assert (later["pinned"], later["backend"], later["reason"], later["pin_action"]) == (
        served,
        served,
        "affinity_hit",
        "touch",
    )
    by_key = explain(c.url, {"key": e["key"], "model": "m"}).json()
    assert (by_key["backend"], by_key["reason"]) == (served, "affinity_hit")
    assert next(cand for cand in by_key["candidates"] if cand["id"] == served)["conversations"] == 1


def test_explain_under_the_ttft_policy_lists_each_candidates_cost_and_commits_nothing(
    cluster: ClusterFactory,
) -> None:
    c = cluster(["a", "b"], routing={"policy": "ttft"})
    decisions_before = metric_lines(c.url, "warmroute_routing_decisions_total")
    e = explain(c.url, {"body": chat_body("conv-y")}).json()
    assert e["policy"] == "ttft" and e["reason"] == "new_cheapest" and e["backend"] in ("a", "b")
    assert sorted(cost["backend"] for cost in e["costs"]) == ["a", "b"]
    chosen = next(cost for cost in e["costs"] if cost["backend"] == e["backend"])
    assert chosen["total_s"] == min(cost["total_s"] for cost in e["costs"]) and chosen["uncached_tokens"] > 0
    assert e["why"][0].startswith(f"-> {e['backend']} (new_cheapest") and len(e["why"]) == 3
    assert httpx.get(f"{c.url}/admin/pins/{e['key']}").status_code == 404
    assert metric_lines(c.url, "warmroute_routing_decisions_total") == decisions_before
    assert c.in_flight() == 0 and sum(len(engine.requests) for engine in c.engines.values()) == 0


def test_explain_uses_the_session_header_and_the_completions_key(cluster: ClusterFactory) -> None:
    c = cluster(["a"], routing={"policy": "affinity"})
    r = explain(c.url, {"body": chat_body("q"), "headers": {"X-Session-Id": "s-1"}})
    assert r.json()["key"] == session_key("m", "s-1")
    r = explain(c.url, {"path": "/v1/completions", "body": {"model": "m", "prompt": "once upon"}})
    assert r.status_code == 200 and r.json()["reason"] == "new_least_loaded"


def test_explain_refuses_what_the_endpoint_refuses(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    cases: list[tuple[dict[str, Any], int, str | None]] = [
        ({"body": {"model": "m"}}, 400, "messages"),
        ({"body": {"model": "m", "messages": []}}, 400, "messages"),
        ({}, 400, "key"),
        ({"key": "k", "body": chat_body("x")}, 400, "key"),
        ({"key": ""}, 422, "key"),
        ({"path": "/v1/embeddings", "key": "k"}, 422, "path"),
        ({"key": "k", "extra": True}, 422, "extra"),
        ({"body": chat_body("x"), "headers": {"x-session-id": 5}}, 422, "headers.x-session-id"),
    ]
    for body, status, param in cases:
        r = explain(c.url, body)
        assert (r.status_code, r.json()["error"]["param"]) == (status, param), (body, r.text)
    unknown = explain(c.url, {"key": "nobody-has-this", "model": "other"}).json()
    assert (unknown["backend"], unknown["reason"], unknown["candidates"]) == (None, "no_backend", [])


def test_pin_lookup_and_forget(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"], routing={"policy": "affinity"})
    served = chat(c.url, "conv-p").headers["x-warmroute-backend"]
    key = chat_key(chat_body("conv-p"))
    r = httpx.get(f"{c.url}/admin/pins/{key}")
    assert r.status_code == 200
    pin = r.json()
    assert (pin["key"], pin["backend"], pin["backend_configured"]) == (key, served, True)
    assert 3590 < pin["expires_in_s"] <= 3600  # just used: affinity_ttl_s (tests/admin/test_pins.py: exact)
    gone = httpx.delete(f"{c.url}/admin/pins/{key}")
    assert gone.status_code == 200 and gone.json() == {"key": key, "backend": served}
    assert httpx.get(f"{c.url}/admin/pins/{key}").status_code == 404
    assert httpx.delete(f"{c.url}/admin/pins/{key}").status_code == 404
    assert c.gateway.store.status()["entries"] == 0
    assert chat(c.url, "conv-p", turn=1).headers["x-warmroute-route"] == "new_least_loaded"


def test_affinity_statistics(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"], routing={"policy": "affinity"})
    for turn in range(3):
        chat(c.url, "conv-s", turn=turn)
    chat(c.url, "conv-t")
    stats = httpx.get(c.url + "/admin/affinity").json()
    assert (stats["store"], stats["degraded"], stats["pins"]) == ("memory", False, 2)
    assert sum(stats["per_backend"].values()) == 2
    assert (stats["decisions"]["affinity_hit"], stats["decisions"]["new_least_loaded"]) == (2, 2)
    assert stats["hit_rate"] == 0.5


def test_openapi_document_lists_every_admin_route(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    doc = httpx.get(c.url + "/admin/openapi.json").json()
    assert doc["openapi"] == "3.1.0"
    listed = {(method.upper(), path) for path, item in doc["paths"].items() for method in item}
    assert listed == {(op.method, op.openapi_path) for op in c.gateway.admin.operations}  # type: ignore[union-attr]
    assert (
        len(listed) == 20
    )  # 15, the on-demand hold and its release, the changes long poll, admission, quotas
    params = doc["paths"]["/admin/changes"]["get"]["parameters"]
    assert [(p["name"], p["in"], p["required"]) for p in params] == [
        ("since", "query", False),
        ("wait_s", "query", False),
    ]
    assert params[1]["schema"]["maximum"] == 30.0
    add = doc["paths"]["/admin/backends"]["post"]
    assert add["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/BackendConfig"
    }
    assert {"201", "401", "403", "409", "422"} <= set(add["responses"])
    assert "weight" in doc["components"]["schemas"]["BackendPatch"]["properties"]


def test_explain_lists_every_routing_signal_beside_the_core_fields() -> None:
    view = _candidate(Candidate("a", BackendState.READY, 1, 3, 2.0, 800, 4000.0, 2, 0.75, 16_000))
    assert (view.id, view.in_flight, view.conversations, view.weight, view.load) == ("a", 1, 3, 2.0, 2.0)
    assert view.signals == {
        "prefilling": 800,
        "prefill_tps": 4000.0,
        "waiting": 2,
        "retention": 0.75,
        "kv_capacity": 16_000,
        "placed_at": None,  # never given a new conversation (-inf): null, not a number JSON lacks
        "competing": -1,
    }
    placed = _candidate(Candidate("a", BackendState.READY, 1, 3, 2.0, 800, 4000.0, 2, 0.75, 16_000, 12.5))
    assert placed.signals["placed_at"] == 12.5
