"""``warmroute demo --no-serve`` end to end: engines and gateway as child processes, affinity visible."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


def warmroute() -> list[str]:
    script = Path(sys.executable).parent / "warmroute"
    return [str(script)] if script.exists() else [sys.executable, "-m", "gateway.cli"]


def test_demo_shows_follow_ups_sticking_to_their_engine() -> None:
    done = subprocess.run(
        [*warmroute(), "demo", "--no-serve", "--port", "0", "--time-scale", "0.3"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(engine-\d)\s+(\w+)\s+(\d+)\s", out, re.MULTILINE)
    assert len(rows) == 20  # 5 conversations x 4 turns
    home = {conv: engine for conv, turn, engine, _, _ in rows if turn == "1"}
    assert len(set(home.values())) == 3  # new conversations spread over all three engines
    for conv, turn, engine, route, _ in rows:
        if turn != "1":
            assert (engine, route) == (home[conv], "affinity_hit")
    warm = re.search(r"follow-ups on the warm engine: (\d+)/(\d+)", out)
    assert warm is not None and warm.group(1) == warm.group(2) == "15"
    assert "ERROR" not in out
