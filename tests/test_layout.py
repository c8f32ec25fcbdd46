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
