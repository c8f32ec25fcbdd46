"""Quotas as an operator sees them: /admin/quotas, /metrics and the status page, on a gateway from
create_app (memory state)."""

from __future__ import annotations

import httpx
import pytest

from config.settings import ConfigError, load_settings
from gateway.app import create_app

from admin_helpers import chat, metric_lines
from clusters import ClusterFactory

KEYS = {"client_keys": [{"name": "alice", "key": "k-alice"}, {"name": "bob", "key": "k-bob"}]}
ALICE = {"authorization": "Bearer k-alice"}


def test_quotas_off_by_default_are_not_in_the_request_path(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    assert c.gateway.quotas is None
    assert all(type(m).__name__ != "Quotas" for m in c.gateway.proxy.phases.admission)
    assert "<h2>Quotas</h2>" not in httpx.get(c.url + "/admin/status").text
    assert httpx.get(c.url + "/admin/quotas").json() == {"enabled": False, "window_s": None, "keys": {}}


def test_a_keys_window_and_counts_are_on_the_admin_api_metrics_and_status_page(
    cluster: ClusterFactory,
) -> None:
    c = cluster(["a"], auth=KEYS, quotas={"keys": {"alice": {"requests_per_window": 2, "concurrent": 4}}})
    assert c.gateway.proxy.phases.admission[0] is c.gateway.quotas  # first: over quota, nothing waits
    codes = [chat(c.url, f"conv-{i}", headers=ALICE).status_code for i in range(3)]
    assert codes == [200, 200, 429]
    assert chat(c.url, "conv-bob", headers={"authorization": "Bearer k-bob"}).status_code == 200
    view = httpx.get(c.url + "/admin/quotas").json()
    alice = view["keys"]["alice"]
    assert (view["enabled"], view["window_s"], list(view["keys"])) == (True, 60.0, ["alice"])
    assert {k: alice[k] for k in ("requests_per_window", "tokens_per_window", "concurrent")} == {
        "requests_per_window": 2,
        "tokens_per_window": None,
        "concurrent": 4,
    }
    assert (alice["requests"], alice["in_flight"], alice["counts"]) == (2, 0, {"admitted": 2, "requests": 1})
    assert 0 < alice["reset_s"] <= 60
    assert alice["tokens"] > 0  # charged from the fake engine's usage
    assert sorted(metric_lines(c.url, "warmroute_quota_requests_total")) == [
        'warmroute_quota_requests_total{client="alice",outcome="admitted"} 2.0',
        'warmroute_quota_requests_total{client="alice",outcome="requests"} 1.0',
    ]
    assert metric_lines(c.url, "warmroute_quota_store_failures_total") == [
        "warmroute_quota_store_failures_total 0.0"
    ]
    page = httpx.get(c.url + "/admin/status").text
    assert "<h2>Quotas</h2>" in page and "<tr><td>alice</td><td>2</td><td>1</td><td>0</td></tr>" in page
    assert c.in_flight() == 0


def test_a_quota_for_a_key_name_nobody_has_refuses_to_start() -> None:
    settings = load_settings(
        None,
        backends=[{"id": "a", "url": "http://127.0.0.1:1", "models": ["m"]}],
        auth=KEYS,
        quotas={"keys": {"alcie": {"requests_per_window": 1}}},
    )
    with pytest.raises(ConfigError, match=r"quotas.keys: alcie: no client key of that name"):
        create_app(settings)
