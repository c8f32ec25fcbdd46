"""tools.doctor: the report it prints, and the suite's own needs() markers it counts (kept in step here)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tools import doctor
from tools.doctor import Counts

from needs import NEEDS_BY_FIXTURE

ROOT = Path(__file__).resolve().parents[2]
# What a test module calls to find a tool (and skip without it) -> the needs() name.
CHECKS = [
    (re.compile(r'which\("(redis-server|prometheus|chromium|haproxy|wrk|openssl)"\)'), None),
    (re.compile(r'(?:which|binary)\("promtool"\)|binary\("prometheus"\)'), "prometheus"),
    (re.compile(r"chromium_binary\("), "chromium"),
    (re.compile(r"require_vision\("), "vision"),
    (re.compile(r"find_binary\(|redis_binary\("), "redis-server"),
]
# Helpers that define the checks, and the test that fakes their absence.
NOT_TESTS = {"conftest.py", "needs.py", "cdp.py", "vision_deps.py", "test_prerequisites.py", "test_doctor.py"}


def test_every_test_module_that_looks_for_a_tool_is_marked_as_needing_it() -> None:
    unmarked = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name in NOT_TESTS or "e2e" in path.parts:
            continue
        source = path.read_text()
        for pattern, name in CHECKS:
            for match in pattern.finditer(source):
                tool = name or match.group(1)
                fixtures = [f for f, t in NEEDS_BY_FIXTURE.items() if t == tool and f"def {f}(" in source]
                if f'needs("{tool}")' not in source and not fixtures:
                    unmarked.append(f"{path.relative_to(ROOT)}: {match.group(0)}")
    assert unmarked == []


def test_needs_names_are_the_doctors() -> None:
    known = {t.name for t in doctor.TOOLS} | {"vision"}
    used = set()
    for path in (ROOT / "tests").rglob("*.py"):
        if path.name == "test_doctor.py":
            continue
        used |= set(re.findall(r'needs\("([^"]+)"\)', path.read_text()))
    used |= set(NEEDS_BY_FIXTURE.values())
    assert used and used <= known, used - known


def test_the_suite_reports_its_own_counts() -> None:
    files = [
        "tests/tools/test_bench_proxy.py",
        "tests/gateway/test_upstream.py",
        "tests/admin/test_redis_admin.py",
    ]
    argv = [
        sys.executable,
        "-m",
        "pytest",
        "--collect-only",
        "-q",
        "-p",
        "no:cacheprovider",
        "--needs-report",
    ]
    done = subprocess.run([*argv, *files], capture_output=True, text=True, cwd=ROOT, timeout=120)
    counts = doctor.parse_report(done.stdout)
    assert counts is not None, done.stdout + done.stderr
    # wrk: the four bench_proxy tests that run it; openssl: test_https, on asyncio and on uvloop;
    # redis-server: test_pins_counts_and_removal_in_redis (the other test there points at a dead port).
    assert dict(counts.needs) == {"wrk": 4, "openssl": 2, "redis-server": 1}
    assert counts.tests > 5 and counts.vision_modules_skipped == 0


def test_full_report_lists_counts_and_the_apt_line() -> None:
    missing = [t for t in doctor.TOOLS if t.name in ("redis-server", "wrk")]
    counts = Counts(tests=1000, needs={"redis-server": 24, "wrk": 2, "chromium": 1}, vision_modules_skipped=4)
    lines = doctor.report(missing, venv_ok=False, counts=counts, vision=False, short=False)
    assert lines[1] == (
        "missing  redis-server  shared state: Redis store, replicas, compose stack (24 tests skip)"
    )
    assert lines[3] == "ok       chromium      the status page rendered headless (1 test needs it)"
    assert lines[5] == "missing  wrk           the proxy micro-benchmark (2 tests skip)"
    assert lines[7] == "missing  python3-venv  python3 -m venv (the Makefile's virtualenv)"
    assert lines[8].startswith(
        "absent   vision extra  the CPU vision sidecar's tests (4 test files skip whole)"
    )
    assert lines[-2:] == ["1000 tests in make test", "sudo apt-get install -y redis-server wrk python3-venv"]


def test_short_report_is_silent_when_nothing_is_missing() -> None:
    assert doctor.report([], venv_ok=True, counts=None, vision=None, short=True) == []
    wrk = [t for t in doctor.TOOLS if t.name == "wrk"]
    assert doctor.report(wrk, venv_ok=True, counts=None, vision=None, short=True) == [
        "prerequisites: missing wrk; their tests skip (counts: make doctor)",
        "  sudo apt-get install -y wrk",
    ]


def test_missing_tools_follow_which() -> None:
    present = {"make", "redis-server", "chromium-browser", "openssl"}
    names = [t.name for t in doctor.missing_tools(lambda b: b if b in present else None)]
    assert names == ["prometheus", "haproxy", "wrk"]


def test_report_line_round_trips() -> None:
    line = doctor.REPORT_PREFIX + json.dumps({"tests": 3, "needs": {"wrk": 1}, "vision_modules_skipped": 0})
    assert doctor.parse_report(f"x\n{line}\n") == Counts(3, {"wrk": 1}, 0)
    assert doctor.parse_report("no report") is None


def test_runs_with_the_system_python_and_no_venv(tmp_path: Path) -> None:
    """Standard library only: a machine without the virtualenv still gets the list."""
    done = subprocess.run(
        ["python3", "-S", "-m", "tools.doctor", "--venv", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "(test counts need the virtualenv: make venv, then make doctor again)" in done.stdout
