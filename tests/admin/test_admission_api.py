"""Admission as an operator sees it: /admin/admission and /metrics, on a gateway wired by create_app."""

from __future__ import annotations

import httpx

from admin_helpers import chat, metric_lines
from clusters import ClusterFactory

KEYS = {"client_keys": [{"name": "alice", "key": "k-alice"}, {"name": "cron", "key": "k-cron"}]}


def test_admission_off_by_default_is_not_in_the_request_path(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    assert c.gateway.admission is None and c.gateway.proxy.phases.seating == ()
    assert "<h2>Admission</h2>" not in httpx.get(c.url + "/admin/status").text
    assert httpx.get(c.url + "/admin/admission").json() == {
        "enabled": False,
        "classes": {},
        "backends": {},
        "clients": {},
    }


def test_admitted_requests_are_counted_per_key_name_and_every_slot_returns(cluster: ClusterFactory) -> None:
    c = cluster(
        ["a"],
        auth=KEYS,
        admission={"enabled": True, "max_in_flight": 3, "clients": {"alice": "interactive", "cron": "batch"}},
    )
    assert c.gateway.proxy.phases.seating == (c.gateway.admission,)
    for key, n in (("k-alice", 2), ("k-cron", 1)):
        for i in range(n):
            r = chat(c.url, f"conv-{key}-{i}", headers={"authorization": f"Bearer {key}"})
            assert r.status_code == 200, r.text
    view = httpx.get(c.url + "/admin/admission").json()
    assert view["enabled"] is True
    assert list(view["classes"]) == ["interactive", "standard", "batch"]
    assert {name: cls["waiting"] for name, cls in view["classes"].items()} == {
        "interactive": 0,
        "standard": 0,
        "batch": 0,
    }
    assert view["backends"] == {"a": {"running": 0, "capacity": 3}}
    assert view["clients"] == {"alice": {"admitted": 2}, "cron": {"admitted": 1}}
    counted = metric_lines(c.url, "warmroute_admission_requests_total")
    assert sorted(counted) == [
        'warmroute_admission_requests_total{client="alice",outcome="admitted"} 2.0',
        'warmroute_admission_requests_total{client="cron",outcome="admitted"} 1.0',
    ]
    assert metric_lines(c.url, "warmroute_admission_in_flight") == [
        'warmroute_admission_in_flight{backend="a"} 0.0'
    ]
    assert c.in_flight() == 0
    page = httpx.get(c.url + "/admin/status").text
    assert "<h2>Admission</h2>" in page
    assert "<tr><td>alice</td><td>2</td><td>0</td></tr><tr><td>cron</td><td>1</td><td>0</td></tr>" in page
    assert "<tr><td>interactive</td><td>0</td></tr>" in page
