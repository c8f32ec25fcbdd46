"""Start real vLLM engines (CPU) on 127.0.0.1 for manual use or a benchmark, and stop them afterwards.

    python -m tests.e2e.run_engines                      # 2 engines; prints their URLs; Ctrl-C stops them
    python -m tests.e2e.run_engines -- CMD ARG ...       # run CMD while they serve; {urls} in ARGs expands

Under KV-cache pressure (`--kv-blocks N`: N blocks of 128 tokens per engine) or with any vLLM flag
(`--engine-arg=--max-num-seqs=8`, repeatable):

    python -m tests.e2e.run_engines --kv-blocks 96 --engine-arg=--max-num-seqs=8

For the routing benchmark on real engines (`--dev-mode` lets it reset their prefix caches between runs):

    .venv/bin/python -m tests.e2e.run_engines --dev-mode -- \\
        .venv/bin/warmroute bench --engines {urls} --conversations 14 --turns 5 ...

Needs the engine venv (`make e2e-venv`); the model is generated on first use (tests/e2e/make_model.py).
The engines get one core each, as in the tests; their logs go to --log-dir.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from .engines import EngineConfig, engine_venv, ensure_model, start_engines, stop_all, venv_ready


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    command: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, command = argv[:at], argv[at + 1 :]
    p = argparse.ArgumentParser(prog="python -m tests.e2e.run_engines", description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=2)
    p.add_argument("--model", default="tiny-chat", help="model spec of make_model.py, also the served name")
    p.add_argument("--dev-mode", action="store_true", help="VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache")
    p.add_argument("--compiled", action="store_true", help="torch.compile instead of eager (slower start)")
    p.add_argument("--log-dir", type=Path, help="default: a new temporary directory")
    p.add_argument(
        "--kv-blocks",
        type=int,
        help="KV-cache blocks per engine (--num-gpu-blocks-override; 128 tokens each on CPU), "
        "to put the prefix caches under pressure; default: what VLLM_CPU_KVCACHE_SPACE (1 GiB) holds",
    )
    p.add_argument(
        "--engine-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra vLLM argument for every engine, repeatable: --engine-arg=--max-num-seqs=8",
    )
    return p.parse_args(argv), command


def engine_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The arguments appended to every engine's command line."""
    extra = list(args.engine_arg)
    if args.kv_blocks is not None:
        extra += ["--num-gpu-blocks-override", str(args.kv_blocks)]
    return tuple(extra)


def main(argv: list[str] | None = None) -> int:
    args, command = parse_args(sys.argv[1:] if argv is None else argv)
    venv = engine_venv()
    if not venv_ready(venv):
        print(f"engine venv not ready at {venv}: run `make e2e-venv`", file=sys.stderr)
        return 2
    config = EngineConfig(
        python=venv / "bin" / "python",
        model_dir=ensure_model(venv, args.model),
        served_model_name=args.model,
        enforce_eager=not args.compiled,
        extra_args=engine_args(args),
        extra_env=(("VLLM_SERVER_DEV_MODE", "1"),) if args.dev_mode else (),
    )
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="warmroute-engines-"))

    def stop(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    started = time.monotonic()
    engines = start_engines(config, args.count, log_dir)
    try:
        urls = ",".join(e.base_url for e in engines)
        print(f"engines ready in {time.monotonic() - started:.0f}s (logs: {log_dir}): {urls}", flush=True)
        if command:
            return subprocess.call([part.replace("{urls}", urls) for part in command])
        print("serving; Ctrl-C stops them", flush=True)
        while all(e.alive for e in engines):
            time.sleep(1)
        print("an engine exited; stopping the others", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    finally:
        stop_all(engines)


if __name__ == "__main__":
    sys.exit(main())
