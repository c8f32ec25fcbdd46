"""Proxy overhead benchmark (not a test): a fast local upstream, direct vs through one gateway worker.

    python -m tools.bench_proxy [--paths hit,new] [--seconds 5] [--rounds 3] [--concurrency 32] [--json F]
    python -m tools.bench_proxy --simultaneous --pin --gateways old=../old:affinity,old2=../old:affinity,\
        new=.:affinity,ttft=.:ttft

Each piece runs in its own process on 127.0.0.1: the upstream (a minimal ASGI app answering a fixed chat
completion), the gateway (one uvicorn worker, ``--policy``: ttft by default, in-memory state) and the load
generator (wrk when installed, else a Python client at 1 connection only, which is slower and makes the
numbers pessimistic). Every request body has the same size (a ~300-byte system prompt and a ~200-byte first
user message, built per request by a wrk Lua script); the paths differ in what makes the conversation:

- ``hit``: one conversation, every request an affinity hit (only the OpenAI ``user`` field varies);
- ``new``: every request a new conversation: a distinct first user message, no session header, so the
  gateway hashes the head (``chat_key``) and claims a pin: what every real conversation's placement costs;
  (every body is a second turn, ``TURN_TWO``, so the two paths have one template and one size);
- ``new-session``: the hit body with a distinct ``x-session-id`` per request (``session_key``, no hashing).

Per path: added latency at 1 connection (p50/p99 through the gateway minus direct, round by round) and
throughput, latency and the gateway's CPU per request (/proc, user+system) at N connections; direct and
gateway interleaved for ``--rounds`` rounds, medians quoted. After each path: the gateway's RSS, its
affinity entries (if /readyz shows them), its routing decisions (a check that the path really was all hits
or all claims) and, per run, its garbage-collector pauses (``gc.callbacks`` installed by a wrapper around
the same ``warmroute serve``, read back on SIGUSR1; ``--no-gc-probe`` runs the plain command).

``--trees old=../other-checkout,new=.``: one gateway per checkout (its code first on ``PYTHONPATH``, this
venv's packages), each round running direct and then every gateway, so two commits are compared in one run
(a table per checkout, then their CPU per request side by side; no GC probe in this mode). ``--policy
affinity,ttft`` likewise runs one gateway per policy (per checkout, with ``--trees``).

``--simultaneous`` measures only the gateways' CPU per request, and compares them: every gateway is loaded
at the same time by its own wrk at the same settings for ``--rounds`` short rounds (default 20 of 2 s; the
wrk started first rotates), and each round gives each gateway's CPU per request over the first gateway's;
the report is the median of those ratios with their quartiles, plus /proc/stat's shares per round.
``--pin`` puts every gateway on one CPU and the upstream, wrk and this process on the others: a shared VM's
vCPUs change speed by ~10 % within a second, each on its own, so only gateways on the same CPU at the same
time see the same machine. ``--gateways NAME=PATH:POLICY,...`` names exactly the gateways to run; a
checkout twice under two names is an A/A pair, whose ratio shows what the run can resolve.

On a 2-core machine the three processes share the cores, so throughput is a lower bound, and a machine
shared with other work makes every number noisy: compare direct vs gateway and path vs path in one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from tools.bench_memory import GcPauses, conversation_body, rss_bytes
from tools.bench_proxy_report import (
    NEW_REASONS,
    PathResult,
    Run,
    TogetherResult,
    medians,
    path_lines,
    table,
    targets,
    together_lines,
    together_summary,
)
from tools.bench_report import percentile
from tools.procs import checkout_env, checkouts, child, free_port, python, wait_http

#: The small body ``tools.bench_upstream`` sends (this benchmark sends ``conversation_body`` instead).
BODY = {
    "model": "bench",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
}
PATHS = ("hit", "new", "new-session")
SESSION_HEADER = "x-session-id"  # RoutingConfig.session_header's default
TOKEN_WIDTH = 16  # the Lua script's "%4s%02d%010d": run tag, wrk thread, request counter
HIT_TOKEN = "conversation-one"  # ends the first message on the hit and new-session paths
KEY_SLOT, USER_SLOT = "@KEY@", "@USER@"
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

# Fills the template's two slots per request (``render`` is its Python twin; a test holds them equal). One
# Lua state per wrk thread: setup() numbers the threads, so tokens are unique across threads and, with the
# run tag, across runs. done() prints one parseable line.
_LUA = r"""
local tag, mode, fixed, head, middle, tail
local counter, next_thread = 0, 0
local headers = {["Content-Type"] = "application/json"}
function setup(thread)
  thread:set("thread_id", next_thread)
  next_thread = next_thread + 1
