"""Engine simulators as real processes, for the canary, supervisor and managed-engine tests.

A module of its own name (not ``conftest``): several test folders have a conftest.py, and which one
``from conftest import ...`` finds depends on what pytest loaded last.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator, Sequence

from tools import procs

SIM_START_TIMEOUT_S = 45.0  # a Python process importing Starlette on a busy 2-core machine

SimFactory = Callable[..., list[str]]


def sim_argv(port: int, *args: str) -> list[str]:
    """``python -m backends.sim`` on ``port``, instant (time scale 0), quiet, plus ``args``."""
    base = ("-m", "backends.sim", "--port", str(port), "--time-scale", "0", "--log-level", "warning")
    return procs.python(*base, *args)


def simulators() -> Iterator[SimFactory]:
    """The body of the ``sims`` fixture: ``sims([], ["--repeat-token"])`` starts one simulator per argument
    list, all at once, and returns their URLs once each answers /health; all are stopped afterwards."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*variants: Sequence[str]) -> list[str]:
        urls = []
        for args in variants:
            port = procs.free_port()
            started.append(procs.spawn(sim_argv(port, *args), group=True, die_with_parent=True))
            urls.append(f"http://{procs.LOCALHOST}:{port}")
        for url, process in zip(urls, started[-len(urls) :], strict=True):
            procs.wait_http(url + "/health", procs.ok, timeout_s=SIM_START_TIMEOUT_S, process=process)
        return urls

    try:
        yield start
    finally:
        for process in started:
            procs.stop(process, group=True)
