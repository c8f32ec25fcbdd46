"""Conversation affinity through a real gateway: turns stick, sessions override, dead engines re-pin."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest

from clusters import ClusterFactory

SYS = {"role": "system", "content": "You are a coding agent."}


def turns(first: str, n: int) -> list[list[dict[str, str]]]:
    history = [SYS, {"role": "user", "content": first}]
    out = []
    for i in range(n):
        out.append(list(history))
        history += [{"role": "assistant", "content": f"answer {i}"}, {"role": "user", "content": f"next {i}"}]
    return out


def post(url: str, messages: list[dict[str, str]], **headers: str) -> httpx.Response:
    r = httpx.post(url + "/v1/chat/completions", json={"model": "m", "messages": messages}, headers=headers)
    assert r.status_code == 200, r.text
    return r


POLICIES = pytest.mark.parametrize("policy", ["ttft", "affinity"])


@POLICIES
def test_every_turn_of_a_conversation_lands_on_one_backend(cluster: ClusterFactory, policy: str) -> None:
    c = cluster(["a", "b", "c"], routing={"policy": policy})
    placements: dict[str, set[str]] = {}
    for conv in range(12):
        for msgs in turns(f"task {conv}", 5):
            r = post(c.url, msgs)
            placements.setdefault(f"task {conv}", set()).add(r.headers["x-warmroute-backend"])
    assert all(len(b) == 1 for b in placements.values())
    spread = Counter(next(iter(b)) for b in placements.values())
    assert sorted(spread.values()) == [4, 4, 4]  # new conversations balanced by conversation count


def test_round_robin_baseline_scatters_turns(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"], routing={"policy": "round_robin"})
    seen = {post(c.url, msgs).headers["x-warmroute-backend"] for msgs in turns("x", 4)}
    assert seen == {"a", "b"}


@POLICIES
def test_session_header_overrides_the_computed_key(cluster: ClusterFactory, policy: str) -> None:
    # Every request looks like a first turn (no assistant message): under ttft a session's pin is still its
    # own, not a twin's head.
    c = cluster(["a", "b", "c"], routing={"policy": policy})
    backends = {
        post(c.url, [{"role": "user", "content": f"unrelated {i}"}], **{"X-Session-ID": "s-42"}).headers[
            "x-warmroute-backend"
        ]
        for i in range(6)
    }
    assert len(backends) == 1


def test_conversations_on_a_dead_backend_repin_and_stay(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b", "c"])
    first = {f"t{i}": post(c.url, turns(f"t{i}", 1)[0]).headers["x-warmroute-backend"] for i in range(9)}
    victim = "a"
    orphans = [k for k, b in first.items() if b == victim]
    assert orphans
    c.engines[victim].healthy = False
    c.wait_for(lambda: c.gateway.registry.backends[victim].state.value == "down", f"{victim} down", 5)
    for k in orphans:
        msgs = turns(k, 3)
        r1 = post(c.url, msgs[1])
        assert r1.headers["x-warmroute-backend"] != victim
        assert r1.headers["x-warmroute-route"] == "repin_unhealthy"
        r2 = post(c.url, msgs[2])
        assert r2.headers["x-warmroute-backend"] == r1.headers["x-warmroute-backend"]
        assert r2.headers["x-warmroute-route"] == "affinity_hit"


@pytest.mark.parametrize(("policy", "new"), [("ttft", "new_cheapest"), ("affinity", "new_least_loaded")])
def test_decisions_are_counted_by_reason_on_metrics(cluster: ClusterFactory, policy: str, new: str) -> None:
    c = cluster(["a", "b"], routing={"policy": policy})
    for msgs in turns("m", 3):
        post(c.url, msgs)
    text = httpx.get(c.url + "/metrics").text
    assert f'warmroute_routing_decisions_total{{reason="{new}"}} 1.0' in text
    assert 'warmroute_routing_decisions_total{reason="affinity_hit"} 2.0' in text
    assert 'warmroute_backend_in_flight{backend="a"} 0.0' in text
