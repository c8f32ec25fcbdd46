"""Numbers of a routing benchmark: per-run statistics, medians over rounds, the printed table, JSON, a plot.

Rules (docs/benchmarks.md): say how many streams, the per-stream decode speed, the context per stream
and decode vs end-to-end time; TTFT is the figure of merit; compare policies from one run as ratios; quote
medians over rounds.
"""

from __future__ import annotations

import statistics
import textwrap
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tools.client import StreamResult

BASELINE = "round_robin"
ORACLE = "oracle"
PRIMARY = "affinity"

# The acceptance figures for the affinity policy.
WARM_SHARE_MIN = 0.95
SPEEDUP_VS_RR_MIN = 3.0
IMBALANCE_MAX = 1.25


@dataclass(slots=True)
class TurnRecord:
    policy: str
    round: int
    conversation: int
    turn: int  # 1-based
    hot: bool
    started_s: float  # since the start of this policy's run
    result: StreamResult
    warm: bool | None  # follow-up on the engine that served the previous turn (None: first turn)

    def as_json(self) -> dict[str, Any]:
        r = self.result
        return {
            "policy": self.policy,
            "round": self.round,
            "conversation": self.conversation,
            "turn": self.turn,
            "hot": self.hot,
            "started_s": round(self.started_s, 4),
            "ttft_s": r.ttft_s,
            "decode_s": r.decode_s,
            "e2e_s": r.e2e_s,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.cached_tokens,
            "completion_tokens": r.completion_tokens,
            "finish_reason": r.finish_reason,
            "backend": r.backend,
            "route": r.route,
            "warm": self.warm,
            "error": r.error,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> TurnRecord:
        result = StreamResult(
            ttft_s=d["ttft_s"],
            decode_s=d["decode_s"],
            e2e_s=d["e2e_s"],
            completion_tokens=d["completion_tokens"],
            prompt_tokens=d["prompt_tokens"],
            cached_tokens=d["cached_tokens"],
            backend=d["backend"],
            route=d["route"],
            finish_reason=d.get("finish_reason"),
            error=d["error"],
        )
        return cls(
            d["policy"], d["round"], d["conversation"], d["turn"], d["hot"], d["started_s"], result, d["warm"]
        )


@dataclass(slots=True)
class RunStats:
    """One policy, one round. Times in ms unless named otherwise; shares in [0, 1]."""

    policy: str
    round: int
    streams: int
    requests: int
    errors: int
    skipped: int
    wall_s: float
    ttft_mean_ms: float | None
    ttft_p50_ms: float | None
    ttft_p95_ms: float | None
    ttft_first_mean_ms: float | None
    ttft_followup_mean_ms: float | None
    warm_share: float | None
    engine_hit_rate: float | None
    usage_cached_share: float | None
    load_imbalance: float | None
    mean_engine_queue: float | None
    decode_tps_p50: float | None
    context_mean_tokens: float | None
    uncached_mean_tokens: float | None  # prompt - cached (usage): the prefill that routing decides
    uncached_followup_mean_tokens: float | None
    decode_mean_ms: float | None
    e2e_mean_ms: float | None
    output_tokens: int
    load_by_engine: dict[str, float] = field(default_factory=dict)
    routes: dict[str, int] = field(default_factory=dict)
    turns_by_engine: dict[str, int] = field(default_factory=dict)


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in 0..100)."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def summarize(
    records: Sequence[TurnRecord],
    *,
    streams: int,
    skipped: int,
    wall_s: float,
    hit_rate: float | None,
    loads: Mapping[str, float],
    imbalance: float | None,
) -> RunStats:
    ok = [r for r in records if r.result.error is None and r.result.ttft_s is not None]
    ttft = [r.result.ttft_s for r in ok if r.result.ttft_s is not None]
    first = [r.result.ttft_s for r in ok if r.turn == 1 and r.result.ttft_s is not None]
    follow = [r.result.ttft_s for r in ok if r.turn > 1 and r.result.ttft_s is not None]
    warm = [r.warm for r in ok if r.warm is not None]
    prompt = [r.result.prompt_tokens for r in ok if r.result.prompt_tokens is not None]
    cached = [r.result.cached_tokens for r in ok if r.result.cached_tokens is not None]
    decode_speed = [s for r in ok if (s := r.result.decode_tps) is not None]
    uncached = [(r.turn, float(p - c)) for r in ok if (p := r.result.prompt_tokens) is not None
                and (c := r.result.cached_tokens) is not None]  # fmt: skip
    return RunStats(
        policy=records[0].policy if records else "?",
        round=records[0].round if records else 0,
        streams=streams,
        requests=len(records),
        errors=len(records) - len(ok),
        skipped=skipped,
        wall_s=wall_s,
        ttft_mean_ms=_ms(_mean(ttft)),
        ttft_p50_ms=_ms(percentile(ttft, 50)),
        ttft_p95_ms=_ms(percentile(ttft, 95)),
        ttft_first_mean_ms=_ms(_mean(first)),
        ttft_followup_mean_ms=_ms(_mean(follow)),
        warm_share=sum(warm) / len(warm) if warm else None,
        engine_hit_rate=hit_rate,
        usage_cached_share=sum(cached) / sum(prompt) if cached and len(cached) == len(prompt) else None,
        load_imbalance=imbalance,
        mean_engine_queue=sum(loads.values()) if loads else None,
        decode_tps_p50=percentile(decode_speed, 50),
        context_mean_tokens=_mean([float(p) for p in prompt]),
        uncached_mean_tokens=_mean([u for _, u in uncached]),
        uncached_followup_mean_tokens=_mean([u for turn, u in uncached if turn > 1]),
        decode_mean_ms=_ms(_mean([r.result.decode_s for r in ok if r.result.decode_s is not None])),
        e2e_mean_ms=_ms(_mean([r.result.e2e_s for r in ok])),
        output_tokens=sum(r.result.completion_tokens for r in ok),
        load_by_engine=dict(loads),
        routes=dict(Counter(r.result.route or "direct" for r in records)),
        turns_by_engine=dict(Counter(r.result.backend or "?" for r in ok)),
    )


