"""``/readyz``: the detail goes to loopback peers by default, and only to admin-token holders with
``admin.protect_readyz_detail`` (behind a reverse proxy on the same host, every client is a loopback peer)."""

from __future__ import annotations

from typing import Any

import httpx

from clusters import Cluster, ClusterFactory

TOKEN = "s3cret-admin-token"
SHORT = {"a": {"state": "ready", "reason": "canary passed"}}
DETAIL_KEYS = {"state", "reason", "circuit", "routable"}  # some of the lifecycle's full status


def backends(c: Cluster, token: str | None = None, extra: dict[str, str] | None = None) -> dict[str, Any]:
    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    headers.update(extra or {})
    r = httpx.get(c.url + "/readyz", headers=headers, timeout=5)  # from 127.0.0.1: a loopback peer
    assert r.status_code == 200
    found: dict[str, Any] = r.json()["backends"]
    return found


def test_by_default_a_loopback_peer_gets_the_detail(cluster: ClusterFactory) -> None:
    c = cluster(["a"], admin={"token": TOKEN})
    assert set(backends(c)["a"]) >= DETAIL_KEYS


def test_a_loopback_peer_forwarding_for_someone_else_gets_the_short_form(cluster: ClusterFactory) -> None:
    c = cluster(["a"])  # a reverse proxy on the same host is a loopback peer
    for name, value in [
        ("x-forwarded-for", "203.0.113.7"),
        ("forwarded", "for=203.0.113.7"),
        ("x-real-ip", "203.0.113.7"),
    ]:
        assert backends(c, extra={name: value}) == SHORT, name


def test_protected_detail_needs_the_admin_token_even_on_loopback(cluster: ClusterFactory) -> None:
    c = cluster(["a"], admin={"token": TOKEN, "protect_readyz_detail": True})
    assert backends(c) == SHORT
    assert backends(c, "wrong") == SHORT  # a probe never fails on a token: it gets the short form
    detail = backends(c, TOKEN)["a"]
    assert set(detail) >= DETAIL_KEYS and detail["state"] == "ready"