end
function init(args)
  tag, mode, fixed = args[1], args[2], args[4]
  local f = assert(io.open(args[3], "rb"))
  local t = f:read("*a")
  f:close()
  local k, u = string.find(t, "@KEY@", 1, true), string.find(t, "@USER@", 1, true)
  head, middle, tail = t:sub(1, k - 1), t:sub(k + 5, u - 1), t:sub(u + 6)
end
function request()
  counter = counter + 1
  local token = string.format("%4s%02d%010d", tag, thread_id or 0, counter)
  if mode == "new-session" then headers["x-session-id"] = token end
  local key = (mode == "new") and token or fixed
  return wrk.format("POST", nil, headers, head .. key .. middle .. token .. tail)
end
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH requests=%d duration_us=%d connect=%d read=%d write=%d status=%d timeout=%d " ..
    "p50_us=%.0f p90_us=%.0f p99_us=%.0f p999_us=%.0f max_us=%.0f\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency:percentile(99.9),
    latency.max))
end
"""


#: Every body is a conversation's second turn (a reply, then the next user message): under the ttft policy
#: an identical first turn sent again is a twin of an identical head, a new conversation, not a hit.
TURN_TWO = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go on"}]


def template() -> str:
    body = conversation_body(KEY_SLOT, USER_SLOT)
    body["messages"] = [*body["messages"], *TURN_TWO]
    text = json.dumps(body)
    assert text.index(KEY_SLOT) < text.index(USER_SLOT), "the Lua script fills the key slot first"
    return text


def render(path: str, token: str) -> tuple[dict[str, str], bytes]:
    """Headers and body of the request the Lua script sends on ``path`` with ``token`` (the same bytes)."""
    assert path in PATHS and len(token) == TOKEN_WIDTH, (path, token)
    headers = {"content-type": "application/json"}
    if path == "new-session":
        headers[SESSION_HEADER] = token
    key = token if path == "new" else HIT_TOKEN
    return headers, template().replace(KEY_SLOT, key).replace(USER_SLOT, token).encode()


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


def probed_gateway(argv: list[str]) -> int:
    """``warmroute serve`` (``argv[1:]``) with ``GcPauses`` installed; SIGUSR1 writes the pauses since the
    last signal to ``argv[0]`` as JSON (with a sequence number, replaced atomically) and starts afresh."""
    from gateway.cli import main as gateway_main

    out, probe, seq = Path(argv[0]), GcPauses().install(), [0]

    def dump(_sig: int, _frame: FrameType | None) -> None:
        seq[0] += 1
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"seq": seq[0], **probe.snapshot()}))
        os.replace(tmp, out)
        probe.reset()

    signal.signal(signal.SIGUSR1, dump)
    return gateway_main(argv[1:])


_PROBED = "import sys; from tools.bench_proxy import probed_gateway; sys.exit(probed_gateway(sys.argv[1:]))"


@dataclass
class Gateway:
    """The gateway under test, seen from outside: /proc, /readyz, /metrics and the GC probe's file."""

    pid: int
    base: str
    gc_file: Path | None
    _seq: int = 0

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.pid)

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid)

    def entries(self) -> int | None:
        """/readyz's shared_state.entries, if it shows them (the memory store's status() has them)."""
        found = httpx.get(self.base + "/readyz").json().get("shared_state", {}).get("entries")
        return found if isinstance(found, int) else None

    def decisions(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics").text
        pattern = r'^warmroute_routing_decisions_total\{reason="(\w+)"\} ([\d.e+]+)$'
        return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}

    def gc_pauses(self) -> dict[str, dict[str, float]] | None:
        """The collections since the previous call (None without the probe)."""
        if self.gc_file is None:
            return None
        self._seq += 1
        os.kill(self.pid, signal.SIGUSR1)
        # The answer waits only on the gateway's event loop reaching the signal: generous, so a machine busy
        # with other work is never read as a missing probe; a gateway that died is told at once.
        deadline = time.monotonic() + 120.0
        while time.monotonic() < deadline:
            if not Path(f"/proc/{self.pid}").exists():
                raise RuntimeError("the gateway exited before its GC probe answered SIGUSR1")
            with contextlib.suppress(FileNotFoundError, ValueError):
                doc: dict[str, Any] = json.loads(self.gc_file.read_text())
                if doc["seq"] == self._seq:
                    return {k: v for k, v in doc.items() if k != "seq"}
            time.sleep(0.01)
        raise RuntimeError("the gateway's GC probe did not answer SIGUSR1")


