"""The admission scenarios' round loop: variants interleaved per round, each on its own gateway, stopped
however its run ends; medians per variant (no processes)."""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import pytest

from tools import bench_rounds
from tools.launch import Engine, SimProfile

pytestmark = pytest.mark.anyio


class FakeLauncher:
    started: list[str]
    stopped: list[str]

    def __init__(self, prefix: str) -> None:
        self.workdir = Path("/nonexistent")
        FakeLauncher.started, FakeLauncher.stopped = [], []

    def __enter__(self) -> FakeLauncher:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        return None

    def stop(self, child: Any) -> None:
        FakeLauncher.stopped.append(child.url)


def start_engine(launch: Any, profile: SimProfile) -> Engine:
    return Engine("engine-1", "http://127.0.0.1:1")


def start_gateway(launch: Any, engine: Engine, variant: str, name: str) -> Any:
    FakeLauncher.started.append(name)
    child = type("Child", (), {})()
    child.url = f"{variant}/{name}"
    return child


FAKES: dict[str, Any] = {
    "start_engine": start_engine,
    "start_gateway": start_gateway,
    "brief": str,
    "max_connections": 4,
}


async def test_rounds_interleave_the_variants_and_report_medians(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_rounds, "Launcher", FakeLauncher)
    seen: list[str] = []

    async def run(client: httpx.AsyncClient, url: str, variant: str) -> dict[str, Any]:
        seen.append(url)
        return {"x": float(len(seen)), "none": None}

    runs = await bench_rounds.interleaved_rounds("s", 3, ("a", "b"), SimProfile(), run_variant=run, **FAKES)
    assert seen == ["a/gw-1-0", "b/gw-1-0", "a/gw-2-1", "b/gw-2-1", "a/gw-3-2", "b/gw-3-2"]
    assert FakeLauncher.stopped == seen
    assert [r["x"] for r in runs["a"]] == [1.0, 3.0, 5.0]
    out = bench_rounds.report("s", "target", 3, 0.5, runs)
    assert out["medians"] == {"a": {"x": 3.0}, "b": {"x": 4.0}}  # a figure without a value is left out
    assert (out["scenario"], out["target"], out["rounds"], out["time_scale"]) == ("s", "target", 3, 0.5)


async def test_a_gateway_is_stopped_when_its_run_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_rounds, "Launcher", FakeLauncher)

    async def run(client: httpx.AsyncClient, url: str, variant: str) -> dict[str, Any]:
        raise RuntimeError("engine gone")

    with pytest.raises(RuntimeError):
        await bench_rounds.interleaved_rounds("s", 1, ("a",), SimProfile(), run_variant=run, **FAKES)
    assert FakeLauncher.stopped == ["a/gw-1-0"]
