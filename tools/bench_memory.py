"""Affinity-table memory and GC benchmark (not a test): N pinned conversations in the gateway's own store.

    python -m tools.bench_memory [--conversations 1000000] [--backends 4] [--json FILE]

In a fresh interpreter (so its RSS holds nothing else), builds ``MemoryAffinityStore`` as the gateway does
and claims N conversations the way a routed request does: ``chat_key`` on a realistic body (the
benchmark's ~300-byte system prompt and a distinct first user message), then the store's ``view``, the
affinity policy over N ready backends and ``commit``; like ``warmroute serve``, it first calls
``gc.freeze()`` (``--no-freeze`` skips it). Reports RSS before and after (bytes per conversation), time per
claim, the collections the garbage collector ran meanwhile, the objects it tracks per conversation, and how
long a full ``gc.collect()`` takes with the table alive: a pause that long stops every request in flight,
so it is the first suspect for a p99 tail.

Also home of what ``tools.bench_proxy`` shares with it: the benchmark's request body and ``GcPauses``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import re
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

SYSTEM_PROMPT = (
    "You are a careful coding assistant working inside the user's repository. Answer with the smallest "
    "correct change, explain it in two or three sentences, and put code in fenced blocks. Prefer the "
    "standard library, keep the existing style and names, and say so when you are unsure instead of "
    "guessing. Never invent APIs, flags or file names."
)
USER_PROMPT = (
    "The benchmark sends one body over and over, so every request after the first is an affinity hit. "
    "How do I give each request its own first message without changing its size? Ticket "
)
MAX_ENTRIES = 2_000_000  # above any N we run: nothing is evicted, every claim stays in the table


def conversation_body(key_token: str, user_token: str) -> dict[str, Any]:
    """The benchmarks' request: ``key_token`` ends the first user message (it changes the conversation
    key), ``user_token`` is the OpenAI ``user`` field (forwarded, never part of the key)."""
    return {
        "model": "bench",
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": USER_PROMPT + key_token},
        ],
        "user": user_token,
    }


class GcPauses:
    """Collections and their pause times per generation, from ``gc.callbacks`` (``install`` adds it)."""

    def __init__(self) -> None:
        self._started = 0.0
        self.reset()

    def reset(self) -> None:
        self.count, self.total_s, self.max_s = [0, 0, 0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]

    def install(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        gc.callbacks.remove(self)

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took, gen = time.perf_counter() - self._started, info["generation"]
        self.count[gen] += 1
        self.total_s[gen] += took
        self.max_s[gen] = max(self.max_s[gen], took)

    def snapshot(self) -> dict[str, dict[str, float]]:
        return {
            f"gen{g}": {
                "count": self.count[g],
                "total_ms": self.total_s[g] * 1e3,
                "max_ms": self.max_s[g] * 1e3,
            }
            for g in range(3)
        }


def rss_bytes(pid: int | str = "self") -> int:
    m = re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    assert m, "no VmRSS"
    return int(m.group(1)) * 1024


def measure(conversations: int, backends: int, freeze: bool = True) -> dict[str, Any]:
    """The measurement itself, in this process: call it in a fresh interpreter (``main`` does)."""
    return asyncio.run(_measure(conversations, backends, freeze))


async def _measure(n: int, n_backends: int, freeze: bool) -> dict[str, Any]:
    from config.settings import RoutingConfig
    from gateway.state import MemoryAffinityStore

    store = MemoryAffinityStore(RoutingConfig(affinity_max_entries=MAX_ENTRIES))
    claim = _claimer(store, n_backends)
    await claim(-1)  # the first call imports and warms what every later one uses; its entry is dropped
    store.table.forget_backend(next(iter(store.table.counts())))
    if freeze:  # as the gateway's lifespan does once it has started (gateway/app.py)
        gc.collect()
        gc.freeze()
    empty = [_timed(gc.collect) for _ in range(2)]  # what a full collection walks without the table
    tracked_before, before, pauses = len(gc.get_objects()), rss_bytes(), GcPauses().install()
    runs_before = [g["collections"] for g in gc.get_stats()]
    key_s = route_s = 0.0
    for i in range(n):
        k, r = await claim(i)
        key_s, route_s = key_s + k, route_s + r
    after, during = rss_bytes(), pauses.snapshot()
    runs = [g["collections"] - was for g, was in zip(gc.get_stats(), runs_before, strict=True)]
    pauses.remove()
    full = [_timed(gc.collect) for _ in range(3)]
    young = [_timed(lambda g=g: gc.collect(g)) for g in (0, 1)]
    assert len(store.table) == n, (len(store.table), n)
    tracked = len(gc.get_objects())
    return {
        "conversations": n,
        "frozen": freeze,
        "backends": dict(store.table.counts()),
        "rss_before_bytes": before,
        "rss_after_bytes": after,
        "rss_after_gc_bytes": rss_bytes(),
        "bytes_per_conversation": (after - before) / n,
        "key_bytes": sys.getsizeof(chat_key_of(n - 1)),
        "chat_key_us": key_s / n * 1e6,
        "claim_us": route_s / n * 1e6,
        "gc_during_claims": during,
        "gc_collections_during_claims": runs,  # the interpreter's own count, per generation
        "gc_collect_full_empty_table_ms": [t * 1e3 for t in empty],
        "gc_collect_full_ms": [t * 1e3 for t in full],
        "gc_collect_gen0_ms": young[0] * 1e3,
        "gc_collect_gen1_ms": young[1] * 1e3,
        "gc_tracked_objects": tracked,
        "gc_tracked_per_conversation": (tracked - tracked_before) / n,
        "gc_threshold": list(gc.get_threshold()),
    }


def chat_key_of(i: int) -> str:
    from routing.keys import chat_key

    return chat_key(conversation_body(f"{i:016d}", "bench"))


def _claimer(store: Any, n_backends: int) -> Callable[[int], Awaitable[tuple[float, float]]]:
    """What a routed request does to the store for conversation ``i``; returns (key, routing) seconds."""
    from backends.registry import Registry
    from config.settings import BackendConfig, RoutingConfig
    from gateway.app import routing_params
    from routing.keys import chat_key
    from routing.policies import make_policy
    from routing.types import BackendState, PinAction, RouteRequest

    ids = [f"gpu-{i}" for i in range(n_backends)]
    registry = Registry(BackendConfig(id=b, url="http://127.0.0.1:1", models=("bench",)) for b in ids)
    for b in registry.backends.values():
        b.state = BackendState.READY
    policy = make_policy(routing_params(RoutingConfig()))

    async def claim(i: int) -> tuple[float, float]:
        body = conversation_body(f"{i:016d}", "bench")
        t0 = time.perf_counter()
        key = chat_key(body)
        t1 = time.perf_counter()
        view = await store.view(key)
        candidates = registry.candidates("bench", view.conversations, view.in_flight, t1)
        decision = policy.select(candidates, RouteRequest(key, view.pinned), t1)
        assert decision.pin is PinAction.CLAIM, decision  # every conversation is new
        await store.commit(key, decision)
        return t1 - t0, time.perf_counter() - t1

    return claim


def _timed(fn: Any) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def render(doc: dict[str, Any]) -> str:
    n, mb = doc["conversations"], 1024 * 1024
    during = ", ".join(
        f"{g} {s['count']:,.0f} (max {s['max_ms']:.2f} ms, total {s['total_ms']:.0f} ms)"
        for g, s in doc["gc_during_claims"].items()
    )
    full = ", ".join(f"{t:.1f}" for t in doc["gc_collect_full_ms"])
    empty = ", ".join(f"{t:.1f}" for t in doc["gc_collect_full_empty_table_ms"])
    spread = ", ".join(f"{b} {c:,}" for b, c in sorted(doc["backends"].items()))
    per = doc["bytes_per_conversation"]
    frozen = "gc.freeze() after start-up, as the gateway does" if doc["frozen"] else "no gc.freeze()"
    return "\n".join(
        [
            f"{n:,} conversations claimed: chat_key on distinct first messages, MemoryAffinityStore"
            f" view/commit, affinity policy; {frozen}",
            f"  spread over backends: {spread}",
            f"  RSS before {doc['rss_before_bytes'] / mb:.1f} MB, after {doc['rss_after_bytes'] / mb:.1f} MB"
            f" (after gc.collect {doc['rss_after_gc_bytes'] / mb:.1f} MB): {per:.0f} bytes per conversation,"
            f" of which the key string is {doc['key_bytes']}",
            f"  1 M conversations at this rate: {per * 1e6 / mb:.0f} MB above the process's baseline",
            f"  per claim: chat_key {doc['chat_key_us']:.2f} us"
            f" + view/select/commit {doc['claim_us']:.2f} us",
            f"  GC during the claims: {during}",
            f"  gc.collect() with the table alive: full {full} ms (1st, 2nd, 3rd);"
            f" gen0 {doc['gc_collect_gen0_ms']:.2f} ms, gen1 {doc['gc_collect_gen1_ms']:.2f} ms",
            f"  gc.collect() before the claims: {empty} ms; tracked objects now {doc['gc_tracked_objects']:,}"
            f" ({doc['gc_tracked_per_conversation']:.3f} per conversation), thresholds {doc['gc_threshold']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_memory", description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=1_000_000)
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--no-freeze", dest="freeze", action="store_false", help="skip the gateway's gc.freeze()")
    ap.add_argument("--in-process", action="store_true", help="measure in this process (no fresh one)")
    args = ap.parse_args(argv)
    if not 1 <= args.conversations <= MAX_ENTRIES:
        ap.error(f"--conversations must be 1..{MAX_ENTRIES:,}")
    if args.in_process:
        doc = measure(args.conversations, args.backends, args.freeze)
    else:
        cmd = [sys.executable, "-m", "tools.bench_memory", "--in-process", "--json", "-"]
        cmd += ["--conversations", str(args.conversations), "--backends", str(args.backends)]
        cmd += [] if args.freeze else ["--no-freeze"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=True)
        doc = json.loads(done.stdout)
    if args.json is not None and str(args.json) == "-":
        print(json.dumps(doc))
        return 0
    print(render(doc))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
