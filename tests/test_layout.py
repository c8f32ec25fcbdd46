"""The product does not depend on its tooling or its tests (tools may import anything; nothing in the
product imports them).

Nothing in config/, routing/, backends/, gateway/ or sidecars/ has an import statement naming ``tools`` or
``tests``. The single exception is by name, not by import statement: ``gateway/cli.py`` maps ``warmroute
demo`` and ``warmroute bench`` to the strings "tools.demo" and "tools.bench" and imports them with importlib
only when that subcommand runs. The second test holds it to that: loading every product module loads no
tools module, and the modules the CLI delegates to exist.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("config", "routing", "backends", "gateway", "sidecars")
FORBIDDEN = {"tools", "tests"}


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
for name in sys.argv[1:]:
    importlib.import_module(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in {"tools", "tests"})
missing = [m for m, _help in cli._DELEGATES.values() if importlib.util.find_spec(m) is None]
print(json.dumps({"loaded": loaded, "missing": missing}))
"""


def test_loading_the_product_loads_no_tools_and_the_cli_delegates_exist() -> None:
    modules = [
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for path in product_files()
        if path.name != "__main__.py"  # running it would start a server
    ]
    done = subprocess.run(
        [sys.executable, "-c", _LOAD_EVERYTHING, *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == '{"loaded": [], "missing": []}'
    assert "gateway.app" in modules and "backends.sim.cli" in modules
