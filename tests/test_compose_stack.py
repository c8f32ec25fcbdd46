"""The "sim" profile of docker-compose.yml, run as local processes: no Docker engine runs here.

Each service is started with the command, environment and config files the compose file gives it (the
gateway image's ENTRYPOINT read from the Dockerfile). The only changes are addresses: a compose host name
becomes 127.0.0.1 and each container port a free local port, in the argv and inside the mounted config
files (two containers may both listen on 8000; two local processes may not). Services start in
``depends_on`` order, each waiting for what its health check asks.

Then one conversation crosses both gateway replicas and stays on one engine (the engines' own request
counts say which answered); through the balancer (when haproxy is installed) both replicas take traffic;
the Grafana dashboard names only series that the running gateway and engines export; and the admin plane
works as the README's operator's guide says: client keys and the admin token from .env.example, /admin only
on each replica's admin port, a drain on one replica seen by the other through Redis.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import OnDemandMetrics
from tools import procs
from tools.redis_server import find_binary

from compose_model import (
    COMPOSE_DIR,
    ENV_EXAMPLE,
    GATEWAY_CONFIG,
    ROOT,
    bind_mounts,
    compose,
    entrypoint,
    hostnames,
    listen_port,
    read_env_file,
    services,
)

PROFILE = "sim"
LOCALHOST = procs.LOCALHOST
#: Services of the profile this test does not start, and why (a new service must be added to one side).
NOT_STARTED = {
    "prometheus": "not a Python process; its config is checked in test_compose.py",
    "grafana": "not a Python process; its dashboard is checked against live /metrics below",
}
#: The default command of images whose compose service gives none.
IMAGE_COMMANDS = {"haproxy": ["haproxy", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]}
START_TIMEOUT_S = 60.0  # several Python processes importing at once on a busy 2-core machine
MODEL = "qwen-vl"
VENV_ENV = "COMPOSE_STACK_VENV"


@dataclass
class Running:
    name: str
    ports: dict[int, int]  # container port -> local port
    process: subprocess.Popen[bytes]
    log: Path

    def url(self, container_port: int | None = None) -> str:
        port = self.ports[container_port] if container_port else next(iter(self.ports.values()))
        return f"http://{LOCALHOST}:{port}"

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])


def container_ports(name: str, service: dict[str, Any]) -> list[int]:
    if name == "lb":  # HAProxy: the ports its config binds
        text = (COMPOSE_DIR / "haproxy.cfg").read_text()
        return [int(p) for p in re.findall(r"^\s*bind :(\d+)$", text, re.M)]
    if GATEWAY_CONFIG in bind_mounts(service):  # the API port first, then the admin listener
        config = yaml.safe_load(bind_mounts(service)[GATEWAY_CONFIG].read_text())
        return [config["server"]["port"], config["admin"]["port"]]
    return [listen_port(name, service)]


def localize(text: str, addresses: dict[tuple[str, int], int]) -> str:
    """``host:port`` of a compose service (its name or an alias) -> ``127.0.0.1:local``."""
    for (host, port), local in addresses.items():
        text = re.sub(rf"(?<![\w.-]){re.escape(host)}:{port}\b", f"{LOCALHOST}:{local}", text)
    return text


def warmroute() -> str:
    """The ``warmroute`` console script the image's ENTRYPOINT runs: this venv's, or the one of the venv in
    $COMPOSE_STACK_VENV (e.g. one built as the Dockerfile builds /opt/venv, to run this test against it)."""
    venv = os.environ.get(VENV_ENV)
    script = Path(venv) / "bin" / "warmroute" if venv else Path(sys.executable).parent / "warmroute"
    assert script.exists(), f"no console script {script}"
    return str(script)


def local_argv(argv: list[str], ports: dict[int, int], files: dict[str, Path]) -> list[str]:
    """The container's argv for this machine: our executables, loopback, local ports and files."""
    out = [str(a) for a in argv]
    executables = {"warmroute": [warmroute()], "redis-server": [find_binary() or ""]}
    executables["haproxy"] = [shutil.which("haproxy") or ""]
    out = [*executables.get(out[0], [out[0]]), *out[1:]]
    for i, arg in enumerate(out[:-1]):
        if arg == "--host":
            out[i + 1] = LOCALHOST
        elif arg == "--port":
            out[i + 1] = str(ports[int(out[i + 1])])
    return [str(files.get(a, a)) for a in out]


