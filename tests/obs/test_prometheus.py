"""A real Prometheus (Debian ``prometheus``) scrapes a real gateway while traffic flows; its HTTP API must
show the ``warmroute_`` series with exact values. Skipped without the binary unless
$WARMROUTE_REQUIRE_PROMETHEUS=1 (CI), then it fails."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from obs_engines import CHAT, PROMPT_TOKENS, UsageEngine

from tools.procs import child, free_port, wait_http

from clusters import Cluster, ClusterFactory

pytestmark = pytest.mark.needs("prometheus")

REQUIRE_ENV = "WARMROUTE_REQUIRE_PROMETHEUS"
SCRAPE = "250ms"
CONFIG = Path(__file__).resolve().parents[2] / "config" / "prometheus.yml"


def binary(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        message = f"{name} not found on PATH (apt-get install prometheus)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message} ({REQUIRE_ENV}=1)")
        pytest.skip(message)
    return found


@contextlib.contextmanager
def prometheus(tmp: Path, target: str) -> Iterator[str]:
    """Prometheus on 127.0.0.1, scraping ``target`` every 250 ms, storage in ``tmp``; yields its URL."""
    config = {
        "global": {"scrape_interval": SCRAPE, "evaluation_interval": SCRAPE},
        "scrape_configs": [{"job_name": "warmroute", "static_configs": [{"targets": [target]}]}],
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    argv = [
        binary("prometheus"),
        f"--config.file={tmp / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    log = (tmp / "prometheus.log").open("wb")
    with log, child(argv, stdout=log, stderr=subprocess.STDOUT) as process:
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/-/ready", lambda r: r.status_code == 200, timeout_s=30, process=process)
        yield url


def query(prom: str, expr: str) -> dict[tuple[tuple[str, str], ...], float]:
    """An instant query's vector, keyed by sorted labels (``__name__``, ``job`` and ``instance`` dropped)."""
    r = httpx.get(prom + "/api/v1/query", params={"query": expr})
    body: dict[str, Any] = r.json()
    assert body["status"] == "success", body
    out = {}
    for item in body["data"]["result"]:
        labels = {k: v for k, v in item["metric"].items() if k not in ("job", "instance", "__name__")}
        out[tuple(sorted(labels.items()))] = float(item["value"][1])
    return out


def scalar(prom: str, expr: str) -> float | None:
    result = query(prom, expr)
    return next(iter(result.values())) if result else None


def wait_value(prom: str, expr: str, expected: float, timeout: float = 20.0) -> None:
    """Poll until Prometheus's latest scrape shows ``expected`` (an external process: no event to wait on)."""
    deadline = time.monotonic() + timeout
    seen = None
    while time.monotonic() < deadline:
        seen = scalar(prom, expr)
        if seen == expected:
            return
        time.sleep(0.1)
    pytest.fail(f"{expr} = {seen}, expected {expected}")


def last_scrape(prom: str) -> str:
    """When the gateway target's latest finished scrape started (set once that scrape is done)."""
    targets = httpx.get(prom + "/api/v1/targets").json()["data"]["activeTargets"]
    assert len(targets) == 1, targets
    return str(targets[0]["lastScrape"])


def wait_next_scrape(prom: str, timeout: float = 20.0) -> None:
    """Poll until Prometheus has finished a scrape that started after this call's first look."""
    before = last_scrape(prom)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if last_scrape(prom) != before:
            return
        time.sleep(0.05)
    pytest.fail(f"no scrape finished after {before} within {timeout} s")


def hold(prom: str, expr: str, expected: float) -> None:
    """``expr`` is ``expected`` in at least two consecutive scrapes (~500 ms apart), so a subquery with a
    step of one scrape interval sees it whatever the scrapes' jitter against the subquery's steps."""
    wait_value(prom, expr, expected)
    wait_next_scrape(prom)
    assert scalar(prom, expr) == expected


def traffic(c: Cluster, conversation: str, turns: int, streamed: int) -> None:
    """``turns`` plain requests of one conversation, then ``streamed`` new conversations, streamed."""
    for _ in range(turns):
        body = {**CHAT, "messages": [{"role": "user", "content": conversation}]}
        assert httpx.post(c.url + "/v1/chat/completions", json=body).status_code == 200
    for i in range(streamed):
        body = {**CHAT, "messages": [{"role": "user", "content": f"{conversation} s{i}"}], "stream": True}
        with httpx.stream("POST", c.url + "/v1/chat/completions", json=body) as r:
            assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    c.wait_idle()


def test_promtool_accepts_the_shipped_config() -> None:
    result = subprocess.run(
        [binary("promtool"), "check", "config", str(CONFIG)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_scrapes_exact_counts_while_traffic_flows(cluster: ClusterFactory, tmp_path: Path) -> None:
    binary("prometheus")
    # Affinity: under ttft the repeated first turns below would be twins (each a new conversation).
    c = cluster(engines=[UsageEngine("a"), UsageEngine("b")], routing={"policy": "affinity"})
    with prometheus(tmp_path, c.url.removeprefix("http://")) as prom:
        wait_value(prom, 'up{job="warmroute"}', 1.0)
        total = "sum(warmroute_requests_total)"
        # Three batches, each held by Prometheus for two scrapes before the next starts: it records 4, 6
        # and 10 in that order at any speed (a slower machine may add values in between).
        traffic(c, "first", turns=4, streamed=0)
        hold(prom, total, 4.0)
        traffic(c, "first", turns=0, streamed=2)
        hold(prom, total, 6.0)
        traffic(c, "second", turns=3, streamed=1)
        hold(prom, total, 10.0)
        assert query(prom, "sum by (outcome) (warmroute_requests_total)") == {(("outcome", "ok"),): 10.0}
        decisions = query(prom, "warmroute_routing_decisions_total > 0")
        # Two multi-turn conversations (first turn new, the rest hits) and three streamed new ones.
        assert decisions == {(("reason", "new_least_loaded"),): 5.0, (("reason", "affinity_hit"),): 5.0}
        routed = query(prom, "sum by (model, reason) (warmroute_routed_requests_total)")
        assert routed == {
            (("model", "m"), ("reason", "new_least_loaded")): 5.0,
            (("model", "m"), ("reason", "affinity_hit")): 5.0,
        }
        assert scalar(prom, "sum(warmroute_time_to_first_token_seconds_count)") == 3.0
        assert scalar(prom, "sum(warmroute_prompt_tokens_total)") == 10.0 * PROMPT_TOKENS
        assert scalar(prom, "sum(warmroute_backend_conversations)") == 5.0
        ready = query(prom, 'warmroute_backend_state{state="ready"}')
        assert ready == {
            (("backend", "a"), ("state", "ready")): 1.0,
            (("backend", "b"), ("state", "ready")): 1.0,
        }
        canaries = query(prom, "warmroute_canary_runs_total")
        assert canaries == {(("backend", b), ("check", "all"), ("result", "pass")): 1.0 for b in ("a", "b")}
        # The counter went up between scrapes (it was scraped while traffic flowed: 4 -> 6 -> 10 at least),
        # and no _created noise.
        assert (scalar(prom, f"changes({total}[5m:{SCRAPE}])") or 0) >= 2
        assert query(prom, 'count({__name__=~"warmroute_.*_created"})') == {}
