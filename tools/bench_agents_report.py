"""Numbers of the coding-agent scenarios: one run's summary, medians over rounds, ratios to the oracle.

- follow-up TTFT: mean over turns 2+ (ms); ``÷ oracle``: the same over the oracle's median.
- moved: follow-ups served by another engine than the session's previous turn (each a re-prefill), with the
  gateway's reasons (``x-warmroute-route`` of the moved request).
- turn-1 load max/mean: first turns per engine, the busiest over the mean (1.0 = even).
- owner share: follow-ups served by the engine of the session's previous turn, over every follow-up sent
  (failed and 404 ones too): for chains, the share that reached the engine holding their
  ``previous_response_id``. A session stops at its first failed turn (its history cannot go on).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tools.agent_client import AgentResult

ORACLE = "oracle"
TRANSLATED = "translated"
NATIVE = "affinity"  # a translated variant runs this policy unless it names one (translated@policy=ttft)
BRIEF_KEYS = (
    "followup_ttft_ms",
    "vs_oracle",
    "vs_native",
    "turn1_ttft_ms",
    "moved",
    "moved_reasons",
    "turn1_load_max_mean",
    "turn1_split",
    "cached_share",
    "owner_share",
    "not_found",
    "errors",
    "skipped",
)


@dataclass(slots=True)
class AgentRecord:
    session: int
    turn: int  # 1-based
    started_s: float
    out: AgentResult
    previous: str | None  # the engine that served this session's previous turn


def summarize(records: Sequence[AgentRecord], engines: Sequence[str], wall_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.out.result.error is None and r.out.result.ttft_s is not None]
    first = [r for r in ok if r.turn == 1]
    follow = [r for r in ok if r.turn > 1]
    moved = [r for r in follow if r.previous is not None and r.out.result.backend != r.previous]
    attempts = [r for r in records if r.turn > 1 and r.previous is not None]  # 404s and failures included
    split = Counter(r.out.result.backend for r in first)
    counts = [split.get(e, 0) for e in engines]
    prompt = sum(r.out.result.prompt_tokens or 0 for r in follow)
    cached = sum(r.out.result.cached_tokens or 0 for r in follow)
    return {
        "requests": len(records),
        "errors": sum(1 for r in records if r.out.result.error is not None and r.out.status != 404),
        "not_found": sum(1 for r in records if r.out.status == 404),
        "wall_s": wall_s,
        "turn1_ttft_ms": _ms_mean([r.out.result.ttft_s for r in first]),
        "followup_ttft_ms": _ms_mean([r.out.result.ttft_s for r in follow]),
        "followups": len(follow),
        "moved": len(moved),
        "moved_reasons": dict(Counter(r.out.result.route or "?" for r in moved)),
        "owner_share": (len(follow) - len(moved)) / len(attempts) if attempts else None,
        "turn1_load_max_mean": max(counts) / statistics.fmean(counts) if any(counts) else None,
        "turn1_split": counts,
        "cached_share": cached / prompt if prompt else None,
        # Where each session's first turn went (by session index) and why: which sessions share an engine.
        "turn1_placement": [
            [
                r.session,
                engines.index(b) if (b := r.out.result.backend) in engines else None,
                r.out.result.route,
            ]
            for r in sorted(first, key=lambda r: r.session)
        ],
        # Every request, to compare one session's turns across variants (not a number: medians skip it).
        "records": [_record(r, engines) for r in sorted(records, key=lambda r: (r.session, r.turn))],
    }


def _record(r: AgentRecord, engines: Sequence[str]) -> dict[str, Any]:
    res = r.out.result
    return {
        "session": r.session,
        "turn": r.turn,
        "started_s": round(r.started_s, 4),
        "engine": engines.index(res.backend) if res.backend in engines else None,
        "route": res.route,
        "status": r.out.status,
        "ttft_ms": None if res.ttft_s is None else round(1000 * res.ttft_s, 2),
        "e2e_ms": None if res.e2e_s is None else round(1000 * res.e2e_s, 2),
        "prompt_tokens": res.prompt_tokens,
        "cached_tokens": res.cached_tokens,
        "completion_tokens": res.completion_tokens,
    }


def _ms_mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return 1000 * statistics.fmean(present) if present else None


def medians(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Median of every number over rounds; a skipped variant keeps its reason."""
    done = [r for r in runs if "skipped" not in r]
    if not done:
        return {"skipped": runs[0]["skipped"]} if runs else {}
    out: dict[str, Any] = {}
    for key, value in done[0].items():
        if isinstance(value, bool) or not isinstance(value, int | float | type(None)):
            continue
        values = [r[key] for r in done if isinstance(r.get(key), int | float)]
        out[key] = statistics.median(values) if values else None
    reasons: Counter[str] = Counter()
    for r in done:
        reasons.update(r.get("moved_reasons", {}))
    out["moved_reasons"] = dict(reasons)  # summed over rounds
    return out


def add_ratios(by_variant: dict[str, dict[str, Any]]) -> None:
    """``vs_oracle`` for every variant that ran; ``vs_native`` for each translated one, over its native twin
    (the variant named by its policy: ``translated`` over ``affinity``, ``translated@policy=ttft`` over
    ``ttft``)."""
    reference = by_variant.get(ORACLE, {}).get("followup_ttft_ms")
    for stats in by_variant.values():
        if "skipped" in stats:
            continue
        value = stats.get("followup_ttft_ms")
        stats["vs_oracle"] = value / reference if value and reference else None
    for variant, stats in by_variant.items():
        twin = translated_policy(variant)
        if twin is None or "skipped" in stats:
            continue
        native = by_variant.get(twin, {}).get("followup_ttft_ms")
        if (value := stats.get("followup_ttft_ms")) and native:
            stats["vs_native"] = value / native


def translated_policy(variant: str) -> str | None:
    """The gateway policy a translated variant runs, i.e. its native twin (None: not a translated one)."""
    name, _, settings = variant.partition("@")
    if name != TRANSLATED:
        return None
    pairs = dict(s.partition("=")[::2] for s in settings.split(";") if s)
    return pairs.get("policy", NATIVE).strip()


def brief(result: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt(result[k])}" for k in BRIEF_KEYS if k in result)


def _fmt(value: Any) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)
