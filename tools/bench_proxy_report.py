"""What ``tools.bench_proxy`` measured, and its summaries: medians, the per-path lines, the table, targets.

Pure functions over the runs (no processes, no I/O), so the numbers in the table can be recomputed from the
JSON the benchmark writes.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SIDES = ("direct", "gateway")
_CONCURRENT = ("rps", "p50_ms", "p99_ms", "p999_ms", "max_ms", "cpu_us_per_request")
#: The issue's targets for new conversations, one worker at 32 connections: median -> (bound, at least?).
TARGETS = {"rps": (6000.0, True), "cpu_us_per_request": (200.0, False), "p99_ms": (10.0, False)}
_TARGET_LABELS = {"rps": ("{:,.0f} req/s", "{:,.0f}"), "cpu_us_per_request": ("{:.0f} us CPU", "{:.0f}")}
_MB = 1024 * 1024


@dataclass
class Run:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    p999_ms: float | None = None
    max_ms: float | None = None
    socket_errors: int = 0  # connect/read/write/timeout as wrk counts them (non-2xx raise instead)
    cpu_us_per_request: float | None = None  # the gateway's, for runs through it
    gc: dict[str, dict[str, float]] | None = None  # the gateway's collections during the run, per generation

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def gc_max_ms(self) -> float | None:
        """The longest collection during the run: every request in flight waited that long."""
        return max(g["max_ms"] for g in self.gc.values()) if self.gc else None

    @property
    def gc_ms_per_s(self) -> float | None:
        return sum(g["total_ms"] for g in self.gc.values()) / self.seconds if self.gc else None


#: A new conversation's reason under each policy that pins (ttft, affinity).
NEW_REASONS = ("new_cheapest", "new_least_loaded")


@dataclass
class PathResult:
    path: str
    sequential: dict[str, list[Run]] = field(default_factory=dict)  # side -> one run per round
    concurrent: dict[str, list[Run]] = field(default_factory=dict)  # empty without wrk
    decisions: dict[str, float] = field(default_factory=dict)  # the gateway's, during this path's runs
    rss_after_bytes: int = 0
    entries_after: int | None = None  # /readyz shared_state.entries, when it shows them
    claims_so_far: float = 0.0  # new-conversation decisions since the gateway started

    @property
    def expected_share(self) -> float:
        """Share of this path's routing decisions that had the reason the path is meant to exercise."""
        want = ("affinity_hit",) if self.path == "hit" else NEW_REASONS
        total = sum(self.decisions.values())
        return sum(self.decisions.get(w, 0.0) for w in want) / total if total else 0.0

    def runs(self) -> list[Run]:
        return [r for by_side in (self.sequential, self.concurrent) for rs in by_side.values() for r in rs]


def median_of(runs: list[Run], value: Callable[[Run], float | None]) -> float | None:
    values = [v for r in runs if (v := value(r)) is not None]
    return statistics.median(values) if values else None


def _m(runs: list[Run], attr: str) -> float | None:
    return median_of(runs, lambda r: getattr(r, attr))


def medians(r: PathResult) -> dict[str, dict[str, float | None]]:
    """Per side: 1-connection p50/p99 (``seq_``), N-connection figures; added latency on the gateway."""
    out: dict[str, dict[str, float | None]] = {}
    for side in SIDES:
        seq, conc = r.sequential[side], r.concurrent.get(side, [])
        out[side] = {
            "seq_p50_ms": _m(seq, "p50_ms"),
            "seq_p99_ms": _m(seq, "p99_ms"),
            "seq_cpu_us_per_request": _m(seq, "cpu_us_per_request"),
            **{attr: _m(conc, attr) for attr in _CONCURRENT},
            "gc_max_ms": _m(conc, "gc_max_ms"),
            "gc_ms_per_s": _m(conc, "gc_ms_per_s"),
        }
    pairs = list(zip(r.sequential["direct"], r.sequential["gateway"], strict=True))  # the same round
    out["gateway"]["added_p50_ms"] = statistics.median(g.p50_ms - d.p50_ms for d, g in pairs)
    out["gateway"]["added_p99_ms"] = statistics.median(g.p99_ms - d.p99_ms for d, g in pairs)
    return out


