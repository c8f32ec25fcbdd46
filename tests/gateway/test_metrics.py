"""/metrics read back after each kind of exchange: exact counts of attempts, requests and decisions."""

from __future__ import annotations

import threading

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import OnDemandMetrics

from clusters import Cluster, ClusterFactory
from upstreams import FakeEngine

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
RR = {"routing": {"policy": "round_robin"}}  # the first request goes to "a" (sorted ids)
Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(c: Cluster) -> Series:
    text = httpx.get(c.url + "/metrics").text
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def counts(c: Cluster, name: str) -> dict[tuple[str, ...], float]:
    """Non-zero samples of one counter, keyed by label values in label-name order."""
    return {
        tuple(v for _, v in labels): value for (n, labels), value in scrape(c).items() if n == name and value
    }


def attempts(c: Cluster) -> dict[tuple[str, ...], float]:
    return counts(c, "warmroute_upstream_attempts_total")


def requests(c: Cluster) -> dict[tuple[str, ...], float]:
    return counts(c, "warmroute_requests_total")


def decisions(c: Cluster) -> dict[tuple[str, ...], float]:
    return counts(c, "warmroute_routing_decisions_total")


def test_ok(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    assert httpx.post(c.url + "/v1/chat/completions", json=CHAT).status_code == 200
    c.wait_idle()
    assert attempts(c) == {("a", "ok"): 1}
    assert requests(c) == {("a", "ok"): 1}
    assert decisions(c) == {("new_cheapest",): 1}  # the default policy (ttft)
    assert scrape(c)[("warmroute_request_duration_seconds_count", (("backend", "a"),))] == 1


def test_5xx_retried_counts_two_attempts_and_one_request(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", fail_next=1), FakeEngine("b")], **RR)
    assert httpx.post(c.url + "/v1/chat/completions", json=CHAT).status_code == 200
    c.wait_idle()
    assert attempts(c) == {("a", "http_5xx"): 1, ("b", "ok"): 1}
    assert requests(c) == {("b", "ok"): 1}
    assert decisions(c) == {("round_robin",): 1, ("retry_next",): 1}


def test_5xx_relayed_counts_once(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", fail_next=1)])
    assert httpx.post(c.url + "/v1/chat/completions", json=CHAT).status_code == 500
    c.wait_idle()
    assert attempts(c) == {("a", "http_5xx"): 1}
    assert requests(c) == {("a", "http_5xx"): 1}


def test_connect_error_with_nobody_to_retry(cluster: ClusterFactory) -> None:
    c = cluster(["a"], health={"interval_s": 60})
    c.stop_engine("a")
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.json()["error"]["code"]) == (502, "upstream_error")
    c.wait_idle()
    assert attempts(c) == {("a", "connect_error"): 1}
    assert requests(c) == {("a", "upstream_error"): 1}
    # The connect error marked it down: the next request is refused without an attempt.
    r = httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    assert (r.status_code, r.json()["error"]["code"]) == (503, "no_healthy_backend")
    assert attempts(c) == {("a", "connect_error"): 1}
    assert requests(c) == {("a", "upstream_error"): 1, ("", "no_backend"): 1}


def test_client_disconnect(cluster: ClusterFactory) -> None:
    gate = threading.Event()
    c = cluster(engines=[FakeEngine("a", gate=gate)])
    with httpx.stream("POST", c.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        lines = r.iter_lines()
        next(line for line in lines if line)
    c.wait_idle()
    gate.set()
    assert attempts(c) == {("a", "ok"): 1}
    assert requests(c) == {("a", "client_disconnect"): 1}


def test_mid_stream_failure(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", chunks=5, die_after=2)])
    with httpx.stream("POST", c.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    c.wait_idle()
    assert attempts(c) == {("a", "ok"): 1}
    assert requests(c) == {("a", "mid_stream_error"): 1}


def test_engine_4xx_is_an_answer_not_a_failure(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", answer_status=400), FakeEngine("b")], **RR)
    assert httpx.post(c.url + "/v1/chat/completions", json=CHAT).status_code == 400
    c.wait_idle()
    assert attempts(c) == {("a", "ok"): 1}  # no retry: the engine judged the request
    assert requests(c) == {("a", "http_4xx"): 1}


def test_rejected_before_routing(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    assert httpx.post(c.url + "/v1/chat/completions", content=b"{nope").status_code == 400
    assert httpx.post(c.url + "/v1/chat/completions", json={**CHAT, "model": "zz"}).status_code == 404
    assert attempts(c) == {}
    assert requests(c) == {("", "rejected"): 2}
    assert c.engines["a"].requests == []


def test_latency_histograms_bucket_like_prometheus(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    for _ in range(3):
        httpx.post(c.url + "/v1/chat/completions", json=CHAT)
    c.wait_idle()
    series = scrape(c)
    a = (("backend", "a"),)
    assert series[("warmroute_request_duration_seconds_count", a)] == 3
    assert series[("warmroute_request_duration_seconds_bucket", (("backend", "a"), ("le", "+Inf")))] == 3
    buckets = [
        value
        for (name, labels), value in series.items()
        if name == "warmroute_request_duration_seconds_bucket" and dict(labels)["backend"] == "a"
    ]
    assert buckets == sorted(buckets) and len(buckets) == 16  # cumulative, 15 bounds and +Inf
    assert 0 < series[("warmroute_request_duration_seconds_sum", a)] < 3 * 5
    assert series[("warmroute_upstream_first_byte_seconds_count", a)] == 3
    # Every reason is exported, zero or not, so dashboards need no "absent()" guards.
    assert series[("warmroute_routing_decisions_total", (("reason", "spill_overload"),))] == 0


def test_on_demand_series_count_exactly_and_carry_no_creation_time() -> None:
    registry = CollectorRegistry()
    m = OnDemandMetrics(registry)
    m.started("a")
    m.started("a")
    m.ready("a", 1.0)  # on a bucket's bound: counted in it, as Prometheus does
    m.stopped("a", "swap", "gpu")
    m.stopped("a", "idle", None)
    m.eviction_refused("b")
    m.waited("ma", 700.0, "admitted")  # past the last bound: only in +Inf
    m.depth("ma", 3)
    m.depth("ma", 2)
    text = generate_latest(registry).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("warmroute_ondemand_starts_total", (("backend", "a"),))] == 2
    assert samples[("warmroute_ondemand_stops_total", (("backend", "a"), ("why", "swap")))] == 1
    assert samples[("warmroute_ondemand_stops_total", (("backend", "a"), ("why", "idle")))] == 1
    assert samples[("warmroute_ondemand_swaps_total", (("group", "gpu"),))] == 1
    assert samples[("warmroute_ondemand_evictions_refused_total", (("backend", "b"),))] == 1
    assert samples[("warmroute_ondemand_queue_depth", (("model", "ma"),))] == 2
    starting = (("backend", "a"),)
    assert samples[("warmroute_ondemand_starting_seconds_bucket", (*starting, ("le", "0.5")))] == 0
    assert samples[("warmroute_ondemand_starting_seconds_bucket", (*starting, ("le", "1.0")))] == 1
    assert samples[("warmroute_ondemand_starting_seconds_count", starting)] == 1
    wait = (("model", "ma"), ("outcome", "admitted"))
    assert samples[("warmroute_ondemand_wait_seconds_bucket", (("le", "600.0"), *wait))] == 0
    assert samples[("warmroute_ondemand_wait_seconds_bucket", (("le", "+Inf"), *wait))] == 1
    assert samples[("warmroute_ondemand_wait_seconds_sum", wait)] == 700.0
    assert "_created" not in text
