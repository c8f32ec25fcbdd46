"""``make doctor`` / ``python3 -m tools.doctor``: which optional tools this machine lacks, how many tests
skip without each, and the one ``apt-get install`` line that adds them.

Standard library only, so it runs with the system ``python3`` before any virtualenv exists. The counts
come from the test suite itself: ``pytest --collect-only --needs-report`` (tests/conftest.py) counts the
tests marked ``needs(tool)``, directly or through a fixture that skips without it. Without the
virtualenv (no pytest yet) the tools are still listed, without counts. ``--short`` (what ``make test``
prints first) lists the missing tools only and collects nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REPORT_PREFIX = "warmroute-needs "
COLLECT_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class Tool:
    name: str  # as the tests' needs() marker says it
    package: str  # the Debian/Ubuntu package
    what: str  # what it is used for
    binaries: tuple[str, ...]  # any one of these on PATH is enough

    def present(self, which: Callable[[str], str | None]) -> bool:
        return any(which(b) is not None for b in self.binaries)


TOOLS = (
    Tool("make", "make", "the Makefile's targets (make demo, make test)", ("make",)),
    Tool(
        "redis-server",
        "redis-server",
        "shared state: Redis store, replicas, compose stack",
        ("redis-server",),
    ),
    Tool("prometheus", "prometheus", "a real Prometheus scraping the gateway; promtool", ("prometheus",)),
    Tool("chromium", "chromium", "the status page rendered headless", ("chromium", "chromium-browser")),
    Tool("haproxy", "haproxy", "the compose stack's balancer", ("haproxy",)),
    Tool("wrk", "wrk", "the proxy micro-benchmark", ("wrk",)),
    Tool("openssl", "openssl", "a self-signed certificate for the HTTPS upstream test", ("openssl",)),
)
VENV_PACKAGE = "python3-venv"
VISION_FIX = "make venv VISION=1 (torch + transformers, CPU build; ~1 GB)"


@dataclass(frozen=True, slots=True)
class Counts:
    tests: int
    needs: Mapping[str, int]
    vision_modules_skipped: int


def has_venv_module(python: str = "python3") -> bool:
    """``python3 -m venv`` works only with the venv and ensurepip modules (Debian: python3-venv)."""
    try:
        done = subprocess.run([python, "-c", "import venv, ensurepip"], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def vision_installed(python: Path) -> bool:
    code = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('torch') else 1)"
    try:
        return subprocess.run([str(python), "-c", code], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def collect(python: Path) -> Counts | None:
    """The suite's own counts (``make test`` collects the same tests: ``-m "not e2e"``), or None."""
    argv = [str(python), "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "--needs-report"]
    argv += ["-m", "not e2e", "tests"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=COLLECT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return parse_report(done.stdout)


def parse_report(stdout: str) -> Counts | None:
    for line in stdout.splitlines():
        if line.startswith(REPORT_PREFIX):
            data = json.loads(line.removeprefix(REPORT_PREFIX))
            return Counts(data["tests"], data["needs"], data["vision_modules_skipped"])
    return None


def missing_tools(which: Callable[[str], str | None]) -> list[Tool]:
    return [t for t in TOOLS if not t.present(which)]


def apt_line(packages: Sequence[str]) -> str:
    return "sudo apt-get install -y " + " ".join(packages)


def report(
    missing: Sequence[Tool], venv_ok: bool, counts: Counts | None, vision: bool | None, short: bool
) -> list[str]:
    packages = [t.package for t in missing] + ([] if venv_ok else [VENV_PACKAGE])
    lines = []
    if short:
        if packages:
            names = ", ".join(packages)
            lines.append(f"prerequisites: missing {names}; their tests skip (counts: make doctor)")
            lines.append(f"  {apt_line(packages)}")
        return lines
    for tool in TOOLS:
        mark = "missing" if tool in missing else "ok     "
        lines.append(f"{mark}  {tool.name:<13} {tool.what}{_skips(tool.name, counts, tool in missing)}")
    venv_state = "ok     " if venv_ok else "missing"
    lines.append(f"{venv_state}  {VENV_PACKAGE:<13} python3 -m venv (the Makefile's virtualenv)")
    if vision is not None:
        lines.append(_vision_line(vision, counts))
    if counts is None:
        lines.append("(test counts need the virtualenv: make venv, then make doctor again)")
    else:
        lines.append(f"{_tests(counts.tests)} in make test")
    lines.append(apt_line(packages) if packages else "nothing to install")
    return lines


def _skips(name: str, counts: Counts | None, missing: bool) -> str:
    if counts is None or name not in counts.needs:
        return ""
    n = counts.needs[name]
    verb = ("skips" if missing else "needs it") if n == 1 else ("skip" if missing else "need it")
    return f" ({_tests(n)} {verb})"


def _tests(n: int) -> str:
    return f"{n} test" if n == 1 else f"{n} tests"


def _vision_line(installed: bool, counts: Counts | None) -> str:
    if installed:
        vision = counts.needs.get("vision", 0) if counts is not None else 0
        n = "" if counts is None else f" ({_tests(vision)} {'needs' if vision == 1 else 'need'} it)"
        return f"ok       vision extra  the CPU vision sidecar's torch and transformers{n}"
    n = "" if counts is None else f" ({counts.vision_modules_skipped} test files skip whole)"
    return f"absent   vision extra  the CPU vision sidecar's tests{n}: {VISION_FIX}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m tools.doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="missing tools only, no test counts")
    p.add_argument("--venv", type=Path, default=ROOT / ".venv", help="the virtualenv (default .venv)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    missing = missing_tools(shutil.which)
    venv_ok = has_venv_module()
    python = args.venv / "bin" / "python"
    usable = not args.short and os.access(python, os.X_OK)
    counts = collect(python) if usable else None
    vision = vision_installed(python) if usable else None
    print("\n".join(report(missing, venv_ok, counts, vision, args.short)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