def summarize_again(saved: Mapping[str, Any], records: Sequence[TurnRecord]) -> RunStats:
    """``summarize`` for a run saved in a JSON report: its requests, plus the engine readings it kept."""
    mine = [r for r in records if r.policy == saved["policy"] and r.round == saved["round"]]
    return summarize(
        mine,
        streams=saved["streams"],
        skipped=saved["skipped"],
        wall_s=saved["wall_s"],
        hit_rate=saved["engine_hit_rate"],
        loads=saved["load_by_engine"],
        imbalance=saved["load_imbalance"],
    )


_NUMERIC = [f.name for f in fields(RunStats) if f.name not in {"policy", "round"}]


def median_over_rounds(runs: Sequence[RunStats]) -> dict[str, Any]:
    """Median of every scalar field over rounds; dict fields: the median per key."""
    out: dict[str, Any] = {"policy": runs[0].policy, "rounds": len(runs)}
    for name in _NUMERIC:
        values = [getattr(r, name) for r in runs]
        if isinstance(values[0], dict):
            keys = sorted({k for v in values for k in v})
            out[name] = {k: statistics.median([v.get(k, 0) for v in values]) for k in keys}
        else:
            present = [v for v in values if v is not None]
            out[name] = statistics.median(present) if present else None
    return out


# -- the printed table --------------------------------------------------------------------------------------

Row = tuple[str, str, Callable[[Any], str]]


def _f(fmt: str) -> Callable[[Any], str]:
    # A median of counts can be a float (x.5); "d" would refuse it.
    return lambda v: "n/a" if v is None else format(round(v) if fmt == "d" else v, fmt)


def _pct(v: Any) -> str:
    return "n/a" if v is None else f"{v * 100:.1f} %"


ROWS: list[Row] = [
    ("TTFT mean (ms)", "ttft_mean_ms", _f(".0f")),
    ("TTFT p50 (ms)", "ttft_p50_ms", _f(".0f")),
    ("TTFT p95 (ms)", "ttft_p95_ms", _f(".0f")),
    ("  turn 1 mean (ms)", "ttft_first_mean_ms", _f(".0f")),
    ("  follow-ups mean (ms)", "ttft_followup_mean_ms", _f(".0f")),
    ("follow-ups on warm engine", "warm_share", _pct),
    ("engine prefix-cache hit rate", "engine_hit_rate", _pct),
    ("uncached tokens / request", "uncached_mean_tokens", _f(".0f")),
    ("  follow-ups", "uncached_followup_mean_tokens", _f(".0f")),
    ("cached share (usage)", "usage_cached_share", _pct),
    ("load max/mean (run+wait)", "load_imbalance", _f(".2f")),
    ("requests at engines (mean)", "mean_engine_queue", _f(".1f")),
    ("streams (concurrent convs)", "streams", _f("d")),
    ("context / request (tokens)", "context_mean_tokens", _f(".0f")),
    ("decode / stream (tok/s, p50)", "decode_tps_p50", _f(".1f")),
    ("decode time mean (ms)", "decode_mean_ms", _f(".0f")),
    ("end-to-end mean (ms)", "e2e_mean_ms", _f(".0f")),
    ("requests", "requests", _f(".0f")),
    ("errors", "errors", _f(".0f")),
    ("wall time (s)", "wall_s", _f(".1f")),
]


RATIO_ROWS = (
    ("ttft_mean_ms", "TTFT mean"),
    ("ttft_p95_ms", "TTFT p95"),
    ("ttft_followup_mean_ms", "follow-up TTFT"),
)


