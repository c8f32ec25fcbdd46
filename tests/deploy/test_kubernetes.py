"""The Kubernetes manifests (deploy/kubernetes/) held to the schemas and to the gateway.

Every manifest validates offline against the Kubernetes JSON schemas that ``kubernetes-validate`` ships
(the ServiceMonitor, a CRD it has no schema for, is checked by its structure); every kustomization's
resources, components and patches exist and load (and ``kubectl kustomize`` builds the overlay, with its
optional components switched on, when kubectl is installed); the gateway config in the ConfigMaps loads with
the gateway's own loader, with the environment the Deployment gives it; every ``WARMROUTE_*`` name in the
manifests is a real setting; probes, ports and selectors agree.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from config.settings import Settings, load_settings
from sidecars.vision.__main__ import parse as sidecar_argv
from sidecars.vision.settings import VisionSettings
from tools.gen_docs import env_field

ROOT = Path(__file__).resolve().parents[2]
KUBE = ROOT / "deploy" / "kubernetes"
BASE, OVERLAY = KUBE / "base", KUBE / "overlays" / "example"
COMPONENTS = {p.parent.name: p.parent for p in (KUBE / "components").glob("*/kustomization.yaml")}
K8S_VERSION = "1.32"  # the oldest minor the manifests target; every field used here exists there
KUSTOMIZATION = "kustomization.yaml"


def documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path}: empty"
    return docs


def manifest_files() -> list[Path]:
    return sorted(p for p in KUBE.rglob("*.yaml") if p.name != KUSTOMIZATION)


def resolve(folder: Path, patches: list[Path] | None = None) -> Iterator[dict[str, Any]]:
    """A small kustomize resolver: the resources of ``folder``'s kustomization and of its bases and
    components, each listed file present and loading; patch files are collected into ``patches``."""
    kustomization = documents(folder / KUSTOMIZATION)[0]
    assert kustomization["kind"] in {"Kustomization", "Component"}, folder
    for entry in [*kustomization.get("resources", []), *kustomization.get("components", [])]:
        target = (folder / entry).resolve()
        assert target.exists(), f"{folder}: {entry} does not exist"
        if target.is_dir():
            yield from resolve(target, patches)
        else:
            yield from documents(target)
    for patch in kustomization.get("patches", []):
        path = folder / patch["path"]
        assert path.is_file(), f"{folder}: patch {patch['path']} does not exist"
        if patches is not None:
            patches.append(path)


def by_kind(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    found: list[dict[str, Any]] = spec.get("containers", [])
    return found


def every_resource() -> list[dict[str, Any]]:
    """The base, the overlay and every component, unpatched."""
    docs = list(resolve(OVERLAY))
    for component in COMPONENTS.values():
        docs += resolve(component)
    return docs


def test_every_kustomization_resolves_and_every_file_is_used() -> None:
    patches: list[Path] = []
    listed = {id(d) for d in resolve(OVERLAY, patches)}
    assert listed
    for component in COMPONENTS.values():
        list(resolve(component, patches))
    used = {p.resolve() for p in patches}
    for folder in {p.parent for p in KUBE.rglob(KUSTOMIZATION)}:
        kustomization = documents(folder / KUSTOMIZATION)[0]
        used |= {(folder / e).resolve() for e in kustomization.get("resources", []) if (folder / e).is_file()}
    assert {p.resolve() for p in manifest_files()} - used == set(), "manifests no kustomization lists"
    assert set(COMPONENTS) == {"servicemonitor", "vision-sidecar"}


def test_every_patch_names_a_resource_and_container_it_patches() -> None:
    patches: list[Path] = []
    for folder in [OVERLAY, *COMPONENTS.values()]:
        list(resolve(folder, patches))
    docs = every_resource()
    for path in patches:
        for patch in documents(path):
            target = by_kind(docs, patch["kind"], patch["metadata"]["name"])
            names = {c["name"] for c in containers(target)}
            assert {c["name"] for c in containers(patch)} <= names, path


def _validator() -> Any:
    return pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")


def check_service_monitor(doc: dict[str, Any], services: list[dict[str, Any]]) -> None:
    """No schema ships for the Prometheus Operator's CRD: its shape, and that it selects a Service port."""
    assert doc["apiVersion"] == "monitoring.coreos.com/v1" and doc["metadata"]["name"]
    assert set(doc["spec"]) <= {"selector", "endpoints", "namespaceSelector", "jobLabel"}
    wanted = doc["spec"]["selector"]["matchLabels"]
    (service,) = [s for s in services if wanted.items() <= s["metadata"].get("labels", {}).items()]
    ports = {p["name"] for p in service["spec"]["ports"]}
    for endpoint in doc["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout", "scheme"}, endpoint
        assert endpoint["port"] in ports and endpoint["path"] == "/metrics"


