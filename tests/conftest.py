"""Shared fixtures: fake engines and a real gateway, each served by uvicorn on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

from config.settings import load_settings
from gateway.app import create_app
from gateway.shapes.base import ApiShape
from gateway.shapes.table import SHAPES
from tools.redis_server import RedisServer, find_binary

from clusters import Cluster, ClusterFactory, loop_of
from needs import NEEDS_BY_FIXTURE
from upstreams import FAST_HEALTH, FakeEngine, serve

# Hypothesis's one check of the machine's speed: data generation "too slow" fails a test on a loaded machine
# while saying nothing about the code. Tests' own @settings keep their other choices (deadline=None each).
settings.register_profile("warmroute", suppress_health_check=[HealthCheck.too_slow], deadline=None)
settings.load_profile("warmroute")

REQUIRE_REDIS_ENV = "WARMROUTE_REQUIRE_REDIS"
#: The reason a whole module skips without the vision extra (tests/sidecars/vision_deps.py).
VISION_SKIP = "vision sidecar dependencies missing"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--needs-report",
        action="store_true",
        help="after collection, print one JSON line: collected tests per optional tool they need",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        for tool in sorted({t for f, t in NEEDS_BY_FIXTURE.items() if f in fixtures}):
            item.add_marker(pytest.mark.needs(tool))


_skipped_modules: list[str] = []


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:
        _skipped_modules.append(str(report.longrepr))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """``--needs-report``: what ``python -m tools.doctor`` counts (after ``-m`` deselection)."""
    if not session.config.getoption("needs_report"):
        return
    needs: dict[str, int] = {}
    for item in session.items:
        for tool in {t for m in item.iter_markers("needs") for t in m.args}:
            needs[tool] = needs.get(tool, 0) + 1
    # Without the vision extra its modules skip whole at import: pytest counts one skip per module.
    modules = sum(1 for reason in _skipped_modules if VISION_SKIP in reason)
    report = {"tests": len(session.items), "needs": needs, "vision_modules_skipped": modules}
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("warmroute-needs " + json.dumps(report, sort_keys=True))


@pytest.fixture
def cluster() -> Iterator[ClusterFactory]:
    """``cluster(["a", "b"], routing={...}, ...)`` starts fake engines and a gateway in front of them
    (``backend``: settings every backend gets, e.g. its dialect)."""
    stack = contextlib.ExitStack()

    def make(
        names: list[str] | None = None,
        engines: list[FakeEngine] | None = None,
        modules: tuple[object, ...] = (),
        shapes: tuple[ApiShape, ...] = SHAPES,
        backend: dict[str, Any] | None = None,
        **overrides: Any,
    ) -> Cluster:
        fakes = engines or [FakeEngine(n) for n in (names or ["a", "b"])]
        urls: dict[str, str] = {}
        servers: dict[str, Any] = {}
        for fake in fakes:
            urls[fake.name], servers[fake.name] = stack.enter_context(serve(fake.app()))
        backends = [
            {
                "id": f.name,
                "url": urls[f.name],
                "models": list(f.models),
                "api_key": f.api_key,
                **(backend or {}),
            }
            for f in fakes
        ]
        overrides.setdefault("health", FAST_HEALTH)
        settings = load_settings(None, backends=backends, **overrides)
        app = create_app(settings, modules=modules, shapes=shapes)  # further modules or shapes a test adds
        url, server = stack.enter_context(serve(app))
        return Cluster(url, {f.name: f for f in fakes}, servers, app.state.gateway, loop_of(server))

    with stack:
        yield make


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def redis_binary() -> str:
    """The redis-server path, or skip (fail when $WARMROUTE_REQUIRE_REDIS=1) if it is not installed."""
    found = find_binary()
    if found is None:
        message = (
            "redis-server not found on PATH: install redis (apt-get install redis-server) to run these tests"
        )
        if os.environ.get(REQUIRE_REDIS_ENV) == "1":
            pytest.fail(f"{message} ({REQUIRE_REDIS_ENV}=1)")
        pytest.skip(message)
    return found


@contextlib.contextmanager
def _redis() -> Iterator[RedisServer]:
    with RedisServer(redis_binary()) as server:
        yield server


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session; tests keep apart by ``redis_prefix``. Never kill this one."""
    with _redis() as server:
        yield server


@pytest.fixture
def private_redis() -> Iterator[RedisServer]:
    """A redis-server of this test's own, to kill and restart."""
    with _redis() as server:
        yield server


@pytest.fixture
def redis_prefix() -> str:
    return f"t-{uuid.uuid4().hex[:8]}:"
