"""The sidecar and the gateway stay apart: neither imports the other, and the gateway never loads torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GATEWAY_SIDE = {"gateway", "routing", "backends", "config", "tools"}
HEAVY = ("torch", "transformers", "safetensors", "PIL")


def absolute_imports(folder: Path) -> list[tuple[str, str]]:
    found = []
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [(str(path.relative_to(ROOT)), name) for name in names]
    return found


def test_the_sidecar_imports_nothing_from_the_gateway_side() -> None:
    imports = absolute_imports(ROOT / "sidecars")
    assert [(f, m) for f, m in imports if m.split(".")[0] in GATEWAY_SIDE] == []
    assert {m.split(".")[0] for _f, m in imports} >= {"torch", "httpx", "starlette"}  # the scan saw real code


def test_the_gateway_imports_no_sidecar_and_loads_no_torch() -> None:
    imports = (
        absolute_imports(ROOT / "gateway")
        + absolute_imports(ROOT / "routing")
        + absolute_imports(ROOT / "backends")
    )
    assert [(f, m) for f, m in imports if m.split(".")[0] in {"sidecars", *HEAVY}] == []
    probe = (
        "import sys, gateway.app, gateway.cli; print(sorted(m for m in sys.modules if m.split('.')[0] in %r))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe % (HEAVY,)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
