"""``warmroute sim ...`` / ``python -m backends.sim ...``: run one simulated engine."""

from __future__ import annotations

import argparse
import time

from backends.sim import config as c
from backends.sim.config import Faults, SimConfig
from backends.sim.server import LOCALHOST, serve


def _token_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(":")
    try:
        return int(low), int(high or low)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX, got {text!r}") from exc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="warmroute sim",
        description="Engine simulator (OpenAI chat/completions, Anthropic Messages, OpenAI Responses) with "
        "vLLM-like prefix caching, timing and metrics.",
        epilog="Per-stream decode speed with R running streams = "
        "decode_tps / (1 + decode_slowdown * (R - 1)). "
        "TTFT = ttft_base_ms/1000 + uncached_prompt_tokens / prefill_tps. "
        "All delays are multiplied by --time-scale (except --stall-s).",
    )
    p.add_argument("--host", default=LOCALHOST)
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--name", default="sim", help="engine name (x-sim-name header, /sim/stats)")
    p.add_argument("--model", action="append", dest="models", help=f"served model name; repeatable "
                   f"(default {c.DEFAULT_MODEL})")  # fmt: skip
    p.add_argument(
        "--prefill-tps", type=float, default=c.DEFAULT_PREFILL_TPS, help="uncached prompt tokens/s"
    )
    p.add_argument("--ttft-base-ms", type=float, default=c.DEFAULT_TTFT_BASE_MS)
    p.add_argument(
        "--decode-tps", type=float, default=c.DEFAULT_DECODE_TPS, help="per-stream tokens/s at batch 1"
    )
    p.add_argument("--decode-slowdown", type=float, default=c.DEFAULT_DECODE_SLOWDOWN)
    p.add_argument("--cache-tokens", type=int, default=c.DEFAULT_CACHE_TOKENS, help="prefix cache capacity")
    p.add_argument("--block-size", type=int, default=c.DEFAULT_BLOCK_SIZE)
    p.add_argument(
        "--max-running", type=int, default=c.DEFAULT_MAX_RUNNING, help="beyond this, requests wait"
    )
    p.add_argument("--max-model-len", type=int, default=c.DEFAULT_MAX_MODEL_LEN)
    p.add_argument("--default-max-tokens", type=int, default=c.DEFAULT_MAX_TOKENS)
    p.add_argument("--answer-tokens", type=_token_range, default=c.DEFAULT_ANSWER_TOKENS, metavar="MIN:MAX")
    p.add_argument(
        "--reasoning-tokens", type=_token_range, default=c.DEFAULT_REASONING_TOKENS, metavar="MIN:MAX"
    )
    p.add_argument("--reasoning", action="store_true", help="think unless the request turns it off")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies every delay; 0 = instant")
    p.add_argument("--seed", type=int, default=0)
    faults = p.add_argument_group("faults (also settable at runtime: POST /sim/faults)")
    faults.add_argument("--fail-next", type=int, default=0, metavar="N")
    faults.add_argument("--die-mid-stream-after", type=int, default=None, metavar="K")
    faults.add_argument("--stall-s", type=float, default=0.0, metavar="X")
    faults.add_argument("--repeat-token", action="store_true")
    faults.add_argument("--health-fail", action="store_true")
    p.add_argument(
        "--start-delay-s",
        type=float,
        default=0.0,
        help="wait this long before listening, like an engine loading its weights (not time-scaled)",
    )
    faults.add_argument(
        "--slow-factor", type=float, default=1.0, metavar="F", help="multiplies prefill/decode"
    )
    p.add_argument("--prefill-serial", action="store_true", help="one prefill at a time (FIFO)")
    p.add_argument(
        "--scheduling-policy",
        choices=c.SCHEDULING_POLICIES,
        default="fcfs",
        help="as vLLM's: who takes a free slot (priority: lowest 'priority' first, no preemption)",
    )
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="ENDPOINT",
        help="publish KV cache events (vLLM's format) on a ZMQ PUB socket bound here, e.g. tcp://127.0.0.1:5557",
    )
    p.add_argument("--kv-events-topic", default="kv")
    shapes = p.add_argument_group(
        "native API shapes (off: 404, as an engine without them; for the translated path)"
    )
    shapes.add_argument("--no-messages-api", dest="messages_api", action="store_false",
                        help="no /v1/messages or /v1/messages/count_tokens")  # fmt: skip
    shapes.add_argument("--no-responses-api", dest="responses_api", action="store_false",
                        help="no /v1/responses (nor /v1/responses/{id}...)")  # fmt: skip
    shapes.add_argument("--no-responses-store", dest="responses_store", action="store_false",
                        help="ignore 'store' (vLLM's default): previous_response_id and "
                        "GET /v1/responses/{id} "
                        "answer 404; on, responses are kept in this process only "
                        "(vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1)")  # fmt: skip
    shapes.add_argument("--keep-billing-block", action="store_true",
                        help="keep a system block starting 'x-anthropic-billing-header' in the prompt (as "
                        "llama.cpp does); default: drop it before templating (as vLLM does)")  # fmt: skip
    p.add_argument("--log-level", default="info")
    p.add_argument("--access-log", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> SimConfig:
    faults = Faults(
        fail_next=args.fail_next,
        die_mid_stream_after=args.die_mid_stream_after,
        stall_s=args.stall_s,
        repeat_token=args.repeat_token,
        health_fail=args.health_fail,
        slow_factor=args.slow_factor,
    )
    return SimConfig(
        name=args.name,
        models=tuple(args.models or (c.DEFAULT_MODEL,)),
        prefill_tps=args.prefill_tps,
        ttft_base_ms=args.ttft_base_ms,
        decode_tps=args.decode_tps,
        decode_slowdown=args.decode_slowdown,
        cache_tokens=args.cache_tokens,
        block_size=args.block_size,
        max_running=args.max_running,
        max_model_len=args.max_model_len,
        default_max_tokens=args.default_max_tokens,
        answer_tokens=args.answer_tokens,
        reasoning_tokens=args.reasoning_tokens,
        reasoning=args.reasoning,
        prefill_serial=args.prefill_serial,
        scheduling_policy=args.scheduling_policy,
        time_scale=args.time_scale,
        seed=args.seed,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_topic=args.kv_events_topic,
        messages_api=args.messages_api,
        responses_api=args.responses_api,
        responses_store=args.responses_store,
        keep_billing_block=args.keep_billing_block,
        faults=faults,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    if args.start_delay_s > 0:
        print(f"loading for {args.start_delay_s:g} s", flush=True)
        time.sleep(args.start_delay_s)  # nothing listens meanwhile: probes see what a loading engine shows
    serve(cfg, args.host, args.port, log_level=args.log_level, access_log=args.access_log)
    return 0