def upstream_argv(port: int) -> list[str]:
    """``upstream_app`` under uvicorn on 127.0.0.1:``port``, quiet (the other benchmarks use it too)."""
    app = "tools.bench_proxy:upstream_app"
    return python("-m", "uvicorn", app, "--port", str(port), "--no-access-log", "--log-level", "warning")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Scripts:
    """The Lua script and the body template on disk, and a run counter that tags every run's tokens."""

    folder: Path
    runs: int = 0

    def __post_init__(self) -> None:
        (self.folder / "bench.lua").write_text(_LUA)
        (self.folder / "template.json").write_text(template())

    def command(self, url: str, path: str, connections: int, seconds: float) -> list[str]:
        """The wrk command line of one run (a fresh run tag each call)."""
        self.runs += 1
        script, body = self.folder / "bench.lua", self.folder / "template.json"
        args = [f"{self.runs % 10_000:04d}", path, str(body), HIT_TOKEN]
        duration = f"-d{max(1, round(seconds))}s"
        return ["wrk", "-t1", f"-c{connections}", duration, "-s", str(script), url, "--", *args]

    def wrk(self, url: str, path: str, connections: int, seconds: float) -> Run:
        cmd = self.command(url, path, connections, seconds)
        return wrk_run(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)

    def wrk_together(self, urls: list[str], path: str, connections: int, seconds: float) -> list[Run]:
        """One wrk per URL, all started at once (in the order given), each at the same settings."""
        cmds = [self.command(url, path, connections, seconds) for url in urls]
        procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in cmds]
        outs = [p.communicate() for p in procs]
        for p, (out, err) in zip(procs, outs, strict=True):
            if p.returncode:
                raise RuntimeError(f"wrk exited with {p.returncode}:\n{out}{err}")
        return [wrk_run(out) for out, _ in outs]


def wrk_run(out: str) -> Run:
    """The Lua script's done() line as a Run (a RuntimeError for non-2xx answers)."""
    m = re.search(r"^BENCH (.*)$", out, re.M)
    assert m, out
    v = {k: float(x) for k, x in (kv.split("=") for kv in m.group(1).split())}
    if v["status"]:
        raise RuntimeError(f"wrk saw {v['status']:.0f} non-2xx responses:\n{out}")
    errors = int(v["connect"] + v["read"] + v["write"] + v["timeout"])
    ms = {k: v[f"{k}_us"] / 1e3 for k in ("p50", "p99", "p999", "max")}
    return Run(
        int(v["requests"]), v["duration_us"] / 1e6, ms["p50"], ms["p99"], ms["p999"], ms["max"], errors
    )


def python_sequential(url: str, path: str, seconds: float) -> Run:
    """Fallback when wrk is missing: one connection, one request at a time, the same bodies."""
    lat: list[float] = []
    tag = f"py{os.getpid() % 100:02d}"
    with httpx.Client() as client:
        end = time.monotonic() + seconds
        start = time.monotonic()
        while time.monotonic() < end:
            headers, body = render(path, f"{tag}{time.monotonic_ns() % 10**12:012d}")
            t = time.perf_counter()
            client.post(url, content=body, headers=headers).raise_for_status()
            lat.append((time.perf_counter() - t) * 1e3)
        took = time.monotonic() - start
    p50, p99 = percentile(lat, 50), percentile(lat, 99)
    assert p50 is not None and p99 is not None, "no request finished"
    return Run(len(lat), took, p50, p99)


