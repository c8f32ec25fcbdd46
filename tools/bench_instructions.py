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
from pathlib import Path

import httpx

from tools.bench_proxy import TOKEN_WIDTH, _gateway_config, render, upstream_argv
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


def _totals(folder: Path, pid: int, before: set[Path]) -> int:
    """The instruction total of the dump callgrind wrote since ``before`` (it writes them asynchronously)."""
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        for f in sorted(set(folder.glob(f"cg.{pid}.out*")) - before):
            m = re.search(r"^totals: (\d+)", f.read_text(errors="replace"), re.M)
            if m:
                return int(m.group(1))
        time.sleep(0.2)
    raise RuntimeError("callgrind wrote no dump")


def _send(client: httpx.Client, url: str, path: str, tag: str, n: int) -> None:
    for i in range(n):
        headers, body = render(path, f"{tag}{i:0{TOKEN_WIDTH - len(tag)}d}")
        client.post(url, content=body, headers=headers).raise_for_status()


def _window(pid: int, folder: Path, work: Callable[[], None]) -> tuple[int, float]:
    """Instructions the gateway ran while ``work`` ran, and the seconds it took."""
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    before, start = set(folder.glob(f"cg.{pid}.out*")), time.monotonic()
    work()
    took = time.monotonic() - start
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    return _totals(folder, pid, before), took


def measure(
    policy: str,
    paths: list[str],
    requests: int,
    warmup: int,
    idle_s: float,
    up_port: int,
    tree: Path | None = None,
    keep: Path | None = None,
) -> dict[str, float]:
    """Instructions per request per path (a path asked twice: its cheaper run), less the idle rate's share."""
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
        argv = [*valgrind, *python("-c", _SERVE, "serve", "--config", str(config))]
        with child(argv, env=None if tree is None else checkout_env(tree), cwd=tree) as gw:
            wait_http(f"http://127.0.0.1:{gw_port}/readyz", timeout_s=1200.0, process=gw)
            subprocess.run(["callgrind_control", "-i", "on", str(gw.pid)], check=True, capture_output=True)
            url = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
            runs: list[tuple[str, int, float]] = []
            with httpx.Client(timeout=120.0) as client:
                for k, path in enumerate(paths):
                    _send(client, url, path, f"w{k}", warmup)
                    total, took = _window(
                        gw.pid, folder, functools.partial(_send, client, url, path, f"m{k}", requests)
                    )
                    runs.append((path, total, took))
            # Timers (health probes, the engine-signal scrapes) run on the wall clock, which valgrind slows:
            # their rate while idle is taken off each window's total.
            idle, idle_took = _window(gw.pid, folder, functools.partial(time.sleep, idle_s))
            rate = idle / idle_took
            for path, total, took in runs:
                per, net = total / requests, (total - rate * took) / requests
                print(f"  {policy} {path}: {per / 1e3:.1f}k raw, {net / 1e3:.1f}k less idle", flush=True)
                out[path] = min(net, out.get(path, net))
            print(f"  {policy} idle: {rate / 1e3:.0f}k instructions/s", flush=True)
        if keep is not None:  # the dumps, one per window in order (paths, then idle): callgrind_annotate them
            keep.mkdir(parents=True, exist_ok=True)
            for f in folder.glob("cg.*.out*"):
                shutil.copy2(f, keep / f.name)
    return out


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
    args = ap.parse_args(argv)
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
    with child(upstream_argv(up_port)) as up:
        wait_http(f"http://127.0.0.1:{up_port}/", process=up)
        for policy in policies:
            for name, tree in trees.items():
                row = f"{name}:{policy}" if name else policy
                print(f"{row} ({tree or 'this checkout'})", flush=True)
                keep = None if args.keep is None else args.keep / row.replace(":", "-")
                results[row] = measure(
                    policy, paths, args.requests, args.warmup, args.idle, up_port, tree, keep
                )
                print(row, {p: f"{v / 1e3:.0f}k" for p, v in results[row].items()}, flush=True)
    base = next(iter(results.values()))
    print(f"\ninstructions per request (callgrind, {args.requests} requests after {args.warmup} warm-up)")
    width = max(12, *(len(r) + 2 for r in results))
    print("row".ljust(width) + "".join(p.rjust(16) for p in shown))
    for name, row in results.items():
        cells = "".join(f"{row[p] / 1e3:9.0f}k {row[p] / base[p]:4.2f}x" for p in shown)
        print(name.ljust(width) + cells)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
