"""/admin/status: escaped, complete, refreshing; rendered in headless Chromium without console errors."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from cdp import chromium, chromium_binary
from obs_engines import CHAT

from gateway.metrics import LifecycleNote
from gateway.status_page import CSP, REFRESH_S, BackendRow, StatusData, render

from clusters import Cluster, ClusterFactory
from upstreams import FakeEngine

HOSTILE = "<script>alert(1)</script>"
#: A canary answer that fails the consistency check (one token repeated) and puts markup into the reason.
HOSTILE_CANARY = " ".join([HOSTILE] * 4)


def row(**overrides: object) -> BackendRow:
    fields: dict[str, object] = {
        "id": "a",
        "state": "ready",
        "reason": "canary passed",
        "models": ("m",),
        "weight": 1.0,
        "in_flight": 2,
        "conversations": 3,
        "circuit": "closed",
        "canary": "passed",
        "restarts": "",
    }
    return BackendRow(**{**fields, **overrides})  # type: ignore[arg-type]


def data(*rows: BackendRow, notes: tuple[LifecycleNote, ...] = ()) -> StatusData:
    return StatusData(
        rows, 8, 0.75, {"affinity_hit": 3, "new_least_loaded": 1}, 4, "memory", False, notes, 0.0
    )


def test_render_escapes_everything_from_config_and_engines() -> None:
    note = LifecycleNote(0.0, "b", "canary_failed", "consistency", f"answered {HOSTILE}")
    html = render(data(row(), row(id="b", state="down", reason=f"canary failed: {HOSTILE}"), notes=(note,)))
    assert "<script" not in html
    assert html.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 2  # the reason and the note's detail
    assert f'<meta http-equiv="refresh" content="{REFRESH_S}">' in html


def test_render_load_bar_and_hit_rate() -> None:
    html = render(data(row(in_flight=2), row(id="b", in_flight=8)))
    assert '<span style="width:25%"></span>' in html and '<span style="width:100%"></span>' in html
    assert "<b>75%</b>affinity hit rate" in html
    assert "<b>1/2</b>backends ready" not in html and "<b>2/2</b>backends ready" in html


def test_status_page_served_with_backends_states_and_hit_rate(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"], routing={"policy": "affinity"})  # under ttft the repeats would be twins
    for _ in range(4):  # one conversation: new, then three hits
        assert httpx.post(c.url + "/v1/chat/completions", json=CHAT).status_code == 200
    c.wait_idle()
    r = httpx.get(c.url + "/admin/status")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["content-security-policy"] == CSP and r.headers["cache-control"] == "no-store"
    for backend in ("a", "b"):
        assert f'data-backend="{backend}" data-state="ready"' in r.text
    assert "<b>75%</b>affinity hit rate" in r.text and "<b>4</b>requests" in r.text


def test_engine_text_on_the_live_page_is_escaped(cluster: ClusterFactory) -> None:
    c = hostile_cluster(cluster)
    page = httpx.get(c.url + "/admin/status").text
    assert "<script" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert 'data-backend="b" data-state="down"' in page
    assert "canary failed" in page and "consistency" in page  # the notes table lists the failure


def hostile_cluster(cluster: ClusterFactory, a: FakeEngine | None = None) -> Cluster:
    """Backend a serves; b's canary answer fails the consistency check and puts markup into its reason."""
    b = FakeEngine("b", canary_answer=HOSTILE_CANARY)
    # Affinity: the traffic below repeats one first turn, which under ttft is a twin each time, not a hit.
    c = cluster(engines=[a or FakeEngine("a"), b], canary={"retry_s": 60}, routing={"policy": "affinity"})
    deadline = time.monotonic() + 10
    while c.gateway.fleet.controllers["b"].last_canary is None:
        assert time.monotonic() < deadline, "b's canary never ran"
        time.sleep(0.02)
    return c


def artifacts() -> Path:
    out = Path(os.environ.get("WARMROUTE_ARTIFACTS") or Path(__file__).resolve().parents[2] / ".artifacts")
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.mark.needs("chromium")
def test_status_page_in_headless_chromium(cluster: ClusterFactory, tmp_path: Path) -> None:
    chromium_binary()  # skip (or fail under $WARMROUTE_REQUIRE_CHROMIUM=1) before starting anything
    gate = threading.Event()
    c = hostile_cluster(cluster, FakeEngine("a", gate=gate))
    for i in range(3):
        body = {**CHAT, "messages": [{"role": "user", "content": f"conversation {i % 2}"}]}
        assert httpx.post(c.url + "/v1/chat/completions", json=body).status_code == 200
    c.wait_idle()
    held = {**CHAT, "messages": [{"role": "user", "content": "conversation 1"}], "stream": True}
    with chromium(tmp_path / "profile") as page:
        with httpx.stream("POST", c.url + "/v1/chat/completions", json=held) as r:
            lines = r.iter_lines()  # kept: a collected iterator would close the response
            next(line for line in lines if line)  # in flight until the gate opens
            page.open(c.url + "/admin/status")
            rows = page.evaluate(
                "Array.from(document.querySelectorAll('tr.backend'))"
                ".map(r => [r.dataset.backend, r.querySelector('.state').textContent, r.innerText])"
            )
            page.screenshot(artifacts() / "status-page.png")
            gate.set()
        assert [r[:2] for r in rows] == [["a", "ready"], ["b", "down"]]
        assert "1 of 8" in rows[0][2]  # the held stream
        assert HOSTILE in rows[1][2]  # shown as text, not run: the page holds no script element at all
        assert page.evaluate("document.scripts.length") == 0
        assert page.evaluate("document.getElementById('t-hit').innerText") == "50%\naffinity hit rate"
        # It refreshes itself and shows what happened meanwhile.
        c.wait_idle()
        seen = len(page.events)
        page.wait_event("Page.loadEventFired", seen)
        assert page.evaluate("document.getElementById('t-requests').innerText") == "4\nrequests"
        assert page.errors() == []
        # The harness does see errors (so the empty list above means something).
        page.open("data:text/html,<script>console.error('boom')</script><img src='http://127.0.0.1:9/x.png'>")
        errors = page.errors()
        assert any("boom" in e for e in errors) and any("x.png" in e for e in errors), errors
