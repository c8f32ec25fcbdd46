"""Chat and completions through a real gateway in front of fake engines: relay, headers, accounting."""

from __future__ import annotations

import threading

import httpx

from clusters import ClusterFactory
from upstreams import FakeEngine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def test_non_streaming_chat_is_relayed_with_backend_header(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "a-0 a-1 a-2"
    assert r.headers["x-warmroute-backend"] == "a"
    assert r.headers["x-warmroute-route"] == "new_cheapest"  # the default policy (ttft)
    assert c.engines["a"].requests == [CHAT]
    c.wait_idle()


def test_streaming_chunks_arrive_before_upstream_finishes(cluster: ClusterFactory) -> None:
    gate = threading.Event()
    c = cluster(engines=[FakeEngine("a", gate=gate)])
    with httpx.stream("POST", c.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        first = next(line for line in lines if line)
        # The engine is still holding the rest of the stream: we got this chunk unbuffered.
        assert "a-0" in first
        assert c.in_flight() == 1
        gate.set()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert any("a-2" in line for line in rest)
    c.wait_idle()


def test_completions_endpoint_and_affinity_by_prompt_head(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"])
    head = "You are a careful assistant. " * 30
    seen = set()
    for turn in range(4):
        r = httpx.post(c.url + "/v1/completions", json={"model": "m", "prompt": head + "turn " * turn})
        assert r.status_code == 200
        seen.add(r.headers["x-warmroute-backend"])
    assert len(seen) == 1


def test_models_lists_union_once_per_name(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", models=("m", "x")), FakeEngine("b", models=("m", "y"))])
    r = httpx.get(c.url + "/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["m", "x", "y"]
    assert httpx.get(c.url + "/v1/models/x").json()["id"] == "x"
    assert httpx.get(c.url + "/v1/models/nope").status_code == 404


def test_other_v1_routes_go_to_a_backend_serving_the_model(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", models=("m",)), FakeEngine("b", models=("emb",))])
    r = httpx.post(c.url + "/v1/embeddings", json={"model": "emb", "input": "hi"})
    assert r.status_code == 200
    assert r.json()["served_by"] == "b"
    assert r.headers["x-warmroute-backend"] == "b"


def test_healthz_and_readyz(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    assert httpx.get(c.url + "/healthz").json() == {"status": "ok"}
    ready = httpx.get(c.url + "/readyz")
    assert ready.status_code == 200
    assert ready.json()["backends"]["a"]["state"] == "ready"
    assert ready.json()["shared_state"]["backend"] == "memory"
