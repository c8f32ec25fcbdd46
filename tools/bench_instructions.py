"""Gateway CPU per request in instructions (not a test): the gateway under callgrind, a fixed request count.

    python -m tools.bench_instructions [--policies affinity,ttft] [--paths hit,new] [--requests 300]
                                       [--trees old=../old-checkout,new=.]

Wall-clock CPU on a shared machine is noisy; instruction counts are not. Per policy, one gateway runs under
``valgrind --tool=callgrind`` in front of ``tools.bench_proxy``'s upstream, with ``tools.bench_proxy``'s
bodies (``render``: the same paths, the same bytes). Per path: ``--warmup`` requests, the counters zeroed
(``callgrind_control -z``), ``--requests`` requests one at a time on one keep-alive connection, a dump; the
dump's total divided by the requests is quoted, less what the gateway runs while idle for as long (its timers,
which valgrind's slowdown would otherwise inflate). Health probes and the ttft policy's engine-signal scrapes
are made hourly for the same reason (``_SERVE``): natively both cost well under 1 % of a request.

``--trees NAME=PATH,...`` measures the gateway of each checkout (its code first on ``PYTHONPATH``, this
venv's packages) in front of the same upstream, with this checkout's clients and bodies: two commits
compared in one run. A row per tree and policy; ratios against the first row.

``--cache-sim`` has callgrind simulate the caches too: per request, besides instructions, the first-level
data misses (D1: reads + writes) and the last-level ones (LL data). ``--prefill N`` sends N new-conversation
requests uninstrumented before anything is measured, so the windows run against an affinity table of N
pins, as a long wall-clock run's later rounds do. ``--connections N`` (N > 1) drives each window with wrk at
N connections for ``--seconds`` (the bench_proxy bodies) instead of ``--requests`` one at a time; the
window's requests are wrk's count.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from tools.bench_proxy import TOKEN_WIDTH, Scripts, _gateway_config, render, upstream_argv
from tools.procs import checkout_env, checkouts, child, free_port, python, wait_http

# ``warmroute serve`` whose engine-signal scraper (the ttft policy's) scrapes once at start, then not again
# for an hour: its scrape every 2 s runs on the wall clock, which valgrind slows about fifty-fold, so it would
# be counted as tens of thousands of instructions per request that natively it costs a fraction of one.
_SERVE = """import sys
import backends.engine_metrics as m
init = m.SignalScraper.__init__
def hourly(self, *args, **kwargs):
    init(self, *args, **kwargs)
    self.interval_s = 3600.0