@dataclass
class Bench:
    scripts: Scripts | None  # None: no wrk, the Python client at 1 connection only
    direct: str
    gateways: dict[
        str, tuple[str, Gateway]
    ]  # name -> (its URL, the process): one, or one per --trees checkout
    seconds: float
    rounds: int
    concurrency: int

    def run(self, url: str, path: str, connections: int, gateway: Gateway | None = None) -> Run:
        if gateway is not None:
            gateway.gc_pauses()  # starts the probe's count afresh
            cpu0 = gateway.cpu_seconds()
        if self.scripts is None:
            run = python_sequential(url, path, self.seconds)
        else:
            run = self.scripts.wrk(url, path, connections, self.seconds)
        if gateway is not None:
            run.cpu_us_per_request = (gateway.cpu_seconds() - cpu0) / run.requests * 1e6
            run.gc = gateway.gc_pauses()
        return run

    def path(self, path: str) -> dict[str, PathResult]:
        """One result per gateway; every round runs direct, then each gateway in turn (the same direct runs
        are every gateway's reference)."""
        results = {name: PathResult(path) for name in self.gateways}
        before = {name: gw.decisions() for name, (_, gw) in self.gateways.items()}
        for n in [1] if self.scripts is None else [1, self.concurrency]:
            direct: list[Run] = []
            through: dict[str, list[Run]] = {name: [] for name in self.gateways}
            for _ in range(self.rounds):  # interleaved: a slow spell on the machine hits every side
                direct.append(self.run(self.direct, path, n))
                for name, (url, gw) in self.gateways.items():
                    through[name].append(self.run(url, path, n, gw))
            for name, result in results.items():
                (result.sequential if n == 1 else result.concurrent).update(
                    {"direct": direct, "gateway": through[name]}
                )
        for name, (_, gw) in self.gateways.items():
            result, after, was = results[name], gw.decisions(), before[name]
            result.decisions = {k: v - was.get(k, 0.0) for k, v in after.items() if v > was.get(k, 0.0)}
            result.claims_so_far = sum(after.get(reason, 0.0) for reason in NEW_REASONS)
            result.rss_after_bytes, result.entries_after = gw.rss_bytes(), gw.entries()
        return results

    def together(self, path: str) -> TogetherResult:
        """Every gateway loaded at the same time, each by its own wrk at the same settings, for ``rounds``
        rounds: each round's CPU per request of one gateway over another's compares two gateways that saw
        the same seconds of the machine. The wrk started first rotates from round to round."""
        assert self.scripts is not None, "--simultaneous needs wrk"
        names = list(self.gateways)
        result = TogetherResult(path, runs={name: [] for name in names})
        before = {name: gw.decisions() for name, (_, gw) in self.gateways.items()}
        for k in range(self.rounds):
            order = names[k % len(names) :] + names[: k % len(names)]
            cpu0 = {name: gw.cpu_seconds() for name, (_, gw) in self.gateways.items()}
            stat0 = proc_stat()
            urls = [self.gateways[name][0] for name in order]
            runs = self.scripts.wrk_together(urls, path, self.concurrency, self.seconds)
            result.machine.append(shares(stat0, proc_stat()))
            for name, run in zip(order, runs, strict=True):
                used = self.gateways[name][1].cpu_seconds() - cpu0[name]
                # None for a round it answered nothing in (a machine busy with other work): no ratio then
                run.cpu_us_per_request = used / run.requests * 1e6 if run.requests else None
                result.runs[name].append(run)
            result.first.append(order[0])
        for name, (_, gw) in self.gateways.items():
            after, was = gw.decisions(), before[name]
            result.decisions[name] = {k: v - was.get(k, 0.0) for k, v in after.items() if v > was.get(k, 0.0)}
        return result


#: /proc/stat's cpu line, in order (the kernel's names).
_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def proc_stat() -> dict[str, int]:
    """The whole machine's CPU time so far, in ticks, per /proc/stat field."""
    line = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    assert line[0] == "cpu", line
    return dict(zip(_STAT_FIELDS, map(int, line[1 : 1 + len(_STAT_FIELDS)]), strict=True))


