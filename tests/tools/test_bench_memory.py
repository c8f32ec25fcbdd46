"""tools.bench_memory on a tiny table: a fresh interpreter claims N conversations and reports what it cost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_tiny_table_reports_memory_claim_time_and_gc_pauses(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    argv = [sys.executable, "-m", "tools.bench_memory", "--conversations", "2000", "--json", str(out)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2,000 conversations claimed" in done.stdout and "bytes per conversation" in done.stdout
    doc = json.loads(out.read_text())
    assert doc["conversations"] == 2000
    assert doc["backends"] == {"gpu-0": 500, "gpu-1": 500, "gpu-2": 500, "gpu-3": 500}  # least loaded: even
    assert 0 < doc["rss_before_bytes"] <= doc["rss_after_bytes"]
    assert doc["bytes_per_conversation"] == (doc["rss_after_bytes"] - doc["rss_before_bytes"]) / 2000
    assert doc["key_bytes"] == sys.getsizeof("0" * 32)  # the key is xxh3-128 as 32 hex characters
    assert doc["frozen"] is True and doc["gc_tracked_per_conversation"] < 1
    assert doc["chat_key_us"] > 0 and doc["claim_us"] > 0
    assert len(doc["gc_collect_full_ms"]) == 3 and all(t > 0 for t in doc["gc_collect_full_ms"])
    assert set(doc["gc_during_claims"]) == {"gen0", "gen1", "gen2"}
    assert doc["gc_during_claims"]["gen0"]["count"] > 0  # 2,000 claims allocate far more than 700 objects
    assert doc["gc_tracked_objects"] >= 0 and len(doc["gc_threshold"]) == 3


def test_measure_in_process_spreads_new_conversations_evenly() -> None:
    from tools.bench_memory import measure

    doc = measure(100, 2)
    assert doc["backends"] == {"gpu-0": 50, "gpu-1": 50} and doc["conversations"] == 100