def targets(paths: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The new path against the issue's targets, and new vs hit through the gateway, when both ran."""
    new = paths.get("new", {}).get("medians", {}).get("gateway", {})
    if new.get("rps") is None:
        return {}, []
    checks: dict[str, dict[str, Any]] = {}
    parts = []
    for key, (bound, at_least) in TARGETS.items():
        value = new[key]
        ok = value >= bound if at_least else value <= bound
        checks[key] = {"value": value, "bound": bound, "ok": ok}
        shown, bound_shown = _TARGET_LABELS.get(key, ("p99 {:.1f} ms", "{:.0f}"))
        sign = ">=" if at_least else "<="
        parts.append(f"{shown.format(value)} ({sign} {bound_shown.format(bound)}: {'ok' if ok else 'MISS'})")
    lines = ["targets, new path through the gateway at 32 connections: " + ", ".join(parts)]
    doc: dict[str, Any] = {"new": checks}
    hit = paths.get("hit", {}).get("medians", {}).get("gateway", {})
    if hit.get("rps"):
        doc["new_vs_hit"] = {k: new[k] / hit[k] for k in TARGETS if new[k] and hit[k]}
        ratios = ", ".join(f"{k} x{v:.2f}" for k, v in doc["new_vs_hit"].items())
        lines.append(f"new / hit through the gateway: {ratios}")
    return doc, lines


def path_lines(r: PathResult, connections: int) -> str:
    """What one path measured, round by round where it matters (CPU and GC per gateway run)."""
    lines = []
    for label, by_side in (("1 conn", r.sequential), (f"{connections} conns", r.concurrent)):
        for side, rs in by_side.items():
            rps = f"{_m(rs, 'rps') or 0:>8,.0f} req/s  " if by_side is r.concurrent else ""
            worst = _m(rs, "max_ms")
            lines.append(
                f"  {label if side == 'direct' else '':<9}{side:<8} {rps}p50 {_m(rs, 'p50_ms'):.3f} ms"
                f"  p99 {_m(rs, 'p99_ms'):.3f} ms" + (f"  max {worst:.1f} ms" if worst is not None else "")
            )
        gateway = by_side.get("gateway", [])
        cpu = ", ".join(f"{g.cpu_us_per_request:.0f}" for g in gateway if g.cpu_us_per_request is not None)
        gcs = " | ".join(_gc_line(g.gc) for g in gateway if g.gc)
        if gateway:
            lines.append(f"  gateway per round, {label}: CPU us/request {cpu}")
        if gcs:
            lines.append(f"    GC, collections/longest ms: {gcs}")
    shown = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r.decisions.items()))
    warn = "" if r.expected_share >= 0.99 else "  <-- NOT the path this run meant to measure"
    lines.append(f"  gateway decisions: {shown} ({r.expected_share:.1%} as intended){warn}")
    errors = sum(x.socket_errors for x in r.runs())
    lines.append(
        f"  socket errors {errors}; gateway RSS {r.rss_after_bytes / _MB:.1f} MB; pins claimed so far"
        f" {r.claims_so_far:,.0f}; entries (/readyz) {_entries(r)}"
    )
    return "\n".join(lines)


def _gc_line(gc: dict[str, dict[str, float]]) -> str:
    return " ".join(f"{g} {s['count']:.0f}/{s['max_ms']:.1f}" for g, s in gc.items())


def _entries(r: PathResult) -> str:
    return "n/a" if r.entries_after is None else f"{r.entries_after:,}"


def table(results: list[PathResult], rss_start: int, connections: int) -> str:
    """One table: a row per path and side; 1-connection and N-connection columns; the gateway's state."""
    head = (
        f"{'path':<12} {'side':<8}{'p50':>7}{'p99':>7}{'+p50':>7}{'+p99':>7} |{'req/s':>8}{'p50':>7}"
        f"{'p99':>7}{'p99.9':>7}{'CPU us':>8}{'GC max':>8}{'GC/s':>6} |{'RSS MB':>8}{'entries':>9}"
    )
    first, last = head.index("|"), head.rindex("|")
    top = f"{'':<21}{'1 connection':<{first - 21}}| {connections} connections"
    top = f"{top:<{last}}| gateway after the path"
    rows = [top, head, "-" * len(head)]
    for r in results:
        med = medians(r)
        for side in SIDES:
            v, gw = med[side], side == "gateway"
            after = f"{r.rss_after_bytes / _MB:>8.1f}{_entries(r):>9}" if gw else ""
            rows.append(
                f"{r.path:<12} {side:<8}{_f(v['seq_p50_ms'], 3)}{_f(v['seq_p99_ms'], 3)}"
                f"{_f(v.get('added_p50_ms'), 3)}{_f(v.get('added_p99_ms'), 3)} |"
                f"{_f(v['rps'], 0, 8, ',')}{_f(v['p50_ms'], 2)}{_f(v['p99_ms'], 2)}{_f(v['p999_ms'], 2)}"
                f"{_f(v['cpu_us_per_request'], 0, 8)}{_f(v['gc_max_ms'], 1, 8)}{_f(v['gc_ms_per_s'], 0, 6)} |"
                f"{after}"
            )
    rows.append(
        "ms unless named; +p50/+p99: gateway minus direct in the same round; CPU us: the gateway's CPU per"
        " request; GC max: its\nlongest collection in a run (every request in flight waits it out); GC/s: ms"
        f" spent collecting per second. Gateway RSS at start {rss_start / _MB:.1f} MB."
    )
    return "\n".join(rows)