m.SignalScraper.__init__ = hourly
from gateway.cli import main
sys.exit(main(sys.argv[1:]))
"""


#: Cache-simulation events summed per reported column (callgrind's names).
_MISSES = {"D1": ("D1mr", "D1mw"), "LL": ("DLmr", "DLmw")}


def _events(folder: Path, pid: int, before: set[Path]) -> dict[str, int]:
    """The event totals (Ir, and with the cache simulation D1mr, DLmw, ...) of the dump callgrind wrote
    since ``before`` (it writes them asynchronously)."""
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        for f in sorted(set(folder.glob(f"cg.{pid}.out*")) - before):
            text = f.read_text(errors="replace")
            names, totals = re.search(r"^events: (.*)$", text, re.M), re.search(r"^totals: (.*)$", text, re.M)
            if names and totals:
                return dict(zip(names.group(1).split(), map(int, totals.group(1).split()), strict=False))
        time.sleep(0.2)
    raise RuntimeError("callgrind wrote no dump")


def _totals(folder: Path, pid: int, before: set[Path]) -> int:
    """The instruction total of the dump callgrind wrote since ``before``."""
    return _events(folder, pid, before)["Ir"]


def _send(client: httpx.Client, url: str, path: str, tag: str, n: int) -> int:
    for i in range(n):
        headers, body = render(path, f"{tag}{i:0{TOKEN_WIDTH - len(tag)}d}")
        client.post(url, content=body, headers=headers).raise_for_status()
    return n


def _window(pid: int, folder: Path, work: Callable[[], int]) -> tuple[dict[str, int], float, int]:
    """The events the gateway ran while ``work`` ran, the seconds it took, and the requests it sent."""
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    before, start = set(folder.glob(f"cg.{pid}.out*")), time.monotonic()
    sent = work()
    took = time.monotonic() - start
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    return _events(folder, pid, before), took, sent


@dataclass(frozen=True)
class Drive:
    """How the windows are driven (the module's doc: ``--cache-sim``, ``--prefill``, ``--connections``)."""

    cache_sim: bool = False
    prefill: int = 0
    connections: int = 1
    seconds: float = 20.0


def measure(
    policy: str,
    paths: list[str],
    requests: int,
    warmup: int,
    idle_s: float,
    up_port: int,
    tree: Path | None = None,
    keep: Path | None = None,
    drive: Drive = Drive(),
    misses: dict[str, dict[str, float]] | None = None,
) -> dict[str, float]:
    """Instructions per request per path (a path asked twice: its cheaper run), less the idle rate's share.
    With the cache simulation, each path's data misses per request (less idle too) go into ``misses``."""
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-instr-") as tmp:
        folder, gw_port = Path(tmp), free_port()
        config = folder / "gw.yaml"
        doc = _gateway_config(gw_port, up_port, policy)
        doc["health"]["interval_s"] = 3600.0  # a probe every minute lands in some windows and not others
        config.write_text(json.dumps(doc))
        # Uninstrumented until it is ready (start-up under full instrumentation took over 10 min on a loaded
        # 2-core machine), then on before the warm-up: the measured windows are the same.
        out_file = f"--callgrind-out-file={folder}/cg.%p.out"
        valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", out_file]
        if drive.cache_sim:
            valgrind.append("--cache-sim=yes")
        argv = [*valgrind, *python("-c", _SERVE, "serve", "--config", str(config))]
        scripts = Scripts(folder) if drive.connections > 1 else None
        with child(argv, env=None if tree is None else checkout_env(tree), cwd=tree) as gw:
            wait_http(f"http://127.0.0.1:{gw_port}/readyz", timeout_s=1200.0, process=gw)
            url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
            runs: list[tuple[str, dict[str, int], float, int]] = []
            with httpx.Client(timeout=120.0) as client:
                _send(client, url, "new", "p", drive.prefill)  # the table's pins, uninstrumented
                on = ["callgrind_control", "-i", "on", str(gw.pid)]
                subprocess.run(on, check=True, capture_output=True)
                for k, path in enumerate(paths):
                    _send(client, url, path, f"w{k}", warmup)
                    if scripts is None:
                        work = functools.partial(_send, client, url, path, f"m{k}", requests)
                    else:
                        work = functools.partial(_wrk, scripts, url, path, drive)
                    runs.append((path, *_window(gw.pid, folder, work)))
            # Timers (health probes, the engine-signal scrapes) run on the wall clock, which valgrind slows:
            # their rate while idle is taken off each window's total.
            idle, idle_took, _ = _window(gw.pid, folder, functools.partial(_idle, idle_s))
            for path, events, took, sent in runs:
                net = {e: (n - idle.get(e, 0) / idle_took * took) / sent for e, n in events.items()}
                per = events["Ir"] / sent
                less = net["Ir"]
                print(f"  {policy} {path}: {per / 1e3:.1f}k raw, {less / 1e3:.1f}k less idle", flush=True)
                if drive.cache_sim:
                    row = {c: sum(net.get(e, 0.0) for e in names) for c, names in _MISSES.items()}
                    print(f"  {policy} {path}: misses per request less idle {row} ({sent} sent)", flush=True)
                    if misses is not None and (path not in out or net["Ir"] < out[path]):
                        misses[path] = row
                out[path] = min(net["Ir"], out.get(path, net["Ir"]))
            print(f"  {policy} idle: {idle['Ir'] / idle_took / 1e3:.0f}k instructions/s", flush=True)
        if keep is not None:  # the dumps, one per window in order (paths, then idle): callgrind_annotate them
            keep.mkdir(parents=True, exist_ok=True)
            for f in folder.glob("cg.*.out*"):
                shutil.copy2(f, keep / f.name)
    return out


def _wrk(scripts: Scripts, url: str, path: str, drive: Drive) -> int:
    return scripts.wrk(url, path, drive.connections, drive.seconds).requests


def _idle(seconds: float) -> int:
    time.sleep(seconds)
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_instructions", description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default="affinity,ttft")
    ap.add_argument("--paths", default="hit,new")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--idle", type=float, default=20.0, help="seconds idle, to take the timers' rate off")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="copy callgrind's dumps under this folder, one per row")
    ap.add_argument("--trees", default="", help="NAME=PATH,... : each checkout's gateway (default: this one)")
    ap.add_argument("--cache-sim", action="store_true", help="also D1 and LL data misses per request")
    ap.add_argument("--prefill", type=int, default=0, help="new conversations pinned before measuring")
    ap.add_argument("--connections", type=int, default=1, help="> 1: wrk at this many, for --seconds")
    ap.add_argument("--seconds", type=float, default=20.0, help="per window with --connections > 1")
    args = ap.parse_args(argv)
    drive = Drive(args.cache_sim, args.prefill, args.connections, args.seconds)
    policies, paths = args.policies.split(","), args.paths.split(",")
    shown = list(dict.fromkeys(paths))
    trees: dict[str, Path | None] = {"": None}
    if args.trees:
        try:
            trees = dict(checkouts([t for t in args.trees.split(",") if t.strip()]))
        except ValueError as err:
            ap.error(f"--trees {err}")
    up_port = free_port()
    results: dict[str, dict[str, float]] = {}
    misses: dict[str, dict[str, dict[str, float]]] = {}
    with child(upstream_argv(up_port)) as up:
        wait_http(f"http://127.0.0.1:{up_port}/", process=up)
        for policy in policies:
            for name, tree in trees.items():
                row = f"{name}:{policy}" if name else policy
                print(f"{row} ({tree or 'this checkout'})", flush=True)
                keep = None if args.keep is None else args.keep / row.replace(":", "-")
                misses[row] = {}
                results[row] = measure(
                    policy,
                    paths,
                    args.requests,
                    args.warmup,
                    args.idle,
                    up_port,
                    tree,
                    keep,
                    drive,
                    misses[row],
                )
                print(row, {p: f"{v / 1e3:.0f}k" for p, v in results[row].items()}, flush=True)
    base = next(iter(results.values()))
    how = f"{args.requests} requests" if args.connections == 1 else f"wrk {args.connections} connections"
    print(f"\ninstructions per request (callgrind, {how} after {args.warmup} warm-up, {args.prefill} pins)")
    width = max(12, *(len(r) + 2 for r in results))
    print("row".ljust(width) + "".join(p.rjust(16) for p in shown))
    for name, row in results.items():
        cells = "".join(f"{row[p] / 1e3:9.0f}k {row[p] / base[p]:4.2f}x" for p in shown)
        print(name.ljust(width) + cells)
    if args.cache_sim:
        print("\ndata misses per request less idle (D1: first level, LL: last level; reads + writes)")
        for name, row_misses in misses.items():
            cells = "".join(f"  {p}: D1 {m['D1']:.0f} LL {m['LL']:.1f}" for p, m in row_misses.items())
            print(name.ljust(width) + cells)
    if args.json is not None:
        doc = {"instructions": results, "misses": misses} if args.cache_sim else results
        args.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
