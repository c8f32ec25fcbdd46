from __future__ import annotations

import re
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from config.settings import ConfigError, PolicyName, Settings, load_settings

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_example_config_loads() -> None:
    s = load_settings(ROOT / "config" / "example.yaml")
    assert [b.id for b in s.backends] == ["gpu-a", "gpu-b"]
    assert s.routing.policy is PolicyName.TTFT
    assert load_settings(None).routing.policy is PolicyName.TTFT  # the default


def _models(annotation: Any) -> list[type[BaseModel]]:
    """The settings models inside an annotation: ``X``, ``X | None``, ``tuple[X, ...]``, ``dict[str, X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    if typing.get_origin(annotation) in (types.UnionType, typing.Union, tuple, dict):
        return [m for arg in typing.get_args(annotation) for m in _models(arg)]
    return []


def _field_names(model: type[BaseModel], seen: set[type[BaseModel]], owned: set[type[BaseModel]]) -> set[str]:
    """Field names of ``model`` and the models nested in it that are neither ``seen`` (which grows) nor
    ``owned`` by a section of their own."""
    seen.add(model)
    names = set(model.model_fields)
    for field in model.model_fields.values():
        for nested in _models(field.annotation):
            if nested not in seen and nested not in owned:
                names |= _field_names(nested, seen, owned)
    return names


def test_example_config_names_every_settings_field() -> None:
    """Each top-level section of config/example.yaml names every field of its model and of the models
    nested in it (commented-out lines count: optional parts are shown commented). A model that is some
    section's own (``canary``) is checked there, not again where it nests (``backends[].canary``)."""
    text = (ROOT / "config" / "example.yaml").read_text()
    starts = [(m.start(), m[1]) for m in re.finditer(r"^(\w+):", text, re.M)]
    sections = {
        name: text[start : starts[i + 1][0] if i + 1 < len(starts) else len(text)]
        for i, (start, name) in enumerate(starts)
    }
    assert set(sections) == set(Settings.model_fields), "top-level sections vs Settings"
    owned = {m for f in Settings.model_fields.values() for m in _models(f.annotation)}
    seen: set[type[BaseModel]] = set()
    for name, field in Settings.model_fields.items():
        wanted: set[str] = set()
        for model in _models(field.annotation):
            wanted |= _field_names(model, seen, owned - {model})
        missing = {
            f
            for f in wanted
            if not re.search(rf"(?:^[ \t]*(?:#[ \t]*)?(?:-[ \t]+)?|[{{,][ \t]*){f}:", sections[name], re.M)
        }
        assert missing == set(), f"config/example.yaml section {name}: fields not shown"


def test_env_overrides_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p = write(tmp_path, "routing: {policy: affinity, spill_factor: 3}\nserver: {port: 1}\n")
    monkeypatch.setenv("WARMROUTE_ROUTING__POLICY", "round_robin")
    monkeypatch.setenv("WARMROUTE_SERVER__PORT", "9000")
    s = load_settings(p)
    assert s.routing.policy is PolicyName.ROUND_ROBIN
    assert s.routing.spill_factor == 3  # the rest of the section still comes from the file
    assert s.server.port == 9000


def test_backends_from_env_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARMROUTE_BACKENDS", '[{"id": "x", "url": "http://h:1/v1/", "models": ["m"]}]')
    s = load_settings(None)
    assert s.backends[0].url == "http://h:1"


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("routing: {spill_factor: 0.5}", "routing.spill_factor"),
        ("routing: {policy: fastest}", "routing.policy"),
        ("backends: [{id: a, url: 'ftp://x', models: [m]}]", "backends.0.url"),
        ("backends: [{id: a, url: 'http://x', models: []}]", "backends.0.models"),
        ("backends: [{id: a, url: 'http://x', models: [m], weight: 0}]", "backends.0.weight"),
        (
            "backends: [{id: a, url: 'http://x', models: [m]}, {id: a, url: 'http://y', models: [m]}]",
            "duplicate",
        ),
        ("rooting: {}", "rooting"),
        ("redis: {heartbeat_s: 5, lease_ttl_s: 6}", "twice heartbeat_s"),
        ("redis: {timeout_s: 0}", "redis.timeout_s"),
        (
            "server: {workers: 2}\nbackends: [{id: a, url: 'http://x', models: [m], managed: {command: x}}]",
            "need server.workers: 1",
        ),
        ("guard: {action: kill}", "guard.action"),
        ("admin: {host: 127.0.0.1}", "admin: Value error, host is set without port"),
        ("server: {port: 9000}\nadmin: {port: 9000}", "admin.port 9000 is also server.port"),
        ("admin: {protect_metrics: true}", "admin: Value error, protect_metrics needs the admin token"),
        (
            "admin: {protect_readyz_detail: true, token: ''}",
            "admin: Value error, protect_readyz_detail needs the admin token",
        ),
        (
            "admin: {protect_metrics: true, protect_readyz_detail: true}",
            "protect_metrics and protect_readyz_detail need the admin token, and none is set",
        ),
        ("- just a list", "mapping"),
        ("a: [unclosed", "not valid YAML"),
    ],
)
def test_bad_config_names_the_field(tmp_path: Path, text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        load_settings(write(tmp_path, text))


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "nope.yaml")


def test_the_admin_token_from_the_environment_satisfies_the_protect_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = write(tmp_path, "admin: {protect_metrics: true, protect_readyz_detail: true}\n")
    monkeypatch.setenv("WARMROUTE_ADMIN__TOKEN", "from-env")
    s = load_settings(p)
    assert (s.admin.protect_metrics, s.admin.protect_readyz_detail, s.admin.secret()) == (
        True,
        True,
        "from-env",
    )