def validate_all(docs: list[dict[str, Any]]) -> int:
    kv = _validator()
    services = [d for d in docs if d["kind"] == "Service"]
    for doc in docs:
        if doc["kind"] == "ServiceMonitor":
            check_service_monitor(doc, services)
        else:
            kv.validate(doc, K8S_VERSION, strict=True)  # raises, naming the field
    return len(docs)


def test_every_manifest_validates_against_the_kubernetes_schemas() -> None:
    # Resources, plus the overlay's ConfigMap patch, which is a whole ConfigMap (the component's Deployment
    # patch is partial: it is validated built, below, and checked by name above).
    assert validate_all([*every_resource(), *documents(OVERLAY / "gateway-config.yaml")]) == 12


def test_the_validator_refuses_a_misspelt_field() -> None:
    """The schemas are strict: an unknown field (a typo) is an error, so the test above can fail."""
    kv = _validator()
    deployment = by_kind(documents(BASE / "gateway-deployment.yaml"), "Deployment", "warmroute-gateway")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, K8S_VERSION, strict=True)


def test_kubectl_kustomize_builds_the_overlay_with_every_component(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the pure-Python resolver above checked the kustomizations")
    shutil.copytree(KUBE, tmp_path / "kubernetes")
    overlay = tmp_path / "kubernetes" / "overlays" / "example" / KUSTOMIZATION
    text = overlay.read_text()
    assert "# components:\n#   - ../../components/servicemonitor" in text, (
        "the overlay's commented components"
    )
    overlay.write_text(text.replace("# components:", "components:").replace("#   - ../../", "  - ../../"))
    for folder in (BASE, OVERLAY, overlay.parent):
        out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        docs = [d for d in yaml.safe_load_all(out.stdout) if d is not None]
        validate_all(docs)
        if folder == overlay.parent:
            assert {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"} == {"warmroute"}
            gateway = by_kind(docs, "Deployment", "warmroute-gateway")
            env = {e["name"] for e in containers(gateway)[0]["env"]}
            assert "WARMROUTE_SIDECAR__URL" in env
            images = {c["image"] for d in docs for c in containers(d)}
            assert "registry.example.com/warmroute/vision:0.1.0" in images


def gateway_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The gateway container's environment, secrets read from the example overlay's Secret."""
    secret = by_kind(documents(OVERLAY / "secret.yaml"), "Secret", "warmroute-secrets")["stringData"]
    out = {}
    for doc in docs:
        for container in containers(doc):
            if container["name"] != "gateway":
                continue
            for var in container.get("env", []):
                ref = var.get("valueFrom", {}).get("secretKeyRef")
                out[var["name"]] = secret[ref["key"]] if ref else var["value"]
    return out


def load_config(
    config_map: dict[str, Any], env: dict[str, str], tmp_path: Path, mp: pytest.MonkeyPatch
) -> Settings:
    for key in [k for k in os.environ if k.startswith("WARMROUTE_")]:
        mp.delenv(key)
    for key, value in env.items():
        mp.setenv(key, value)
    path = tmp_path / "gateway.yaml"
    path.write_text(config_map["data"]["gateway.yaml"])
    return load_settings(path)


@pytest.mark.parametrize("source", [BASE / "gateway-config.yaml", OVERLAY / "gateway-config.yaml"])
def test_gateway_config_loads_with_the_deployments_environment(
    source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (config_map,) = documents(source)
    docs = [*resolve(OVERLAY), *documents(COMPONENTS["vision-sidecar"] / "gateway-sidecar-url.yaml")]
    settings = load_config(config_map, gateway_env(docs), tmp_path, monkeypatch)
    assert settings.admin.secret() == "change-me-admin-token"
    assert [k.name for k in settings.auth.client_keys] == ["team-a"]
    assert settings.sidecar is not None and settings.sidecar.url == "http://warmroute-vision:8490"
    assert settings.redis.url == "redis://warmroute-redis:6379/0"
    assert settings.server.workers == 1 and settings.backends


def test_every_warmroute_variable_is_a_real_setting() -> None:
    names: dict[str, str] = {}
    for path in manifest_files():
        for doc in documents(path):
            for container in containers(doc):
                names |= {v["name"]: container["name"] for v in container.get("env", [])}
    assert {n for n in names if n.startswith("WARMROUTE_")} == set(names)
    assert len(names) >= 6
    for name, container in names.items():
        if container == "vision":
            assert name.removeprefix("WARMROUTE_VISION_").lower() in VisionSettings.model_fields, name
        else:
            assert env_field(name) is not None, name


def test_the_vision_sidecar_runs_with_its_own_cli_and_fits_the_gateways(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    component = list(resolve(COMPONENTS["vision-sidecar"]))
    (vision,) = containers(by_kind(component, "Deployment", "warmroute-vision"))
    for key in [k for k in os.environ if k.startswith("WARMROUTE_VISION_")]:
        monkeypatch.delenv(key)
    for var in vision["env"]:
        monkeypatch.setenv(var["name"], var["value"])
    settings = VisionSettings(**sidecar_argv([str(a) for a in vision["args"]]))
    service = by_kind(component, "Service", "warmroute-vision")
    assert service["spec"]["ports"][0]["port"] == settings.port == vision["ports"][0]["containerPort"]
    gateway_patch = documents(COMPONENTS["vision-sidecar"] / "gateway-sidecar-url.yaml")
    env = gateway_env(gateway_patch)
    assert env["WARMROUTE_SIDECAR__URL"] == f"http://warmroute-vision:{settings.port}"
    replicas = by_kind(documents(BASE / "gateway-deployment.yaml"), "Deployment", "warmroute-gateway")
    # One encode runs, queue_size wait: every replica's encodes at once must fit.
    assert (
        replicas["spec"]["replicas"] * int(env["WARMROUTE_SIDECAR__MAX_PARALLEL"]) <= 1 + settings.queue_size
    )


def test_gateway_deployment_probes_ports_and_hardening(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs = list(resolve(BASE))
    deployment = by_kind(docs, "Deployment", "warmroute-gateway")
    pod = deployment["spec"]["template"]["spec"]
    (gateway,) = containers(deployment)
    settings = load_config(by_kind(docs, "ConfigMap", "warmroute-gateway-config"), {}, tmp_path, monkeypatch)
    assert deployment["spec"]["replicas"] == 2
    ports = {p["name"]: p["containerPort"] for p in gateway["ports"]}
    assert ports == {"http": settings.server.port, "admin": settings.admin.port}
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert pod["terminationGracePeriodSeconds"] > settings.server.shutdown_grace_s
    assert pod["securityContext"]["runAsNonRoot"] is True
    for doc in docs:
        for container in containers(doc):
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, doc["metadata"]["name"]
            assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    mounts = {m["mountPath"]: m["name"] for m in gateway["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts["/tmp"]]
    assert volumes[mounts["/etc/warmroute"]]["configMap"]["name"] == "warmroute-gateway-config"
    assert gateway["args"][-1] == "/etc/warmroute/gateway.yaml"
    service = by_kind(docs, "Service", "warmroute-gateway")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"], "the admin port stays out"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    for selector in (
        service["spec"]["selector"],
        by_kind(docs, "PodDisruptionBudget", "warmroute-gateway")["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= labels.items()
    redis = by_kind(docs, "Service", "warmroute-redis")
    assert settings.redis.url == f"redis://{redis['metadata']['name']}:{redis['spec']['ports'][0]['port']}/0"
