"""``warmroute bench``: replay a multi-turn agent workload through gateways and compare routing policies.

    warmroute bench                                   # 3 simulated engines, every policy, 3 rounds
    warmroute bench --engines http://h1:8000,http://h2:8000 --model qwen3 --rounds 1

For each policy a fresh gateway (in-memory state) is started in front of the same engines; ``oracle`` skips
the gateway and sends conversation i straight to engine i mod K, the reference for routing that always knows
where a prefix lives. Between runs the engines' prefix caches are reset (``POST /reset_prefix_cache``); where
an engine refuses, every run gets its own text instead (same shape, different words: ``salt``). Policy order
rotates every round; the table quotes medians over rounds. Engine numbers (prefix-cache hit rate, queue
lengths) are read from each engine's ``/metrics``, never from the gateway under test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from tools import bench_agents, bench_fairness, bench_neighbours, bench_scenarios, procs
from tools import bench_report as report
from tools.bench_run import Outcome, Plan, run_all
from tools.launch import Engine, Launcher, LaunchError, SimProfile, sigterm_as_interrupt
from tools.workload import WorkloadSpec, build, total_requests

GATEWAY_POLICIES = ("affinity", "ttft", "least_loaded", "round_robin")
ALL_POLICIES = (*GATEWAY_POLICIES, report.ORACLE)
SIM_MODEL = "sim-model"
DEFAULT_PLOT = "bench-out/bench-ttft.png"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="warmroute bench", description=__doc__.split("\n\n")[0].split(": ", 1)[1]
    )
    where = p.add_argument_group("engines")
    where.add_argument("--sims", type=int, default=3, help="simulated engines to start (default 3)")
    where.add_argument("--engines", help="comma-separated URLs of running OpenAI engines (instead of --sims)")
    where.add_argument(
        "--model", help=f"model name (default: {SIM_MODEL}, or the first of the engine's models)"
    )
    where.add_argument("--api-key", help="sent to the engines (and by the gateway) as a bearer token")
    where.add_argument("--isolation", choices=("auto", "reset", "salt"), default="auto",
                       help="between runs: reset the engines' prefix caches, or use fresh text (auto: reset "
                       "when every engine allows it)")  # fmt: skip
    runs = p.add_argument_group("runs")
    runs.add_argument(
        "--policies", default=",".join(ALL_POLICIES), help="comma-separated; 'oracle' = no gateway"
    )
    runs.add_argument("--rounds", type=int, default=3, help="repeat every policy this often (order rotates)")
    runs.add_argument("--scenario", metavar="NAMES",
                      help="routing v2 scenarios instead (comma-separated, or 'all'): "
                      + ", ".join([*bench_scenarios.SCENARIOS, *bench_neighbours.SCENARIOS,
                                   *bench_fairness.SCENARIOS, *bench_agents.SCENARIOS,
                                   "agents"]))  # fmt: skip
    runs.add_argument("--variants", metavar="LIST",
                      help="scenarios: variants to run instead of the scenario's own, e.g. "
                      "'ttft,ttft@load_share=2;stay_margin=0.5,oracle'")  # fmt: skip
    runs.add_argument("--tree", action="append", default=[], metavar="NAME=PATH",
                      help="scenarios: a variant ending in %%NAME runs its gateway from the checkout at PATH "
                      "(two versions of the code in one run), e.g. --tree main=../main "
                      "--variants 'ttft%%main,ttft,oracle'")  # fmt: skip
    runs.add_argument("--routing", action="append", default=[], metavar="KEY=VALUE",
                      help="gateway routing setting for every run, e.g. spill_min_in_flight=8")  # fmt: skip
    d = WorkloadSpec()
    work = p.add_argument_group("workload")
    work.add_argument("--conversations", type=int, default=d.conversations)
    work.add_argument("--turns", type=int, default=d.turns, help="turns per conversation (hot ones: more)")
    work.add_argument(
        "--concurrency", type=int, default=12, help="conversations in progress at once (streams)"
    )
    work.add_argument("--system-prompts", type=int, default=d.system_prompts, help="distinct shared ones")
    work.add_argument("--system-tokens", type=int, default=d.system_tokens)
    work.add_argument("--context-tokens", type=int, default=d.context_tokens, help="turn 1: task + context")
    work.add_argument("--user-tokens", type=int, default=d.user_tokens, help="each later turn (tool result)")
    work.add_argument("--max-tokens", type=int, default=d.max_tokens)
    work.add_argument("--hot-fraction", type=float, default=d.hot_fraction)
    work.add_argument("--hot-turn-factor", type=int, default=d.hot_turn_factor)
    work.add_argument("--think-ms", type=float, default=d.think_ms,
                      help="mean pause between turns (uniform 0..2x; hot conversations: none)")  # fmt: skip
    work.add_argument("--seed", type=int, default=d.seed)
    sim = p.add_argument_group("simulated engines")
    s = SimProfile()
    sim.add_argument(
        "--time-scale", type=float, default=s.time_scale, help="scales sim delays and think time"
    )
    sim.add_argument("--prefill-tps", type=float, default=s.prefill_tps)
    sim.add_argument("--decode-tps", type=float, default=s.decode_tps)
    sim.add_argument("--max-running", type=int, default=s.max_running,
                     help="requests an engine runs at once, the rest wait (scenarios: also each backend's "
                     "bound under +admission)")  # fmt: skip
    sim.add_argument("--cache-tokens", type=int, default=s.cache_tokens)
    sim.add_argument("--kv-events", action="store_true",
                     help="engines publish KV cache events; the gateway subscribes (scenarios: adds a "
                     "ttft+kv variant)")  # fmt: skip
    out = p.add_argument_group("output")
    out.add_argument("--json", type=Path, help="write every number (and every request) here")
    out.add_argument("--plot", type=Path, default=Path(DEFAULT_PLOT), help="TTFT CDF per policy (PNG)")
    out.add_argument("--no-plot", action="store_true")
    out.add_argument(
        "--from-json", type=Path, metavar="FILE", help="report an earlier --json run again; runs nothing"
    )
    out.add_argument("--progress-s", type=float, default=5.0, help="seconds between progress lines")
    return p.parse_args(argv)


def _routing_overrides(pairs: Sequence[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"warmroute bench: --routing expects KEY=VALUE, got {pair!r}")
        out[key.strip()] = yaml.safe_load(value)
    return out


def _trees(pairs: Sequence[str]) -> dict[str, Path]:
    try:
        return procs.checkouts(pairs)
    except ValueError as err:
        raise SystemExit(f"warmroute bench: --tree {err}") from None


def _spec(args: argparse.Namespace, sims: bool) -> WorkloadSpec:
    return WorkloadSpec(
        conversations=args.conversations,
        turns=args.turns,
        system_tokens=args.system_tokens,
        context_tokens=args.context_tokens,
        user_tokens=args.user_tokens,
        max_tokens=args.max_tokens,
        hot_fraction=args.hot_fraction,
        hot_turn_factor=args.hot_turn_factor,
        think_ms=args.think_ms * (args.time_scale if sims else 1.0),
        system_prompts=args.system_prompts,
        seed=args.seed,
    )


def _policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in policies if p not in ALL_POLICIES]
    if unknown or not policies:
        raise SystemExit(
            f"warmroute bench: unknown policies {unknown}; choose from {', '.join(ALL_POLICIES)}"
        )
    return policies


def _describe(args: argparse.Namespace, plan: Plan, isolation: str, policies: Sequence[str]) -> list[str]:
    spec, convs = plan.spec, build(plan.spec)
    hot = [c for c in convs if c.hot]
    if args.engines:
        where = f"{len(plan.engines)} engines ({', '.join(e.url for e in plan.engines)}), model {plan.model}"
    else:
        where = (
            f"{len(plan.engines)} simulated engines: prefill {args.prefill_tps:.0f} tok/s, decode "
            f"{args.decode_tps:.0f} tok/s per stream at batch 1 (-5 %/extra stream), prefix cache "
            f"{args.cache_tokens} tokens, max running {args.max_running}, time scale {args.time_scale}"
        )
    isolation_text = {
        "reset": "prefix caches reset before every run (same text for every policy)",
        "salt": "engines cannot reset their caches: every run uses its own text (same shape)",
    }[isolation]
    return [
        f"engines: {where}",
        f"workload: {spec.conversations} conversations x {spec.turns} turns ({len(hot)} hot x "
        f"{spec.turns * spec.hot_turn_factor} turns, no pauses) = {total_requests(convs)} requests per run; "
        f"{spec.system_prompts} shared system prompts of {spec.system_tokens} words, turn 1 adds "
        f"{spec.context_tokens} words of context, each later turn ~{spec.user_tokens} (+-50 %); "
        f"max_tokens {spec.max_tokens}; pauses 0..{2 * spec.think_ms:.0f} ms between turns",
        f"streams: {plan.concurrency} conversations in progress at once (closed loop); policies: "
        f"{', '.join(policies)}; {args.rounds} round(s), order rotating; isolation: {isolation_text}",
        *([f"gateway routing overrides: {dict(plan.routing)}"] if plan.routing else []),
    ]


LEFT_OUT = (
    "left out: engine and gateway start-up; think time (not in TTFT or end-to-end); failed requests "
    "(counted in errors, not in timings) and the turns after them (skipped)"
)


def _output(
    args: argparse.Namespace, header: list[str], rounds: int, outcome: Outcome, settings: dict[str, Any]
) -> int:
    isolation, runs, records = outcome
    medians = {p: report.median_over_rounds(rs) for p, rs in runs.items() if rs}
    print("\n== warmroute bench ==")
    print("\n".join(header))
    print(f"\nmedians over {rounds} round(s):")
    print(report.render_table(medians))
    print(LEFT_OUT)
    print("\naffinity against the issue's targets:")
    for text, met in report.expectations(medians):
        print(f"  [{'ok' if met else 'MISS' if met is False else 'n/a'}] {text}")
    if not args.no_plot:
        report.plot_ttft(records, list(medians), args.plot, header[0] + "\n" + header[2])
        print(f"plot: {args.plot}")
    if args.json:
        document = {
            "description": header,
            "isolation": isolation,
            "settings": settings,
            "medians": medians,
            "ratios": report.ratios(medians),
            "expectations": [{"check": t, "met": m} for t, m in report.expectations(medians)],
            "runs": {p: [report.stats_json(s) for s in rs] for p, rs in runs.items()},
            "requests": [r.as_json() for r in records],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(document, indent=1))
        print(f"json: {args.json}")
    return 1 if any(s.errors for rs in runs.values() for s in rs) else 0


def _report_again(args: argparse.Namespace) -> int:
    """``--from-json``: recompute and print the report of an earlier run; starts nothing."""
    doc = json.loads(args.from_json.read_text())
    records = [report.TurnRecord.from_json(r) for r in doc["requests"]]
    runs = {
        policy: [report.summarize_again(run, records) for run in saved]
        for policy, saved in doc["runs"].items()
    }
    rounds = max((len(rs) for rs in runs.values()), default=0)
    outcome = Outcome(doc["isolation"], runs, records)
    return _output(args, list(doc["description"]), rounds, outcome, doc.get("settings", {}))


def _engines(args: argparse.Namespace, launch: Launcher) -> tuple[tuple[Engine, ...], str]:
    if args.engines:
        urls = [u.strip().rstrip("/").removesuffix("/v1") for u in args.engines.split(",") if u.strip()]
        engines = tuple(Engine(f"engine-{i}", url) for i, url in enumerate(urls, 1))
        return engines, args.model or _first_model(urls[0], args.api_key)
    profile = SimProfile(
        prefill_tps=args.prefill_tps,
        decode_tps=args.decode_tps,
        max_running=args.max_running,
        cache_tokens=args.cache_tokens,
        time_scale=args.time_scale,
        answer_tokens=(max(1, args.max_tokens // 2), max(1, args.max_tokens)),
        kv_events=args.kv_events,
    )
    model = args.model or SIM_MODEL
    print(f"starting {args.sims} simulated engines ...", flush=True)
    return tuple(launch.start_sims(args.sims, profile, model)), model


def _first_model(url: str, api_key: str | None) -> str:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else None
    response = httpx.get(f"{url}/v1/models", headers=headers, timeout=10)
    response.raise_for_status()
    return str(response.json()["data"][0]["id"])


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.from_json:
        return _report_again(args)
    if args.scenario:
        names = list(bench_scenarios.SCENARIOS) if args.scenario == "all" else args.scenario.split(",")
        profile = SimProfile(prefill_tps=args.prefill_tps, decode_tps=args.decode_tps,
                             cache_tokens=args.cache_tokens, max_running=args.max_running,
                             answer_tokens=(16, 32))  # fmt: skip
        with sigterm_as_interrupt():
            out = str(args.json) if args.json else None
            bench_scenarios.ROUTING_OVERRIDES.update(_routing_overrides(args.routing))
            if args.variants:
                bench_scenarios.VARIANTS[:] = args.variants.split(",")
            bench_scenarios.KV_EVENTS[0] = args.kv_events
            bench_scenarios.TREES.update(_trees(args.tree))
            bench_agents.SEED[0] = args.seed
            return bench_scenarios.main(names, args.rounds, args.time_scale, profile, out)
    policies = _policies(args.policies)
    try:
        spec = _spec(args, sims=not args.engines)
    except ValueError as exc:
        raise SystemExit(f"warmroute bench: {exc}") from exc
    if args.concurrency < 1 or args.rounds < 1 or (not args.engines and args.sims < 1):
        raise SystemExit("warmroute bench: --concurrency, --rounds and --sims must be >= 1")
    with sigterm_as_interrupt(), Launcher("warmroute-bench-") as launch:
        try:
            engines, model = _engines(args, launch)
            headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
            plan = Plan(spec, engines, model, args.concurrency, headers,
                        _routing_overrides(args.routing), args.api_key, args.progress_s)  # fmt: skip
            outcome = asyncio.run(run_all(launch, plan, policies, args.rounds, args.isolation))
        except LaunchError as exc:
            print(f"warmroute bench: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nwarmroute bench: interrupted; stopping engines and gateways", file=sys.stderr)
            return 130
    header = _describe(args, plan, outcome.isolation, policies)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    return _output(args, header, args.rounds, outcome, settings)


if __name__ == "__main__":
    sys.exit(main())