class Stack:
    """The profile's services as processes; ``close`` stops them in reverse start order."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.model = compose()
        self.services = services(self.model, PROFILE)
        self.built = {
            s["image"]: ROOT / s["build"]["dockerfile"] for s in services(self.model).values() if "build" in s
        }
        self.running: dict[str, Running] = {}
        started = {n for n in self.services if n not in NOT_STARTED}
        if shutil.which("haproxy") is None:
            started.discard("lb")
        self.started = started
        self.local_ports = {
            n: {p: procs.free_port() for p in container_ports(n, self.services[n])} for n in started
        }
        self.addresses = {
            (host, cport): local
            for n in started
            for host in hostnames(n, self.services[n])
            for cport, local in self.local_ports[n].items()
        }

    def start(self) -> None:
        waves: list[list[str]] = []
        placed: set[str] = set()
        while len(placed) < len(self.started):  # depends_on order: a wave needs only earlier waves
            wave = [
                n
                for n in sorted(self.started - placed)
                if set(self.services[n].get("depends_on", {})) & self.started <= placed
            ]
            assert wave, f"depends_on cycle among {self.started - placed}"
            waves.append(wave)
            placed |= set(wave)
        for wave in waves:
            for name in wave:
                self.running[name] = self._spawn(name)
            for name in wave:
                self._wait(self.running[name])

    def _spawn(self, name: str) -> Running:
        service = self.services[name]
        ports = self.local_ports[name]
        files = {
            target: self._localized(name, target, source) for target, source in bind_mounts(service).items()
        }
        image = service["image"]
        dockerfile = self.built.get(image)  # our own images: the ENTRYPOINT their Dockerfile sets
        entry = service.get("entrypoint") or (entrypoint(dockerfile) if dockerfile else [])
        command = service.get("command") or IMAGE_COMMANDS.get(image.split(":")[0], [])
        env = {k: v for k, v in os.environ.items() if not k.startswith("WARMROUTE_")}
        env.update({k: str(v) for k, v in service.get("environment", {}).items()}, PYTHONUNBUFFERED="1")
        log = self.workdir / f"{name}.log"
        with log.open("wb") as out:
            process = procs.spawn(
                local_argv([*entry, *command], ports, files),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
                group=True,
                die_with_parent=True,
            )
        return Running(name, ports, process, log)

    def _localized(self, name: str, target: str, source: Path) -> Path:
        """A mounted file with local addresses: peers, the balancer's binds, the gateway's listener."""
        text = localize(source.read_text(), self.addresses)
        ports = self.local_ports[name]
        text = re.sub(
            r"^(\s*)bind :(\d+)$", lambda m: f"{m[1]}bind {LOCALHOST}:{ports[int(m[2])]}", text, flags=re.M
        )
        if target == GATEWAY_CONFIG:
            data = yaml.safe_load(text)
            data["server"].update(host=LOCALHOST, port=self.local_ports[name][data["server"]["port"]])
            data["admin"]["port"] = self.local_ports[name][data["admin"]["port"]]
            text = json.dumps(data)  # JSON is YAML
        path = self.workdir / f"{name}-{source.name}"
        path.write_text(text)
        return path

    def _wait(self, running: Running) -> None:
        service = self.services[running.name]
        check = " ".join(str(t) for t in service["healthcheck"]["test"])
        url = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]*)", check)
        try:
            if url is None:  # redis: `redis-cli ping`
                self._wait_redis(running)
            else:
                local = running.url(int(url[1])) + url[2]
                procs.wait_http(local, procs.ok, timeout_s=START_TIMEOUT_S, process=running.process)
            if GATEWAY_CONFIG in bind_mounts(service):  # and every engine admitted (canary passed)
                ready = running.url() + "/readyz"
                procs.wait_http(ready, all_ready, timeout_s=START_TIMEOUT_S, process=running.process)
        except procs.NotReady as exc:
            raise AssertionError(f"{running.name} did not start: {exc}\n{running.log_tail()}") from None

    def _wait_redis(self, running: Running) -> None:
        client = redis.Redis(host=LOCALHOST, port=next(iter(running.ports.values())), socket_timeout=1)
        deadline = time.monotonic() + START_TIMEOUT_S
        with contextlib.closing(client):
            while time.monotonic() < deadline and running.process.poll() is None:
                with contextlib.suppress(redis.RedisError):
                    if client.ping():
                        return
                time.sleep(procs.POLL_INTERVAL_S)
        raise procs.NotReady(running.url(), START_TIMEOUT_S, running.process.poll())

    def close(self) -> None:
        for running in reversed(list(self.running.values())):
            procs.stop(running.process, group=True)


def all_ready(response: httpx.Response) -> bool:
    backends = response.json().get("backends", {}) if response.status_code == 200 else {}
    return bool(backends) and all(b.get("state") == "ready" for b in backends.values())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if find_binary() is None:  # as tests/conftest.py's redis_binary(): CI requires it
        message = "redis-server not installed (apt-get install redis-server)"
        if os.environ.get("WARMROUTE_REQUIRE_REDIS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    started = Stack(tmp_path_factory.mktemp("compose-sim"))
    assert set(started.services) - started.started - {"lb"} == set(NOT_STARTED)
    try:
        started.start()
        yield started
    finally:
        started.close()


def client_headers() -> dict[str, str]:
    """The first client key of .env.example (ignored by a gateway without client keys configured)."""
    keys = json.loads(read_env_file(ENV_EXAMPLE)["CLIENT_KEYS"])
    return {"authorization": f"Bearer {keys[0]['key']}"} if keys else {}


def chat(url: str, messages: list[dict[str, str]], *, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": stream}
    body["chat_template_kwargs"] = {"enable_thinking": False}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=client_headers(), timeout=30)
    assert response.status_code == 200, response.text
    return response


def chat_counts(stack: Stack) -> dict[str, int]:
    """Chat requests each engine has served, by its own count (not the gateway's word)."""
    counts = {}
    for name in ("sim-engine-a", "sim-engine-b"):
        stats = httpx.get(stack.running[name].url() + "/sim/stats", timeout=5).json()
        counts[hostnames(name, stack.services[name])[-1]] = stats["paths"].get("/v1/chat/completions", 0)
    return counts


def test_one_conversation_stays_on_one_engine_across_both_replicas(stack: Stack) -> None:
    gw1, gw2 = (stack.running[n].url() for n in ("sim-gateway-1", "sim-gateway-2"))
    before = chat_counts(stack)
    messages = [
        {"role": "system", "content": "You are a terse assistant. " * 40},
        {"role": "user", "content": "Which engine holds this conversation? (compose stack test)"},
    ]
    first = chat(gw1, messages)
    engine = first.headers["x-warmroute-backend"]
    assert first.headers["x-warmroute-route"] == "new_least_loaded"
    answer = first.json()["choices"][0]["message"].get("content") or "ok"
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And the next turn?"}]
    second = chat(gw2, messages)  # the other replica: it knows the pin only through Redis
    assert (second.headers["x-warmroute-backend"], second.headers["x-warmroute-route"]) == (
        engine,
        "affinity_hit",
    )
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # that engine's cache held it
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "A third, streamed."}]
    third = chat(gw1, messages, stream=True)
    assert third.headers["content-type"].startswith("text/event-stream")
    assert third.text.rstrip().endswith("data: [DONE]")
    assert (third.headers["x-warmroute-backend"], third.headers["x-warmroute-route"]) == (
        engine,
        "affinity_hit",
    )
    after = chat_counts(stack)
    assert {e: after[e] - before[e] for e in after} == {e: 3 if e == engine else 0 for e in after}