def shares(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """What the machine did between two ``proc_stat`` readings: the share of all its CPU time that was
    user, nice (other work at a lower priority), system, idle and steal (the hypervisor's)."""
    delta = {k: after[k] - before[k] for k in before}
    total = sum(delta.values()) or 1
    return {k: delta[k] / total for k in ("user", "nice", "system", "idle", "steal")}


_DESCRIPTIONS = {
    "hit": "one conversation: every request an affinity hit",
    "new": "every request a new conversation: distinct first user message, no session header",
    "new-session": "every request a new x-session-id (session_key: no hashing), the hit body",
}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    have_wrk = shutil.which("wrk") is not None
    if not have_wrk:
        print("wrk not found (apt-get install wrk): throughput is skipped, latency uses a Python client")
    up_port = free_port()
    pinned = args.pinned = _pin_plan(args.pin)
    if pinned is not None:  # every child inherits the rest; the gateways move to their CPU once started
        os.sched_setaffinity(0, pinned[1])
    tmp_dir = tempfile.TemporaryDirectory(prefix="bench-proxy-", ignore_cleanup_errors=True)
    with tmp_dir as tmp, contextlib.ExitStack() as children:  # children stop first, gateways before upstream
        up = children.enter_context(child(upstream_argv(up_port)))
        wait_http(f"http://127.0.0.1:{up_port}/", process=up)
        gateways: dict[str, tuple[str, Gateway]] = {}
        for name, tree, policy in args.specs:
            gw_port = free_port()
            config = Path(tmp, f"gw-{len(gateways)}.yaml")
            config.write_text(json.dumps(_gateway_config(gw_port, up_port, policy)))
            gc_file = Path(tmp, f"gc-{len(gateways)}.json") if args.gc_probe else None
            env = None if tree is None else checkout_env(tree)
            gw_proc = children.enter_context(child(_gateway_argv(config, gc_file), env=env, cwd=tree))
            wait_http(f"http://127.0.0.1:{gw_port}/readyz", process=gw_proc)
            if pinned is not None:
                pin(gw_proc.pid, pinned[0])
            gw = Gateway(gw_proc.pid, f"http://127.0.0.1:{gw_port}", gc_file)
            gateways[name] = (f"http://127.0.0.1:{gw_port}/v1/chat/completions", gw)
        direct = f"http://127.0.0.1:{up_port}/v1/chat/completions"
        scripts = Scripts(Path(tmp)) if have_wrk else None
        doc = _run(Bench(scripts, direct, gateways, args.seconds, args.rounds, args.concurrency), args)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2))
        print(f"\nwrote {args.json}")
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="bench_proxy", description=__doc__.splitlines()[0])
    ap.add_argument("--paths", default="hit,new", help=f"comma-separated, in order, from {','.join(PATHS)}")
    ap.add_argument(
        "--seconds", type=float, help="per run (wrk rounds to whole seconds); 5, or 2 with --simultaneous"
    )
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, help="3, or 20 with --simultaneous")
    ap.add_argument(
        "--simultaneous",
        action="store_true",
        help="CPU per request only: every gateway (2 or more: --trees and/or --policy) loaded at the same "
        "time by its own wrk, --rounds short rounds; per round each gateway's CPU per request over the first "
        "one's, reported as the median of those ratios with their quartiles",
    )
    ap.add_argument(
        "--policy",
        default="ttft",
        help="the gateway's routing policy (ttft, affinity, ...); comma-separated: one gateway per policy",
    )
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--no-gc-probe", dest="gc_probe", action="store_false", help="plain `warmroute serve`")
    ap.add_argument(
        "--trees",
        default="",
        help="NAME=PATH,...: one gateway per checkout (its code first on PYTHONPATH, this venv), interleaved "
        "in every round; no GC probe (it imports this checkout's tools)",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="every gateway on one CPU (this machine's last), the upstream, wrk and this process on the "
        "others: with --simultaneous the gateways share one CPU's speed, which moves on a shared VM",
    )
    ap.add_argument(
        "--gateways",
        default="",
        help="NAME=PATH:POLICY,...: exactly these gateways (instead of --trees x --policy); a checkout may "
        "appear twice under two names (an A/A pair in the same run)",
    )
    args = ap.parse_args(argv)
    try:
        trees = checkouts([t for t in args.trees.split(",") if t.strip()])
    except ValueError as err:
        ap.error(f"--trees {err}")
    args.trees = trees
    args.policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    if not args.policies or len(set(args.policies)) != len(args.policies):
        ap.error(f"--policy: distinct names (got {args.policy!r})")
    args.specs = _gateways(trees, args.policies)
    if args.gateways.strip():
        if trees:
            ap.error("--gateways replaces --trees: name one of them")
        try:
            args.specs = _named_gateways(args.gateways)
        except ValueError as err:
            ap.error(f"--gateways {err}")
        trees = args.trees = {name: tree for name, tree, _ in args.specs if tree is not None}
        args.policies = sorted({policy for _, _, policy in args.specs})
    if trees or args.simultaneous:
        args.gc_probe = False
    if args.rounds is None:
        args.rounds = 20 if args.simultaneous else 3
    if args.seconds is None:
        args.seconds = 2.0 if args.simultaneous else 5.0
    if args.simultaneous and len(args.specs) < 2:
        ap.error("--simultaneous compares gateways: name 2 or more (--trees, --policy or --gateways)")
    if args.pin and len(os.sched_getaffinity(0)) < 2:
        ap.error("--pin needs 2 or more CPUs")
    if args.simultaneous and shutil.which("wrk") is None:
        ap.error("--simultaneous needs wrk")
    args.paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not args.paths or set(args.paths) - set(PATHS) or len(set(args.paths)) != len(args.paths):
        ap.error(f"--paths: distinct names from {', '.join(PATHS)} (got {args.paths})")
    if args.rounds < 1 or args.concurrency < 1:
        ap.error("--rounds and --concurrency must be >= 1")
    return args


