"""The product does not depend on its tooling or its tests (tools may import anything; nothing in the
product imports them).

Nothing in config/, routing/, backends/, gateway/ or sidecars/ has an import statement naming ``tools`` or
``tests``. The single exception is by name, not by import statement: ``gateway/cli.py`` maps ``warmroute
demo`` and ``warmroute bench`` to the strings "tools.demo" and "tools.bench" and imports them with importlib
only when that subcommand runs. The second test holds it to that: loading every product module loads no
tools module, and the modules the CLI delegates to exist.

Importing the product has no side effects either: no collector on prometheus_client's global registry or
process-wide switch flipped, no thread, no logging configured, no environment, signal or gc change.
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


def product_modules() -> list[str]:
    return [
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in product_files()
        if path.name != "__main__.py"  # running it would start a server
    ]


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
    modules = product_modules()
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


# Third-party packages are imported before the first look: their own import-time effects (prometheus_client's
# default collectors, torch's loggers and warning filters) are not the product's.
_IMPORT_EFFECTS = """
import asyncio, gc, importlib, importlib.util, json, logging, os, signal, sys, threading, warnings
import prometheus_client, prometheus_client.metrics
for name in sys.argv[1].split(","):
    if importlib.util.find_spec(name) is not None:
        importlib.import_module(name)

def state():
    loggers = logging.Logger.manager.loggerDict.items()
    return {
        "global collectors": sorted(prometheus_client.REGISTRY._names_to_collectors),
        "created series": prometheus_client.metrics._use_created,
        "threads": sorted(t.name for t in threading.enumerate()),
        "root logger": [logging.root.level, len(logging.root.handlers)],
        "configured loggers": sorted(
            n for n, lg in loggers
            if isinstance(lg, logging.Logger) and (lg.level or lg.handlers or not lg.propagate or lg.disabled)
        ),
        "environment": dict(os.environ),
        "signals": [repr(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)],
        "gc": [gc.isenabled(), gc.get_freeze_count(), list(gc.get_threshold())],
        "loop policy": type(asyncio.get_event_loop_policy()).__name__,
        "warning filters": len(warnings.filters),
    }

before = state()
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:  # only an optional extra's package may be absent
        if (exc.name or "").split(".")[0] not in sys.argv[1].split(","):
            raise
after = state()
print(json.dumps({k: [before[k], after[k]] for k in before if before[k] != after[k]}))
"""


def test_importing_the_product_changes_nothing_global() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EFFECTS, ",".join(VISION_PACKAGES), *product_modules()],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {}


# -- the import graph ---------------------------------------------------------------------------------------

#: Circles that other branches of this redesign remove. Empty now: the product has no import circle, and a
#: new one fails. The list only ever shrinks: one on it that is gone fails too (delete its line).
CIRCLES_REMOVED_ELSEWHERE: set[frozenset[str]] = set()


def product_module_paths() -> dict[str, Path]:
    return {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for path in product_files()
    }


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the product modules it imports, every import statement counted: inside functions and under
    ``if TYPE_CHECKING:`` too (a circle closed by a type-only import is still a circle of knowledge)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*parts, *([base] if base else [])])
                for alias in node.names:  # ``from pkg import mod`` names a module
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_circles_are_found_type_checking_imports_included(tmp_path: Path) -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert circles(graph) == [frozenset({"a", "b", "c"})]
    sources = {
        "__init__": "",
        "a": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "b": "def f():\n    from . import a\n",  # relative, inside a function
        "c": "from pkg import b\n",
    }
    (tmp_path / "pkg").mkdir()
    for name, text in sources.items():
        (tmp_path / "pkg" / f"{name}.py").write_text(text)
    made = {"pkg": tmp_path / "pkg" / "__init__.py"} | {
        f"pkg.{n}": tmp_path / "pkg" / f"{n}.py" for n in "abc"
    }
    assert import_graph(made) == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.b"}}
    assert circles(import_graph(made)) == [frozenset({"pkg.a", "pkg.b"})]  # closed by the type-only import
    graph = import_graph(product_module_paths())
    assert "gateway.learning" in graph["gateway.admin.explain"]  # imported under TYPE_CHECKING only: counted


def test_the_product_has_no_import_circles_but_those_being_removed_elsewhere() -> None:
    found = set(circles(import_graph(product_module_paths())))
    assert found - CIRCLES_REMOVED_ELSEWHERE == set()  # a new circle
    assert CIRCLES_REMOVED_ELSEWHERE - found == set()  # one removed: delete its line above


def test_the_request_path_is_outside_every_circle() -> None:
    request_path = {
        f"gateway.{name}"
        for name in (
            "proxy", "phases", "context", "exchange", "relay", "sse", "continuation", "reasoning", "guard",
            "observe", "waiting", "budgets", "vision", "learning", "endpoints", "not_found",
            "shapes.base", "shapes.chat", "shapes.completions", "shapes.passthrough", "shapes.table",
            "shapes.responses", "ownership", "shapes.messages", "shapes.anthropic_errors",
        )
    } | {"backends.dialects", "backends.registry"}  # fmt: skip
    in_circles = set().union(*circles(import_graph(product_module_paths())))
    assert request_path & in_circles == set()
    assert request_path <= set(product_module_paths())


# -- the proxy is built once --------------------------------------------------------------------------------


def test_nothing_is_assigned_to_the_proxy_after_construction() -> None:
    """Its features are modules given to the constructor (gateway/phases.py). No code (product, tools or
    tests) assigns ``<...>.proxy.<attr>`` or ``proxy.<attr>``; and the class keeps no instance ``__dict__``,
    so an attribute it does not declare cannot be added at all."""
    from gateway.proxy import Proxy

    for caught in ("c.gateway.proxy.steps = ()", "proxy.observers += (x,)", "proxy.feed: F = f"):
        node = ast.parse(caught).body[0]
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target  # type: ignore[attr-defined]
        assert _names_a_proxy(target.value)  # the scan below sees this shape
    offenders = []
    for package in (*PRODUCT, "tools", "tests"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                    targets = [node.target]
                for target in targets:
                    if isinstance(target, ast.Attribute) and _names_a_proxy(target.value):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []
    assert ("__dict__" not in dir(Proxy) and not hasattr(Proxy, "__dict__")) or Proxy.__slots__
    assert not hasattr(object.__new__(Proxy), "__dict__")


def _names_a_proxy(value: ast.expr) -> bool:
    return (isinstance(value, ast.Name) and value.id == "proxy") or (
        isinstance(value, ast.Attribute) and value.attr == "proxy"
    )