@pytest.mark.needs("haproxy")
def test_the_published_port_reaches_both_replicas(stack: Stack) -> None:
    if "lb" not in stack.running:
        pytest.skip("haproxy not installed (apt-get install haproxy): the balancer is not started")
    api, health = (stack.running["lb"].url(p) for p in container_ports("lb", stack.services["lb"]))
    for i in range(4):  # new connections, new conversations: leastconn rotates between idle replicas
        chat(api, [{"role": "user", "content": f"balanced request {i}"}])
    csv = httpx.get(f"{health}/stats;csv", timeout=5).text.lstrip("# ").splitlines()
    rows = [dict(zip(csv[0].split(","), line.split(","), strict=False)) for line in csv[1:]]
    sessions = {
        r["svname"]: int(r["stot"]) for r in rows if r["pxname"] == "gateways" and r["svname"] != "BACKEND"
    }
    assert set(sessions) == {"gateway-1", "gateway-2"}
    assert all(n >= 1 for n in sessions.values()), sessions
    assert sum(sessions.values()) == 4


_PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
}
_PROMQL_WORDS |= {"unless", "inf", "nan", "le", "atan2"}


def metric_names(expr: str) -> set[str]:
    """Series names a PromQL expression reads (strings, label matchers, ranges and variables removed)."""
    expr = re.sub(r'"(?:\\.|[^"\\])*"', '""', expr)
    expr = re.sub(r"\$\{[^}]*\}|\$\w+", "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"label_values\(\s*([\w:]+)\s*,[^)]*\)", r"\1", expr)
    names = set()
    for m in re.finditer(r"(?<![\w:.])[A-Za-z_:][\w:]*", expr):
        if not expr[m.end() :].lstrip().startswith("(") and m[0] not in _PROMQL_WORDS:
            names.add(m[0])
    return names


def exported(text: str) -> set[str]:
    """Every series name a /metrics page can produce (histogram parts included, samples or not)."""
    suffixes = {
        "counter": ("_total",),
        "histogram": ("_bucket", "_sum", "_count"),
        "summary": ("_sum", "_count"),
    }
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name, *(family.name + s for s in suffixes.get(family.type, ()))}
        names |= {s.name for s in family.samples}
    return names


