"""The docs' operator-facing claims held to the code (README.md and every page under docs/): the admin paths
they name and the bodies their curl examples send, the settings keys in their tables and their defaults (the
vision sidecar's own settings too), the series the metrics table lists, the on-demand refusal codes, the
sidecar's refusal codes, and the YAML examples; the generated reference pages are current and every setting
has a description; the README names only files that exist. A gateway is built in process (no lifespan, no
sockets)."""

from __future__ import annotations

import asyncio
import os
import re
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from starlette.applications import Starlette
from starlette.routing import Mount, Route

from config.settings import (
    AdminConfig,
    AuthConfig,
    BackendConfig,
    GroupConfig,
    ManagedConfig,
    OnDemandConfig,
    Settings,
    SidecarConfig,
    load_settings,
)
from gateway.admin.openapi import document
from gateway.app import Gateway, HotPath
from gateway.waiting import _CODES as ON_DEMAND_CODES  # the one table of the 503 codes
from sidecars.vision import errors as sidecar_errors
from sidecars.vision.settings import VisionSettings
from tools import gen_docs

from compose_model import ENV_EXAMPLE, read_env_file

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
ON_DEMAND_FIELDS = ("on_demand", "idle_ttl_s", "group")  # ManagedConfig's on-demand keys


def pages() -> list[Path]:
    """README.md and every page of the docs site (docs/index.md is the README again: left out)."""
    return [README, *sorted(p for p in DOCS.rglob("*.md") if p != DOCS / "index.md")]


def text() -> str:
    return "\n".join(p.read_text() for p in pages())


def section(title: str) -> str:
    """The body under the one heading ``title`` (any level) in the docs, up to the next heading of the same
    or a higher level."""
    found = []
    for page in pages():
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            m = re.fullmatch(r"(#+) (.*)", line)
            if not m or m[2] != title:
                continue
            end = next(
                (j for j in range(i + 1, len(lines)) if re.match(rf"#{{1,{len(m[1])}}} ", lines[j])),
                len(lines),
            )
            found.append("\n".join(lines[i + 1 : end]) + "\n")
    assert len(found) == 1, f"{title!r}: {len(found)} headings"
    return found[0]


def tables(markdown: str) -> Iterator[tuple[list[str], list[list[str]]]]:
    """Each table as (header cells, body rows of cells)."""
    for block in re.findall(r"(?:^\|.*\n)+", markdown, re.M):
        header, _separator, *body = (
            [cell.strip() for cell in line.strip().strip("|").split("|")] for line in block.splitlines()
        )
        yield header, body


