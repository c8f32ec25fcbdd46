"""Proxy overhead benchmark (not a test): a fast local upstream, direct vs through one gateway worker.

    python -m tools.bench_proxy [--seconds 10] [--concurrency 32]

Each piece runs in its own process on 127.0.0.1: the upstream (a minimal ASGI app answering a fixed chat
completion), the gateway (one uvicorn worker, affinity policy, in-memory state) and the load generator (wrk
when installed, else a Python client, which is slower and makes the numbers pessimistic). Reports:

- added latency at 1 concurrent request: p50/p99 through the gateway minus direct;
- throughput at N concurrent requests, and the gateway's CPU time per request (from /proc, user+system).

On a 2-core machine the three processes share the cores, so throughput is a lower bound.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tools.bench_report import percentile
from tools.procs import child, free_port, python, wait_http

BODY = {
    "model": "bench",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
}
_ANSWER = json.dumps(
    {
        "id": "x",
        "object": "chat.completion",
        "created": 0,
        "model": "bench",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()


async def upstream_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """The fastest honest upstream: read the body, answer a fixed completion."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        more = (await receive()).get("more_body", False)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(_ANSWER)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": _ANSWER})


@dataclass
class Run:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


def upstream_argv(port: int) -> list[str]:
    """``upstream_app`` under uvicorn on 127.0.0.1:``port``, quiet (the other benchmarks use it too)."""
    app = "tools.bench_proxy:upstream_app"
    return python("-m", "uvicorn", app, "--port", str(port), "--no-access-log", "--log-level", "warning")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, connections: int, seconds: float, body_file: str) -> Run:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as script:
        script.write(
            'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
            f'local f = io.open("{body_file}")\nwrk.body = f:read("*a")\nf:close()\n'
        )
    cmd = [
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--latency",
        "-s",
        script.name,
        url,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    os.unlink(script.name)
    total = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    duration = float(re.search(r"requests in ([\d.]+)s", out).group(1))  # type: ignore[union-attr]
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errors:
        raise RuntimeError(f"wrk saw {errors.group(1)} errors:\n{out}")
    return Run(total, duration, _pct(out, "50%"), _pct(out, "99%"))


def _pct(out: str, label: str) -> float:
    m = re.search(rf"{label}\s+([\d.]+)(us|ms|s)", out)
    assert m, out
    scale = {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]
    return float(m.group(1)) * scale


def python_sequential(url: str, seconds: float) -> Run:
    """Fallback when wrk is missing: one connection, one request at a time."""
    lat: list[float] = []
    with httpx.Client() as client:
        end = time.monotonic() + seconds
        start = time.monotonic()
        while time.monotonic() < end:
            t = time.perf_counter()
            client.post(url, json=BODY).raise_for_status()
            lat.append((time.perf_counter() - t) * 1e3)
        took = time.monotonic() - start
    p50, p99 = percentile(lat, 50), percentile(lat, 99)
    assert p50 is not None and p99 is not None, "no request finished"
    return Run(len(lat), took, p50, p99)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_proxy", description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk not found (apt-get install wrk): throughput is skipped, latency uses a Python client")
    up_port, gw_port = free_port(), free_port()
    tmp_dir = tempfile.TemporaryDirectory(prefix="bench-proxy-", ignore_cleanup_errors=True)
    with tmp_dir as tmp, contextlib.ExitStack() as children:  # children stop first, gateway before upstream
        up = children.enter_context(child(upstream_argv(up_port)))
        config = Path(tmp, "gw.yaml")
        config.write_text(
            json.dumps(
                {
                    "server": {"port": gw_port, "log_level": "warning"},
                    "backends": [{"id": "up", "url": f"http://127.0.0.1:{up_port}", "models": ["bench"]}],
                    "health": {"interval_s": 60},
                }
            )
        )
        gw = children.enter_context(child(python("-m", "gateway.cli", "serve", "--config", str(config))))
        direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
        through = f"http://127.0.0.1:{gw_port}/v1/chat/completions"
        wait_http(f"http://127.0.0.1:{up_port}/", process=up)
        wait_http(f"http://127.0.0.1:{gw_port}/readyz", process=gw)
        body_file = Path(tmp, "body.json")
        body_file.write_text(json.dumps(BODY))
        _report(args, direct, through, gw.pid, str(body_file))
    return 0


def _report(args: argparse.Namespace, direct: str, through: str, gw_pid: int, body_file: str) -> None:
    have_wrk = shutil.which("wrk") is not None
    secs, rounds = args.seconds, args.rounds
    print(f"upstream: minimal ASGI app, fixed {len(_ANSWER)}-byte chat completion, non-streaming")
    print("gateway: 1 uvicorn worker, affinity policy, in-memory state; all on 127.0.0.1")
    print(f"{rounds} rounds of {secs:g} s each, direct and gateway interleaved; medians over rounds\n")

    def sequential(url: str) -> Run:
        return wrk(url, 1, secs, body_file) if have_wrk else python_sequential(url, secs)

    if have_wrk:
        wrk(through, 4, 2, body_file)  # warm connection pools and code paths
    d1, g1 = _interleaved(rounds, lambda: sequential(direct), lambda: sequential(through))
    print("1 concurrent request (sequential):")
    print(_line("direct", d1, 3))
    print(_line("gateway", g1, 3))
    added = [g.p50_ms - d.p50_ms for d, g in zip(d1, g1, strict=True)]
    added99 = [g.p99_ms - d.p99_ms for d, g in zip(d1, g1, strict=True)]
    print(f"  added    p50 {statistics.median(added):.3f} ms  p99 {statistics.median(added99):.3f} ms")
    if not have_wrk:
        return
    n = args.concurrency
    cpu: list[float] = []

    def through_measured() -> Run:
        cpu0 = cpu_seconds(gw_pid)
        run = wrk(through, n, secs, body_file)
        cpu.append((cpu_seconds(gw_pid) - cpu0) / run.requests * 1e3)
        return run

    dn, gn = _interleaved(rounds, lambda: wrk(direct, n, secs, body_file), through_measured)
    print(f"\n{n} concurrent requests:")
    print(_line("direct", dn, 2))
    print(_line("gateway", gn, 2))
    per_round = ", ".join(f"{c:.3f}" for c in cpu)
    print(f"  gateway CPU per request {statistics.median(cpu):.3f} ms (rounds: {per_round})")


def _line(label: str, runs: list[Run], digits: int) -> str:
    p50, p99, rps = _med(runs, "p50_ms"), _med(runs, "p99_ms"), _med(runs, "rps")
    return f"  {label:<8} {rps:>8,.0f} req/s  p50 {p50:.{digits}f} ms  p99 {p99:.{digits}f} ms"


def _interleaved(
    rounds: int, first: Callable[[], Run], second: Callable[[], Run]
) -> tuple[list[Run], list[Run]]:
    a: list[Run] = []
    b: list[Run] = []
    for _ in range(rounds):
        a.append(first())
        b.append(second())
    return a, b


def _med(runs: list[Run], attr: str) -> float:
    return statistics.median(float(getattr(r, attr)) for r in runs)


if __name__ == "__main__":
    raise SystemExit(main())
