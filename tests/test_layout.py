"""The product does not depend on its tooling or its tests (tools may import anything; nothing in the
product imports them).

Nothing in config/, routing/, backends/, gateway/ or sidecars/ has an import statement naming ``tools`` or
``tests``. The single exception is by name, not by import statement: ``gateway/cli.py`` maps ``warmroute
demo`` and ``warmroute bench`` to the strings "tools.demo" and "tools.bench" and imports them with importlib
only when that subcommand runs. The second test holds it to that: loading every product module loads no
tools module, and the modules the CLI delegates to exist.

The admin plane (``gateway/admin/``), the status page, ``/readyz`` and ``gateway/app.py`` form no import
circle, counting imports under ``TYPE_CHECKING`` too: they are handed the parts they use.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("config", "routing", "backends", "gateway", "sidecars")
FORBIDDEN = {"tools", "tests"}
# The vision extra (tests/sidecars/vision_deps.py): without it the sidecar's modules cannot load.
VISION_PACKAGES = ("torch", "transformers", "PIL", "safetensors")


def product_files() -> Iterator[Path]:
    for package in PRODUCT:
        yield from sorted((ROOT / package).rglob("*.py"))


def imported_modules(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """(line, module) for every absolute import statement; relative ones stay inside their package."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def test_product_packages_import_neither_tools_nor_tests() -> None:
    offenders, scanned = [], set()
    for path in product_files():
        scanned.add(path.relative_to(ROOT).parts[0])
        for line, module in imported_modules(ast.parse(path.read_text(), str(path))):
            if module.split(".")[0] in FORBIDDEN:
                offenders.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert offenders == []
    assert scanned == set(PRODUCT)  # every package was read: the check cannot pass by finding nothing


# Run in a fresh interpreter: this test process has imported tools already (conftest, the tools tests).
_LOAD_EVERYTHING = """
import importlib, importlib.util, json, sys
from gateway import cli
optional, unloadable = set(sys.argv[1].split(",")), []
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:  # only an optional extra's package may be absent
        if (exc.name or "").split(".")[0] not in optional:
            raise
        unloadable.append(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {"tools", "tests"})
missing = [m for m, _help in cli._DELEGATES.values() if importlib.util.find_spec(m) is None]
print(json.dumps({"loaded": loaded, "missing": missing}))
print(json.dumps(unloadable))
"""


def test_loading_the_product_loads_no_tools_and_the_cli_delegates_exist() -> None:
    modules = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in product_files()
        if path.name != "__main__.py"  # running it would start a server
    ]
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_EVERYTHING, ",".join(VISION_PACKAGES), *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result, unloadable = done.stdout.strip().splitlines()
    assert result == '{"loaded": [], "missing": []}'
    if all(importlib.util.find_spec(p) is not None for p in VISION_PACKAGES):
        assert unloadable == "[]"
    else:  # no vision extra (make test without VISION=1): only the sidecar's modules stay unloaded
        assert unloadable != "[]" and all(m.startswith("sidecars.vision") for m in json.loads(unloadable))
    assert "gateway.app" in modules and "backends.sim.cli" in modules


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """Product module -> the product modules it imports, counting every import statement: those under
    ``TYPE_CHECKING`` and inside functions too (a circle hidden there is still a circle of knowledge).
    ``from package import name`` names the submodule when there is one, else the package."""
    modules = {module_name(p): p for p in product_files()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in modules:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    edges.add(sub if sub in modules else node.module)
        graph[name] = edges - {name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _in_admin_circle_scope(module: str) -> bool:
    return module in {"gateway.app", "gateway.status_page", "gateway.readiness"} or (
        module == "gateway.admin" or module.startswith("gateway.admin.")
    )


def test_the_admin_plane_the_status_page_and_the_app_form_no_import_circle() -> None:
    graph = import_graph()
    assert "gateway.admin" in graph["gateway.app"]  # the graph was really read
    assert {"gateway.admin", "gateway.admin.api", "gateway.status_page"} <= set(graph)
    involved = [sorted(c) for c in circles(graph) if any(_in_admin_circle_scope(m) for m in c)]
    assert involved == []
    # They are handed their parts: none of them names the whole gateway or a concrete store.
    for name, edges in graph.items():
        if _in_admin_circle_scope(name) and name != "gateway.app":
            assert not edges & {"gateway.app", "gateway.redis_store"}, name


def test_the_circle_finder_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert circles({"a": {"b"}, "b": set()}) == []