def _gateways(trees: dict[str, Path], policies: list[str]) -> list[tuple[str, Path | None, str]]:
    """(name, checkout or None for this one, policy) per gateway: every checkout with every policy."""
    out: list[tuple[str, Path | None, str]] = []
    checkouts: dict[str, Path | None] = {"": None} if not trees else dict(trees)
    for tree_name, tree in checkouts.items():
        for policy in policies:
            parts = [part for part in (tree_name, policy if len(policies) > 1 else "") if part]
            out.append((":".join(parts) or "gateway", tree, policy))
    return out


def _named_gateways(spec: str) -> list[tuple[str, Path | None, str]]:
    """``NAME=PATH:POLICY,...`` as (name, checkout, policy); ValueError for a malformed one."""
    out: list[tuple[str, Path | None, str]] = []
    for item in (part.strip() for part in spec.split(",") if part.strip()):
        where, sep, policy = item.rpartition(":")
        if not sep or not policy:
            raise ValueError(f"expects NAME=PATH:POLICY items, got {item!r}")
        tree = checkouts([where])  # NAME=PATH, checked like --trees
        ((name, path),) = tree.items()
        if name in {n for n, _, _ in out}:
            raise ValueError(f"repeats the name {name!r}")
        out.append((name, path, policy))
    return out


def _pin_plan(wanted: bool) -> tuple[set[int], set[int]] | None:
    """``--pin``: (the gateways' CPU, everything else's CPUs) from the CPUs this process may use."""
    if not wanted:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return {cpus[-1]}, set(cpus[:-1])


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (threads it starts later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)


def _gateway_argv(config: Path, gc_file: Path | None) -> list[str]:
    serve = ("serve", "--config", str(config))
    if gc_file is None:
        return python("-m", "gateway.cli", *serve)
    return python("-c", _PROBED, str(gc_file), *serve)


def _gateway_config(gw_port: int, up_port: int, policy: str = "ttft") -> dict[str, Any]:
    return {
        "server": {"port": gw_port, "log_level": "warning"},
        "backends": [{"id": "up", "url": f"http://127.0.0.1:{up_port}", "models": ["bench"]}],
        "health": {"interval_s": 60},
        "routing": {"policy": policy},
    }


