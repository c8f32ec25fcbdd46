"""docker-compose.yml read as `docker compose` would (.env.example as the .env), and the gateway's settings
schema it must agree with. Shared by tests/test_compose.py (static checks) and tests/test_compose_stack.py
(the "sim" profile as local processes). Every field the stack uses exists now (the vision sidecar's
``sidecar`` and ``backends[].vision`` included), so every config file is loaded exactly as the gateway does.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from config.settings import Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
ENV_EXAMPLE = ROOT / ".env.example"
DOCKERFILES = {"gateway": ROOT / "Dockerfile", "vision": ROOT / "Dockerfile.vision"}
COMPOSE_DIR = ROOT / "config" / "compose"
GATEWAY_CONFIG = "/etc/warmroute/gateway.yaml"

# -- reading the compose file as `docker compose` would -----------------------------------------------------


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (``#`` comments; one pair of surrounding quotes removed), like compose's .env."""
    env: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path.name}: not KEY=VALUE: {line!r}"
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        env[key.strip()] = value
    return env


_VAR = re.compile(r"\$\$|\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}|\$(?P<bare>\w+)")


def interpolate(value: Any, env: dict[str, str], used: set[str] | None = None) -> Any:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR:?error}`` and ``$$``, through lists and maps."""
    if isinstance(value, dict):
        return {k: interpolate(v, env, used) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, used) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        if m.group() == "$$":
            return "$"
        name = m.group("name") or m.group("bare")
        if used is not None:
            used.add(name)
        op, arg, got = m.group("op"), m.group("arg") or "", env.get(name)
        empty = got is None or (got == "" and op is not None and op.startswith(":"))
        if op is not None and op.endswith("?") and empty:
            raise AssertionError(f"${{{name}}} is required: {arg}")
        if op is not None and op.endswith("-") and empty:
            return arg
        return got or ""

    return _VAR.sub(one, value)


def compose(used: set[str] | None = None) -> dict[str, Any]:
    """The compose model with .env.example as the .env (``cp .env.example .env``)."""
    raw = yaml.safe_load(COMPOSE.read_text())  # anchors and `<<` merge keys resolved here
    model: dict[str, Any] = interpolate(raw, read_env_file(ENV_EXAMPLE), used)
    return model


def services(model: dict[str, Any], profile: str | None = None) -> dict[str, dict[str, Any]]:
    """All services, or those that run with ``profile`` active (no profiles, or that one among them)."""
    found: dict[str, dict[str, Any]] = model["services"]
    if profile is None:
        return found
    return {n: s for n, s in found.items() if not s.get("profiles") or profile in s["profiles"]}


def hostnames(name: str, service: dict[str, Any]) -> list[str]:
    """The names other services reach it by: its own, then its network aliases."""
    networks = service.get("networks") or []
    attached = networks.values() if isinstance(networks, dict) else []
    return [name, *(alias for net in attached for alias in (net or {}).get("aliases", []))]


def bind_mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path -> host path of the service's bind mounts (short syntax; named volumes left out)."""
    mounts: dict[str, Path] = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        if source.startswith((".", "/")):
            mounts[target] = (ROOT / source).resolve() if source.startswith(".") else Path(source)
    return mounts


def gateway_services(model: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services(model).items() if GATEWAY_CONFIG in bind_mounts(s)}


def flag(argv: list[str], name: str) -> str | None:
    """The value after ``name`` (or of ``name=value``) in an argv."""
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def listen_port(name: str, service: dict[str, Any]) -> int:
    """The port a service listens on inside its container: ``--port`` in its command or its config file."""
    port = flag([str(a) for a in service.get("command", [])], "--port")
    if port is not None:
        return int(port)
    if GATEWAY_CONFIG in bind_mounts(service):
        return int(yaml.safe_load(bind_mounts(service)[GATEWAY_CONFIG].read_text())["server"]["port"])
    raise AssertionError(f"service {name}: no --port in its command and no gateway config")


# -- the gateway's settings schema -------------------------------------------------------------------------


def settings_field(env_name: str) -> bool:
    """Does ``WARMROUTE_A__B`` name a settings field?"""
    path = tuple(env_name.removeprefix("WARMROUTE_").lower().split("__"))
    model: Any = Settings
    for part in path:
        fields = getattr(model, "model_fields", None)
        if fields is None or part not in fields:
            return False
        annotation = fields[part].annotation
        model = next(
            (a for a in getattr(annotation, "__args__", ()) if hasattr(a, "model_fields")), annotation
        )
    return True


def load_gateway_config(path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The service's config file and environment through the gateway's loader, as `warmroute serve` does."""
    for key in [k for k in os.environ if k.startswith("WARMROUTE_")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return load_settings(path)


# -- Dockerfiles ---------------------------------------------------------------------------------------------


def stages(path: Path) -> list[list[str]]:
    """Instructions (continuations joined, comments dropped) split into build stages."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    out: list[list[str]] = []
    for line in lines:
        if line.upper().startswith("FROM "):
            out.append([])
        if out:
            out[-1].append(line)
    return out


def entrypoint(path: Path) -> list[str]:
    """The final stage's ENTRYPOINT (exec form) of a Dockerfile."""
    found = [ln for ln in stages(path)[-1] if ln.startswith("ENTRYPOINT ")]
    assert found, f"{path.name}: no ENTRYPOINT"
    argv: list[str] = json.loads(found[-1].split(None, 1)[1])
    return argv
