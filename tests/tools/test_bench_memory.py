"""tools.bench_memory on a tiny table: a fresh interpreter claims N conversations and reports what it cost."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

from tools.bench_memory import GcPauses


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
    # The pause hook saw every collection the interpreter ran (the claims may trigger none: the routing
    # snapshot allocates nothing that outlives a request).
    pauses = [doc["gc_during_claims"][f"gen{g}"]["count"] for g in range(3)]
    assert pauses == doc["gc_collections_during_claims"]
    assert doc["gc_tracked_objects"] >= 0 and len(doc["gc_threshold"]) == 3


def test_measure_in_process_spreads_new_conversations_evenly() -> None:
    from tools.bench_memory import measure

    doc = measure(100, 2)
    assert doc["backends"] == {"gpu-0": 50, "gpu-1": 50} and doc["conversations"] == 100


def test_the_pause_hook_counts_each_collection_by_generation() -> None:
    pauses = GcPauses().install()
    try:
        gc.collect(0)
        gc.collect(0)
        gc.collect(2)
    finally:
        pauses.remove()
    counts = {g: s["count"] for g, s in pauses.snapshot().items()}
    assert counts == {"gen0": 2, "gen1": 0, "gen2": 1}
    assert pauses.snapshot()["gen2"]["max_ms"] > 0