def _f(value: float | None, digits: int, width: int = 7, sep: str = "") -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{sep}.{digits}f}"


@dataclass
class TogetherResult:
    """One path under ``--simultaneous``: every gateway loaded at the same time, round by round."""

    path: str
    runs: dict[str, list[Run]] = field(default_factory=dict)  # gateway -> one run per round
    first: list[str] = field(default_factory=list)  # per round: the gateway whose wrk was started first
    machine: list[dict[str, float]] = field(default_factory=list)  # per round: shares of /proc/stat's cpu
    decisions: dict[str, dict[str, float]] = field(default_factory=dict)  # per gateway, this path's

    def ratios(self, base: str) -> dict[str, list[float]]:
        """Per gateway: its CPU per request over ``base``'s, round by round (the same seconds)."""
        out: dict[str, list[float]] = {}
        for name, runs in self.runs.items():
            pairs = zip(runs, self.runs[base], strict=True)
            out[name] = [
                r.cpu_us_per_request / b.cpu_us_per_request
                for r, b in pairs
                if r.cpu_us_per_request and b.cpu_us_per_request
            ]
        return out


def spread(values: list[float]) -> dict[str, float] | None:
    """Median, quartiles (statistics' exclusive method), extremes and count of ``values``; None if empty."""
    if not values:
        return None
    q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {
        "median": statistics.median(values),
        "q1": q1,
        "q3": q3,
        "min": min(values),
        "max": max(values),
        "n": len(values),
    }


def together_summary(r: TogetherResult, base: str) -> dict[str, Any]:
    """Per gateway: the spread of its CPU per request and of its per-round ratio to ``base``."""
    ratios = r.ratios(base)
    out: dict[str, Any] = {}
    for name, runs in r.runs.items():
        cpu = [x.cpu_us_per_request for x in runs if x.cpu_us_per_request is not None]
        out[name] = {
            "cpu_us_per_request": spread(cpu),
            "rps": statistics.median(x.rps for x in runs) if runs else None,
            "ratio": spread(ratios[name]),
        }
    if r.machine:
        out["machine"] = {k: statistics.median(m[k] for m in r.machine) for k in r.machine[0]}
    return out


def together_lines(r: TogetherResult, base: str) -> str:
    """The ratio table of one path: per gateway the median of per-round ratios to ``base``, its quartiles
    and extremes, its CPU per request and the routing decisions it made."""
    summary = together_summary(r, base)
    lines = [
        f"  {'gateway':<16}{'ratio median':>13}{'IQR':>16}{'min-max':>16}{'CPU us (IQR)':>22}{'req/s':>8}"
    ]
    for name in r.runs:
        s = summary[name]
        ratio, cpu = s["ratio"], s["cpu_us_per_request"]
        if ratio is None or cpu is None:
            lines.append(f"  {name:<16}{'-':>13}  (no round with requests on both sides)")
            continue
        iqr, ext = f"{ratio['q1']:.3f}-{ratio['q3']:.3f}", f"{ratio['min']:.3f}-{ratio['max']:.3f}"
        cpu_text = f"{cpu['median']:.0f} ({cpu['q1']:.0f}-{cpu['q3']:.0f})"
        lines.append(
            f"  {name:<16}{ratio['median']:>12.3f}x{iqr:>16}{ext:>16}{cpu_text:>22}{s['rps']:>8,.0f}"
        )
    for name, decisions in r.decisions.items():
        shown = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(decisions.items()))
        lines.append(f"  decisions {name}: {shown}")
    if "machine" in summary:
        m = summary["machine"]
        lines.append(
            "  machine per round (median shares of all CPU time, /proc/stat): "
            + ", ".join(f"{k} {v:.1%}" for k, v in m.items())
        )
    return "\n".join(lines)
