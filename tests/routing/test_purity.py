"""routing/ stays pure: no I/O, no event loop, no web or metrics libraries."""

from __future__ import annotations

import ast
from pathlib import Path

FORBIDDEN = {
    "httpx",
    "redis",
    "starlette",
    "prometheus_client",
    "asyncio",
    "anyio",
    "uvicorn",
    "socket",
    "time",
    "random",
    "gateway",
    "backends",
    "tools",
    "config",  # settings are pydantic: the gateway copies them into routing.params.RoutingParams
    "pydantic",
    "pydantic_settings",
    "yaml",
}


def test_routing_imports_nothing_impure() -> None:
    root = Path(__file__).resolve().parents[2] / "routing"
    offenders = []
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert offenders == []