def rows(markdown: str) -> Iterator[list[str]]:
    """Every table's body rows."""
    for _header, body in tables(markdown):
        yield from body


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]+)`", cell)


@pytest.fixture(scope="module")
def app() -> Starlette:
    """A gateway's app with every optional part on: an on-demand engine in a group, client keys."""
    hot = gen_docs.reference_asgi().app  # the app the generated pages describe: AccessGuard -> HotPath
    assert isinstance(hot, HotPath) and isinstance(hot.app, Starlette)
    return hot.app


@pytest.fixture(scope="module")
def gateway(app: Starlette) -> Gateway:
    gw: Gateway = app.state.gateway
    return gw


@pytest.fixture(scope="module")
def routes(app: Starlette) -> set[tuple[str, str]]:
    """(method, path) of every route mounted under /admin, as the app serves them."""
    mount = next(r for r in app.routes if isinstance(r, Mount) and r.path == "/admin")
    return {
        (method, "/admin" + r.path)
        for r in mount.routes
        if isinstance(r, Route)
        for method in (r.methods or set()) - {"HEAD"}
    }


def matching(path: str, routes: set[tuple[str, str]]) -> set[tuple[str, str]]:
    """The routes whose template (``{id}``: one segment) matches a concrete path."""
    found = set()
    for method, template in routes:
        pattern = re.sub(r"\\{\w+\\}", "[^/]+", re.escape(template))
        if re.fullmatch(pattern, path):
            found.add((method, template))
    return found


def test_admin_reference_table_is_every_admin_route(gateway: Gateway, routes: set[tuple[str, str]]) -> None:
    assert gateway.admin is not None
    table = {}
    for cells in rows(section("Admin API operations")):
        method, path = ticked(cells[0])[0].split(" ", 1)
        table[method, path] = cells[1]
    assert set(table) == routes
    documented = {(op.method, op.openapi_path) for op in gateway.admin.operations}
    assert set(document(gateway.admin.operations)["paths"]) == {p for _, p in documented}
    assert routes - documented == {("GET", "/admin/openapi.json"), ("GET", "/admin/status")}
    for op in gateway.admin.operations:
        body = table[op.method, op.openapi_path]
        if op.body is None:
            assert body == "—", op.openapi_path
        elif op.body is BackendConfig:
            assert "backends[]" in body, op.openapi_path
        else:
            (fields,) = ticked(body)
            assert set(fields.strip("{}").split(", ")) == set(op.body.model_fields), op.openapi_path


def curl_calls() -> Iterator[tuple[str, str, str | None, str]]:
    """(method, /admin path, body, line) of every curl example against ``$A``."""
    for line in text().splitlines():
        if not line.startswith("curl ") or "$A/" not in line:
            continue
        path = "/admin" + re.search(r"\$A(/\S*)", line)[1]  # type: ignore[index]
        body = re.search(r"-d '([^']*)'", line)
        verb = re.search(r"-X (\w+)", line)
        method = verb[1] if verb else ("POST" if body else "GET")
        yield method, path, body[1] if body else None, line


def test_curl_examples_call_real_operations_with_valid_bodies(
    gateway: Gateway, routes: set[tuple[str, str]]
) -> None:
    assert gateway.admin is not None
    ops = {(op.method, op.openapi_path): op for op in gateway.admin.operations}
    calls = list(curl_calls())
    assert len(calls) >= 10
    for method, path, body, line in calls:
        found = {r for r in matching(path, routes) if r[0] == method}
        assert len(found) == 1, line
        op = ops.get(found.pop())
        if op is None or op.body is None:
            assert body is None, line
            continue
        assert body is not None, f"{line}: the operation takes a body"
        op.body.model_validate_json(body)  # raises, naming the field, if the example is wrong
    base = re.search(r"A=http://127\.0\.0\.1:(\d+)/admin\b", text())
    assert base and base[1] == read_env_file(ENV_EXAMPLE)["ADMIN_PORT_1"], "the stack's gateway-1 admin port"


def test_every_admin_path_named_in_the_readme_exists(routes: set[tuple[str, str]]) -> None:
    named = {m.rstrip(".,") for m in re.findall(r"(?<![\w/])/admin/[\w{}./-]+", text()) if "..." not in m}
    assert len(named) > 10
    assert {p for p in named if not matching(p, routes)} == set()


def _model_of(annotation: Any) -> Any:
    """``X | None`` -> ``X``."""
    if isinstance(annotation, types.UnionType):
        (annotation,) = [a for a in annotation.__args__ if a is not type(None)]
    return annotation


def _field(path: str) -> FieldInfo:
    parts = path.split(".")
    model: type[BaseModel] = Settings
    if parts[0] == "managed":
        model, parts = ManagedConfig, parts[1:]
    elif parts[0] == "backends[]":
        model, parts = BackendConfig, parts[1:]
    elif parts[0] == "groups":  # groups.<name>.field
        model, parts = GroupConfig, parts[2:]
    for part in parts[:-1]:
        annotation = _model_of(model.model_fields[part].annotation)
        assert isinstance(annotation, type) and issubclass(annotation, BaseModel), path
        model = annotation
    assert parts[-1] in model.model_fields, f"{path}: no such setting"
    return model.model_fields[parts[-1]]


def _plain(value: Any) -> Any:
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    return list(value) if isinstance(value, tuple) else value


def key_rows(first: str = "key") -> dict[str, str | None]:
    """Every row of the README's ``| <first> | default | what |`` tables: key -> default as written (None
    for "—": a required field)."""
    found: dict[str, str | None] = {}
    for header, body in tables(text()):
        if header == [first, "default", "what"]:
            for cells in body:
                (key,), defaults = ticked(cells[0]), ticked(cells[1])
                assert defaults or cells[1] == "—", cells
                found[key] = defaults[0] if defaults else None
    return found


def _check_default(key: str, field: FieldInfo, default: str | None) -> None:
    if default is None:
        assert field.is_required(), f"{key}: the README says required"
    else:
        assert _plain(field.get_default(call_default_factory=True)) == yaml.safe_load(default), key


def test_key_tables_name_real_settings_with_their_defaults() -> None:
    table = key_rows()
    for key, default in table.items():
        _check_default(key, _field(key), default)
    sections: dict[str, type[BaseModel]] = {
        "admin": AdminConfig,
        "auth": AuthConfig,
        "on_demand": OnDemandConfig,
    }
    expected = {f"{name}.{f}" for name, model in sections.items() for f in model.model_fields}
    expected |= {f"groups.<name>.{f}" for f in GroupConfig.model_fields}
    expected |= {f"managed.{f}" for f in ON_DEMAND_FIELDS}
    expected |= {f"sidecar.{f}" for f in SidecarConfig.model_fields} | {"backends[].vision"}
    assert expected - set(table) == set(), "settings missing from the README's key tables"


def test_sidecar_settings_table_is_every_sidecar_setting_with_its_default() -> None:
    table = key_rows("sidecar setting")
    assert set(table) == set(VisionSettings.model_fields)
    for key, default in table.items():
        _check_default(key, VisionSettings.model_fields[key], default)


def _subclasses(cls: type[sidecar_errors.VisionError]) -> Iterator[type[sidecar_errors.VisionError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def test_sidecar_refusal_table_is_the_sidecars_4xx_codes() -> None:
    """What a client can get back for an image: every 4xx the sidecar has, with its status."""
    (body,) = [
        b for header, b in tables(section("Images and the vision sidecar")) if header[0] == "sidecar code"
    ]
    table = {ticked(cells[0])[0]: int(cells[1]) for cells in body}
    codes = {e.code: e.status for e in _subclasses(sidecar_errors.VisionError) if 400 <= e.status < 500}
    assert table == codes


def exported(gw: Gateway) -> dict[str, set[str] | None]:
    """Series name (as written in the exposition) -> its labels (None: no sample to read them from)."""
    out: dict[str, set[str] | None] = {}
    for family in text_string_to_metric_families(asyncio.run(gw.scrape()).decode()):
        if family.name.endswith("_created"):
            continue  # prometheus_client's creation timestamps, not series of ours
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels} - {"le"}
        out[name] = labels if family.samples else None
    return out


def test_metrics_table_lists_exactly_the_exported_series(gateway: Gateway) -> None:
    table: dict[str, set[str]] = {}
    for cells in rows(section("Metrics series")):
        labels = set(ticked(cells[1]))
        table |= {name: labels for name in ticked(cells[0])}
    live = exported(gateway)
    assert set(table) == set(live)
    for name, seen in live.items():
        if seen is not None:
            assert table[name] == seen, name


def test_on_demand_refusal_codes_are_the_gateways() -> None:
    (body,) = [b for header, b in tables(section("On-demand engines")) if "`Retry-After`" in header]
    assert {ticked(cells[0])[0] for cells in body} == set(ON_DEMAND_CODES.values())


def test_yaml_examples_load_with_the_gateways_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in [k for k in os.environ if k.startswith("WARMROUTE_")]:
        monkeypatch.delenv(key)
    # Kubernetes and kustomize YAML (docs/kubernetes.md) is no gateway config: tests/deploy checks those.
    kube = re.compile(r"^(apiVersion|components):", re.M)
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text(), re.S) if not kube.search(b)]
    assert len(blocks) >= 3  # the README's, and the guides'
    for block in blocks:
        load_settings(None, **yaml.safe_load(block))


def test_generated_pages_are_current() -> None:
    """``python -m tools.gen_docs`` rewrites them; a change to the settings, the admin API, the metrics or
    the README without it fails here."""
    stale = [str(p.relative_to(ROOT)) for p, body in gen_docs.render().items() if p.read_text() != body]
    assert stale == [], "run: python -m tools.gen_docs"


def _models(model: type[BaseModel]) -> Iterator[type[BaseModel]]:
    for _key, sub, _env in gen_docs.walk(model, "", None):
        yield sub


def test_every_setting_has_a_description() -> None:
    """A leaf setting needs ``Field(description=...)``; a section its own or its model's docstring."""
    missing = []
    for model in _models(Settings):
        for name, field in model.model_fields.items():
            if not gen_docs.description(field):
                missing.append(f"{model.__name__}.{name}")
    assert missing == []


def test_configuration_reference_lists_every_field_with_its_default() -> None:
    body = (DOCS / "reference" / "configuration.md").read_text()
    listed = {ticked(cells[0])[0]: cells for cells in rows(body)}
    for key, model, _env in gen_docs.walk(Settings, "", None):
        for name, field in model.model_fields.items():
            cells = listed[key + name]
            assert cells[2] == gen_docs.default_text(field).replace("|", "\\|"), key + name


def test_env_names_in_the_configuration_reference_are_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    body = (DOCS / "reference" / "configuration.md").read_text()
    names = [ticked(cells[3])[0] for cells in rows(body) if cells[3] != "—"]
    assert len(names) > 50
    assert [n for n in names if gen_docs.env_field(n) is None] == []
    for key in [k for k in os.environ if k.startswith("WARMROUTE_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("WARMROUTE_ROUTING__SPILL_FACTOR", "3.5")  # the spelling the page gives is read
    assert load_settings(None).routing.spill_factor == 3.5
    assert gen_docs.env_field("WARMROUTE_ROUTING__NO_SUCH") is None
    assert gen_docs.env_field("WARMROUTE_BACKENDS__ID") is None  # a list takes JSON, not nesting


def _links(markdown: str) -> Iterator[str]:
    for target in re.findall(r"\]\(([^)\s]+)\)", markdown):
        if not re.match(r"[a-z]+:", target) and not target.startswith("#"):
            yield target.split("#", 1)[0]


def test_readme_is_a_front_door_naming_only_files_that_exist() -> None:
    readme = README.read_text()
    assert len(readme.splitlines()) <= 150
    assert readme.index("make demo") < readme.index("## In front of your own")
    assert "## What a hostile or broken client or engine cannot do\n" in readme
    for target in _links(readme):
        assert (ROOT / target).exists(), target
    for path in re.findall(r"`((?:docs|deploy|config|tests|tools|gateway)/[\w./-]+)`", readme):
        assert (ROOT / path).exists(), path


def test_no_page_or_source_cites_files_outside_the_repository() -> None:
    """Facts live in the docs with their source; nothing points at notes that are not in the repository."""
    outside = re.compile(r"DESIGN\.md|ENGINES\.md|STYLE\.md|\.\./shared|DESIGN numbers|house issue")
    sources = [*pages(), *ROOT.glob("[!.]*/**/*.py"), *ROOT.glob("tests/**/*.sh")]
    mine = Path(__file__).resolve()
    hits = [
        str(p.relative_to(ROOT))
        for p in sources
        if ".venv" not in p.parts and p.resolve() != mine and outside.search(p.read_text())
    ]
    assert hits == []


def test_every_table_has_its_header_row() -> None:
    """A blank line inside a table splits it, and the rows after it render as a paragraph of ``|``: every run
    of table lines starts with a header and a separator row."""
    for page in pages():
        for block in re.findall(r"(?:^\|.*\n)+", page.read_text(), re.M):
            lines = block.splitlines()
            assert len(lines) >= 2 and re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", lines[1]), (page.name, lines[0])


def test_routing_knob_table_names_real_settings_with_their_defaults() -> None:
    (body,) = [
        b
        for header, b in tables(section("Backends and what each routing knob trades"))
        if header[0] == "knob (default)"
    ]
    seen = set()
    for cells in body:
        names = [n for n in ticked(cells[0]) if ":" not in n]
        defaults = re.findall(r"\(([^)]+)\)", cells[0])
        assert len(names) == len(defaults), cells[0]
        prefix = names[0].rsplit(".", 1)[0] + "." if "." in names[0] else "backends[]."
        if cells[0].startswith("`routing.policy: ttft`"):
            prefix = "routing."
        for name, default in zip(names, defaults, strict=True):
            key = name if "." in name else prefix + name
            _check_default(key, _field(key), default.replace(" ", ""))
            seen.add(key)
    assert {"routing.active_window_s", "routing.speed_half_life_s", "health.fail_threshold"} <= seen