def dashboard_queries(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if node.get("type") == "datasource":  # a data source variable: its query is a plugin type
            return
        for key, value in node.items():
            if key in ("expr", "query") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                yield value["query"]
            else:
                yield from dashboard_queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_queries(item)


def test_grafana_dashboards_read_only_exported_series(stack: Stack) -> None:
    dashboards = sorted((ROOT / "config/grafana").glob("**/*.json"))
    assert dashboards, "no Grafana dashboard under config/grafana/"
    chat(stack.running["sim-gateway-1"].url(), [{"role": "user", "content": "traffic for the metrics"}])
    live = {"up"}  # Prometheus' own series for every target
    for name in ("sim-gateway-1", "sim-engine-a"):
        live |= exported(httpx.get(stack.running[name].url() + "/metrics", timeout=5).text)
    # The on-demand row: the stack runs no on-demand engine, and a gateway registers these series only
    # when one is configured; they are what OnDemandMetrics declares (tests/obs/test_dashboards.py reads
    # them from a live gateway that has one).
    on_demand = CollectorRegistry()
    OnDemandMetrics(on_demand)
    live |= exported(generate_latest(on_demand).decode())
    for path in dashboards:
        queries = list(dashboard_queries(json.loads(path.read_text())))
        assert queries, f"{path.name}: no queries found"
        unknown = {n for q in queries for n in metric_names(q)} - live
        assert unknown == set(), f"{path.name} reads series nobody exports"


def admin_headers() -> dict[str, str]:
    return {"authorization": f"Bearer {read_env_file(ENV_EXAMPLE)['ADMIN_TOKEN']}"}


def admin_url(stack: Stack, name: str) -> str:
    config = yaml.safe_load(bind_mounts(stack.services[name])[GATEWAY_CONFIG].read_text())
    return stack.running[name].url(config["admin"]["port"]) + "/admin"


def drained(url: str, backend: str) -> bool:
    response = httpx.get(f"{url}/backends/{backend}", headers=admin_headers(), timeout=5)
    assert response.status_code == 200, response.text
    return bool(response.json()["drained"])


def test_client_keys_and_open_probe_paths(stack: Stack) -> None:
    api = stack.running["sim-gateway-1"].url()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer not-a-key"}):
        refused = httpx.post(f"{api}/v1/chat/completions", json=body, headers=headers, timeout=10)
        assert (refused.status_code, refused.json()["error"]["code"]) == (401, "invalid_api_key")
    for path in ("/healthz", "/readyz", "/metrics"):  # probes and scrapes need no key
        assert httpx.get(api + path, timeout=5).status_code == 200, path
    counted = httpx.get(api + "/metrics", timeout=5).text.splitlines()
    assert any(ln.startswith('warmroute_client_requests_total{client="team-a"}') for ln in counted)


def test_admin_only_on_its_port_with_the_token(stack: Stack) -> None:
    api = stack.running["sim-gateway-1"].url()
    admin = admin_url(stack, "sim-gateway-1")
    assert httpx.get(api + "/admin/backends", headers=admin_headers(), timeout=5).status_code == 404
    assert httpx.get(admin + "/backends", timeout=5).status_code == 401
    listed = httpx.get(admin + "/backends", headers=admin_headers(), timeout=5)
    assert sorted(b["id"] for b in listed.json()["backends"]) == ["engine-a", "engine-b"]
    page = httpx.get(admin + "/status", headers=admin_headers(), timeout=5)
    assert (page.status_code, page.headers["content-type"]) == (200, "text/html; charset=utf-8")
    paths = httpx.get(admin + "/openapi.json", headers=admin_headers(), timeout=5).json()["paths"]
    assert "/admin/backends/{id}/drain" in paths


def test_a_drain_on_one_replica_reaches_the_other(stack: Stack) -> None:
    one, two = admin_url(stack, "sim-gateway-1"), admin_url(stack, "sim-gateway-2")
    response = httpx.post(f"{one}/backends/engine-b/drain", headers=admin_headers(), timeout=5)
    assert (response.status_code, response.json()["propagated"]) == (200, True)
    try:
        deadline = time.monotonic() + 10  # admin.sync_interval_s (1 s) polls of the Redis change feed
        while not drained(two, "engine-b"):
            assert time.monotonic() < deadline, "gateway-2 never saw gateway-1's drain"
            time.sleep(0.05)
    finally:
        httpx.post(f"{one}/backends/engine-b/undrain", headers=admin_headers(), timeout=5)
    deadline = time.monotonic() + 10
    while drained(two, "engine-b"):
        assert time.monotonic() < deadline, "gateway-2 never saw the undrain"
        time.sleep(0.05)
