"""config/grafana and config/prometheus.yml refer only to series a live gateway exports.

The live gateway has every optional family on: besides two fake engines it has one on-demand backend (never
started: its command is not run without a request for its model), so the ``warmroute_ondemand_*`` series,
which exist only when a backend is on demand, are on its /metrics too.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import yaml
from obs_engines import CHAT, UsageEngine
from prometheus_client.parser import text_string_to_metric_families

from config.settings import load_settings
from gateway.app import Gateway, create_app

from upstreams import FAST_HEALTH, FakeEngine, serve

CONFIG = Path(__file__).resolve().parents[2] / "config"
DASHBOARDS = sorted((CONFIG / "grafana" / "dashboards").glob("*.json"))
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "and",
    "or",
    "unless",
    "bool",
    "offset",
}


def expressions(dashboard: dict[str, Any]) -> list[str]:
    """Every target expression of every panel, rows' nested panels included."""
    out: list[str] = []
    for panel in dashboard.get("panels", []):
        out += [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
        out += expressions(panel)  # a collapsed row keeps its panels inside
    return out


def metric_names(expr: str) -> set[str]:
    """The series an expression reads: identifiers that are not functions, keywords, labels or durations."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values and strings
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges: [5m], [$__rate_interval]
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w$.])([A-Za-z_:][\w:]*)\b(\s*\()?", text):
        name, call = m.group(1), m.group(2)
        if call or name in _KEYWORDS:
            continue
        names.add(name)
    return names


def exported(text: str) -> set[str]:
    """Sample names a scrape can hold: each family with its type's suffixes."""
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names.update(family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",)))
        names.update(s.name for s in family.samples)
    return names


def test_metric_name_extraction() -> None:
    expr = (
        "histogram_quantile(0.95, sum by (le, model) (rate(warmroute_time_to_first_token_seconds_bucket"
        '{backend=~"a|b", reason!="x y"}[$__rate_interval]))) / on(backend) group_left max(up) or vector(0)'
    )
    assert metric_names(expr) == {"warmroute_time_to_first_token_seconds_bucket", "up"}


def test_dashboards_are_grafana_json_with_a_datasource_variable() -> None:
    assert DASHBOARDS, "no dashboard under config/grafana/dashboards"
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] and board["title"]
        assert [v["name"] for v in board["templating"]["list"] if v["type"] == "datasource"] == ["datasource"]
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids))
        assert len(expressions(board)) >= 20


def test_provisioning_points_at_the_dashboards_and_a_prometheus_datasource() -> None:
    ds = yaml.safe_load((CONFIG / "grafana" / "provisioning" / "datasources" / "warmroute.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus"
    board = json.loads(DASHBOARDS[0].read_text())
    (variable,) = board["templating"]["list"]
    assert variable["current"]["value"] == source["uid"]
    dash = yaml.safe_load((CONFIG / "grafana" / "provisioning" / "dashboards" / "warmroute.yml").read_text())
    assert dash["providers"][0]["type"] == "file"


def test_prometheus_config_scrapes_the_gateway_metrics_path() -> None:
    cfg = yaml.safe_load((CONFIG / "prometheus.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8080"]  # ServerConfig's default port


@contextlib.contextmanager
def gateway_with_on_demand() -> Iterator[tuple[str, Gateway]]:
    """A gateway in front of a usage-reporting engine and a plain one, plus one on-demand engine."""
    with contextlib.ExitStack() as stack:
        backends: list[dict[str, Any]] = []
        for engine in (UsageEngine("a"), FakeEngine("b")):
            url, _ = stack.enter_context(serve(engine.app()))
            backends.append({"id": engine.name, "url": url, "models": list(engine.models)})
        managed = {"command": ["true"], "on_demand": True, "idle_ttl_s": 60, "group": "gpu0"}
        backends.append({"id": "od", "url": "http://127.0.0.1:9", "models": ["od"], "managed": managed})
        settings = load_settings(
            None,
            backends=backends,
            groups={"gpu0": {}},
            routing={"policy": "round_robin"},
            health=FAST_HEALTH,
        )
        app = create_app(settings)
        url, _ = stack.enter_context(serve(app))
        yield url, app.state.gateway


def test_every_panel_expression_reads_only_series_the_gateway_exports() -> None:
    with gateway_with_on_demand() as (url, gateway):
        for i in range(4):  # traffic of every kind: plain and streamed, with and without cached tokens
            body = {**CHAT, "messages": [{"role": "user", "content": f"q{i}"}], "stream": i % 2 == 1}
            assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 200
        wait_idle(gateway)
        text = httpx.get(url + "/metrics").text
    assert "warmroute_ondemand_starts_total" in text  # declared, no sample: no start was asked for
    live = exported(text)
    used: set[str] = set()
    for path in DASHBOARDS:
        for expr in expressions(json.loads(path.read_text())):
            names = metric_names(expr)
            assert names, f"no series in {expr!r}"
            missing = names - live
            assert not missing, f"{path.name}: {expr!r} reads {sorted(missing)}, not exported"
            used |= names
    # The dashboard shows what issue #11 asked for, and the on-demand row: each family is on some panel.
    for family in (
        "warmroute_requests_total",
        "warmroute_routed_requests_total",
        "warmroute_upstream_attempts_total",
        "warmroute_request_duration_seconds_bucket",
        "warmroute_time_to_first_token_seconds_bucket",
        "warmroute_prompt_tokens_total",
        "warmroute_completion_tokens_total",
        "warmroute_cached_prompt_tokens_total",
        "warmroute_backend_in_flight",
        "warmroute_backend_conversations",
        "warmroute_routing_decisions_total",
        "warmroute_backend_state",
        "warmroute_canary_runs_total",
        "warmroute_backend_restarts_total",
        "warmroute_finish_reasons_total",
        "warmroute_ondemand_starts_total",
        "warmroute_ondemand_stops_total",
        "warmroute_ondemand_swaps_total",
        "warmroute_ondemand_queue_depth",
        "warmroute_ondemand_wait_seconds_bucket",
        "warmroute_ondemand_starting_seconds_bucket",
    ):
        assert family in used, family


def wait_idle(gateway: Gateway, timeout: float = 5.0) -> None:
    """Until the last streamed answer has been accounted (its finish runs after the client's last byte)."""
    deadline = time.monotonic() + timeout
    while gateway.registry.total_in_flight():
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.01)