def _run(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    sizes = {len(render(p, "0" * TOKEN_WIDTH)[1]) for p in PATHS}
    assert len(sizes) == 1, f"bodies differ in size between paths: {sizes}"
    probe = ", GC probe on" if args.gc_probe else ""
    names = list(bench.gateways)
    print(f"upstream: minimal ASGI app, fixed {len(_ANSWER)}-byte chat completion, non-streaming")
    print(
        f"gateway: 1 uvicorn worker, {','.join(args.policies)} policy, in-memory state{probe};"
        " all on 127.0.0.1"
    )
    multi = len(names) > 1
    if args.trees:
        print("checkouts, one gateway each: " + ", ".join(f"{n}={p}" for n, p in args.trees.items()))
    print(
        f"request body: {min(sizes)} bytes on every path; {args.rounds} rounds of {args.seconds:g} s a run;"
    )
    if args.simultaneous:
        print(
            f"--simultaneous: every gateway loaded at once, its own wrk at {args.concurrency} connections; "
            "per round CPU per request over the first gateway's"
        )
    else:
        print(
            "direct and gateway interleaved; medians over rounds. A shared machine makes every number noisy."
        )
    if args.pinned is not None:
        gw_cpus, rest = args.pinned
        print(f"--pin: every gateway on CPU {sorted(gw_cpus)}, upstream and wrk on CPU {sorted(rest)}")
    rss_start = {name: gw.rss_bytes() for name, (_, gw) in bench.gateways.items()}
    if bench.scripts is not None:
        for url, _ in bench.gateways.values():
            bench.scripts.wrk(url, "hit", 4, min(2.0, args.seconds))  # warm pools and code paths
    doc: dict[str, Any] = {
        "config": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("trees", "pinned", "specs")
        },
        "wrk": bench.scripts is not None,
        "body_bytes": min(sizes),
    }
    if args.simultaneous:
        return {**doc, **_together(bench, args)}
    results: dict[str, list[PathResult]] = {name: [] for name in names}
    for path in args.paths:
        print(f"\n[{path}] {_DESCRIPTIONS[path]}")
        for name, result in bench.path(path).items():
            results[name].append(result)
            print((f"  ({name})\n" if multi else "") + path_lines(result, args.concurrency))
    docs: dict[str, Any] = {}
    for name in names:
        print(
            ("\n" + f"== {name}" if multi else "")
            + "\n"
            + table(results[name], rss_start[name], args.concurrency)
        )
        one: dict[str, Any] = {
            "gateway_rss_start_bytes": rss_start[name],
            "paths": {r.path: {**asdict(r), "medians": medians(r)} for r in results[name]},
        }
        one["targets"], lines = targets(one["paths"])
        print("\n".join(lines))
        docs[name] = one
    if not multi:
        return {**doc, **docs[names[0]]}
    doc["trees"] = {name: str(path) for name, path in args.trees.items()}
    doc["gateways"] = docs
    print("\n" + _compare(results, args.concurrency))
    return doc


def _together(bench: Bench, args: argparse.Namespace) -> dict[str, Any]:
    """``--simultaneous``: per path the runs of every gateway, round by round, and the ratio summary."""
    names = list(bench.gateways)
    base = names[0]
    print(f"ratios: CPU per request over {base}'s in the same round; median of {args.rounds} rounds, IQR")
    paths: dict[str, Any] = {}
    for path in args.paths:
        print(f"\n[{path}] {_DESCRIPTIONS[path]}")
        result = bench.together(path)
        print(together_lines(result, base))
        paths[path] = {**asdict(result), "summary": together_summary(result, base)}
    specs = {name: {"tree": str(tree or Path.cwd()), "policy": policy} for name, tree, policy in args.specs}
    out: dict[str, Any] = {"simultaneous": {"base": base, "gateways": specs, "paths": paths}}
    if args.trees:
        out["trees"] = {name: str(path) for name, path in args.trees.items()}
    return out


def _compare(results: dict[str, list[PathResult]], connections: int) -> str:
    """Gateway CPU per request per checkout (medians over rounds), each against the first checkout's."""
    names = list(results)
    at = f"{connections} connections" if results[names[0]][0].concurrent else "1 connection"
    lines = [f"gateway CPU per request at {at} (us, median of rounds; ratio to {names[0]})"]
    lines.append("path".ljust(14) + "".join(n.rjust(18) for n in names))
    for k, path_result in enumerate(results[names[0]]):
        base = _cpu(path_result)
        cells = []
        for name in names:
            cpu = _cpu(results[name][k])
            ratio = f" {cpu / base:5.3f}x" if cpu is not None and base else ""
            cells.append(f"{cpu:10.1f}{ratio}".rjust(18) if cpu is not None else "-".rjust(18))
        lines.append(path_result.path.ljust(14) + "".join(cells))
    return "\n".join(lines)


def _cpu(r: PathResult) -> float | None:
    """The N-connection median, or the 1-connection one without wrk."""
    m = medians(r)["gateway"]
    return m["cpu_us_per_request"] if m["cpu_us_per_request"] is not None else m["seq_cpu_us_per_request"]


if __name__ == "__main__":
    raise SystemExit(main())