def render_table(medians: Mapping[str, Mapping[str, Any]]) -> str:
    policies = list(medians)
    width = max(12, *(len(p) + 2 for p in policies))
    lines = [f"{'':32}" + "".join(f"{p:>{width}}" for p in policies)]
    for label, key, fmt in ROWS:
        lines.append(f"{label:32}" + "".join(f"{fmt(medians[p].get(key)):>{width}}" for p in policies))
    for title, reference in (("÷ round_robin", BASELINE), ("÷ oracle", ORACLE)):
        if reference not in medians:
            continue
        for key, label in RATIO_ROWS:
            ref = medians[reference].get(key)
            cells = [_ratio(medians[p].get(key), ref) for p in policies]
            lines.append(f"{label + ' ' + title:32}" + "".join(f"{c:>{width}}" for c in cells))
    return "\n".join(lines)


def _ratio(value: float | None, reference: float | None) -> str:
    if value is None or not reference:
        return "n/a"
    return f"{value / reference:.2f}x"


def ratios(medians: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, float | None]]:
    """policy -> {"ttft_mean_vs_round_robin": x, "ttft_mean_vs_oracle": y, ...} (value / reference)."""
    out: dict[str, dict[str, float | None]] = {}
    for policy, stats in medians.items():
        row: dict[str, float | None] = {}
        for reference in (BASELINE, ORACLE):
            if reference not in medians:
                continue
            for key in ("ttft_mean_ms", "ttft_p50_ms", "ttft_p95_ms", "ttft_followup_mean_ms"):
                value, ref = stats.get(key), medians[reference].get(key)
                row[f"{key.removesuffix('_ms')}_vs_{reference}"] = value / ref if value and ref else None
        out[policy] = row
    return out


def expectations(medians: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, bool | None]]:
    """The issue's targets for ``affinity``: (description, met?) with None when not measurable."""
    if PRIMARY not in medians:
        return []
    aff = medians[PRIMARY]
    checks: list[tuple[str, bool | None]] = []
    warm = aff.get("warm_share")
    checks.append((f"follow-ups on the warm engine >= {WARM_SHARE_MIN:.0%}: {_pct(warm)}",
                   None if warm is None else warm >= WARM_SHARE_MIN))  # fmt: skip
    rr = medians.get(BASELINE, {}).get("ttft_mean_ms")
    mean = aff.get("ttft_mean_ms")
    speedup = rr / mean if rr and mean else None
    text = "n/a" if speedup is None else f"{speedup:.2f}x"
    checks.append((f"mean TTFT >= {SPEEDUP_VS_RR_MIN:.0f}x better than round_robin: {text}",
                   None if speedup is None else speedup >= SPEEDUP_VS_RR_MIN))  # fmt: skip
    imb = aff.get("load_imbalance")
    checks.append((f"load max/mean <= {IMBALANCE_MAX}: {_f('.2f')(imb)}",
                   None if imb is None else imb <= IMBALANCE_MAX))  # fmt: skip
    return checks


def run_line(stats: RunStats) -> str:
    """One line per finished run, printed as the benchmark goes."""
    loads = " ".join(f"{k}={v:.1f}" for k, v in sorted(stats.load_by_engine.items()))
    routes = " ".join(f"{k}={v}" for k, v in sorted(stats.routes.items()))
    return (
        f"  done: TTFT mean {_f('.0f')(stats.ttft_mean_ms)} ms, warm {_pct(stats.warm_share)}, "
        f"hit {_pct(stats.engine_hit_rate)}, load {loads} (max/mean {_f('.2f')(stats.load_imbalance)}), "
        f"errors {stats.errors}, {stats.wall_s:.1f} s; routes: {routes}"
    )


def stats_json(stats: RunStats) -> dict[str, Any]:
    return asdict(stats)


# -- the plot ---------------------------------------------------------------------------------------------


def plot_ttft(records: Sequence[TurnRecord], policies: Sequence[str], path: Path, title: str) -> None:
    """TTFT CDF per policy (log x), all turns and follow-ups only, pooled over rounds."""
    import matplotlib  # lazy: only the benchmark needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True, layout="constrained")
    for ax, subset, name in (
        (axes[0], lambda r: True, "all turns"),
        (axes[1], lambda r: r.turn > 1, "follow-ups"),
    ):
        for policy in policies:
            values = sorted(
                r.result.ttft_s * 1000
                for r in records
                if r.policy == policy and r.result.ttft_s is not None and r.result.error is None and subset(r)
            )
            if values:
                ax.step(
                    values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=policy
                )
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, log scale)")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("share of requests")
    axes[1].legend(loc="lower right")
    fig.suptitle("\n".join(textwrap.fill(line, 160) for line in title.splitlines()), fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
