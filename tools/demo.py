"""``warmroute demo``: conversation affinity at work in under a minute, no GPU needed.

Starts 3 simulated engines and one gateway (affinity policy, in-memory state) on 127.0.0.1, plays a few
multi-turn conversations through the gateway as any streaming OpenAI client would, prints where every turn
went and what it cost, then keeps serving until Ctrl-C so you can try it yourself (``--no-serve``: stop after
the table). Ctrl-C or SIGTERM stops every child process, removes the temporary folder (configs and
logs) and exits with code 0: stopping is how the demo ends. A second signal during that is ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from tools.client import StreamResult, chat_body, stream_chat
from tools.launch import Engine, Launcher, LaunchError, SimProfile, StopRequest, sigterm_as_interrupt
from tools.procs import port_is_free
from tools.workload import Conversation, WorkloadSpec, build

MODEL = "sim-model"
DEFAULT_PORT = 8080
ENGINES = 3
PROFILE = SimProfile(prefill_tps=4000, ttft_base_ms=20, decode_tps=80, answer_tokens=(12, 24))
# Long shared system prompt and turn-1 context, short follow-ups: a follow-up that lands on the engine
# holding its prefix prefills ~100 tokens; anywhere else it would prefill the whole conversation.
WORKLOAD = WorkloadSpec(
    conversations=5,
    turns=4,
    system_tokens=800,
    context_tokens=1200,
    user_tokens=80,
    max_tokens=24,
    hot_fraction=0.0,
    think_ms=0.0,
    system_prompts=1,
)


@dataclass(slots=True)
class Turn:
    conversation: int  # 1-based, as printed
    turn: int
    result: StreamResult


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="warmroute demo", description=__doc__.split("\n\n")[1])
    p.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help=f"gateway port (default {DEFAULT_PORT}; 0: any free one)",
    )
    p.add_argument("--no-serve", action="store_true", help="exit after the table instead of serving")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies every simulated delay")
    return p.parse_args(argv)


# -- the workload ---------------------------------------------------------------------------------------


async def play(gateway_url: str, conversations: Sequence[Conversation]) -> list[Turn]:
    """Turn by turn: every conversation's turn k runs concurrently, then turn k + 1."""
    replies: dict[int, list[str]] = {c.index: [] for c in conversations}
    turns: list[Turn] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        for k in range(WORKLOAD.turns):
            bodies = [
                chat_body(MODEL, c.messages(k, replies[c.index]), WORKLOAD.max_tokens) for c in conversations
            ]
            step = await asyncio.gather(*(stream_chat(client, gateway_url, body) for body in bodies))
            for conv, result in zip(conversations, step, strict=True):
                replies[conv.index].append(result.reply)
                turn = Turn(conv.index + 1, k + 1, result)
                turns.append(turn)
                print(_row(turn), flush=True)
    return turns


async def resend_elsewhere(
    engines: Sequence[Engine], last: Turn, conv: Conversation, replies: list[str]
) -> tuple[str, StreamResult] | None:
    """``last`` (a follow-up) sent again straight to an engine that never saw its conversation."""
    elsewhere = [e for e in engines if e.id != last.result.backend]
    if not elsewhere:
        return None
    body = chat_body(MODEL, conv.messages(last.turn - 1, replies[: last.turn - 1]), WORKLOAD.max_tokens)
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        return elsewhere[0].id, await stream_chat(client, elsewhere[0].url, body)


# -- printing ---------------------------------------------------------------------------------------------

HEADER = (
    f"{'conv':>4} {'turn':>4}  {'backend':<9} {'route':<17} {'TTFT ms':>8}  {'cached / prompt tokens':>24}"
)


def _row(t: Turn) -> str:
    r = t.result
    if r.error is not None:
        return f"{t.conversation:>4} {t.turn:>4}  {r.backend or '-':<9} ERROR {r.error}"
    ttft = f"{r.ttft_s * 1000:.0f}" if r.ttft_s is not None else "-"
    cached, prompt = r.cached_tokens or 0, r.prompt_tokens or 0
    share = f"({cached / prompt:.0%})" if prompt else ""
    tokens = f"{cached} / {prompt} {share:>6}"
    return (
        f"{t.conversation:>4} {t.turn:>4}  {r.backend or '-':<9} {r.route or '-':<17} {ttft:>8}  {tokens:>24}"
    )


def summary(turns: Sequence[Turn]) -> list[str]:
    ok = [t for t in turns if t.result.error is None and t.result.ttft_s is not None]
    home = {t.conversation: t.result.backend for t in ok if t.turn == 1}
    follow = [t for t in ok if t.turn > 1]
    warm = sum(1 for t in follow if t.result.backend == home.get(t.conversation))
    first_ms = [t.result.ttft_s * 1000 for t in ok if t.turn == 1 and t.result.ttft_s is not None]
    follow_ms = [t.result.ttft_s * 1000 for t in follow if t.result.ttft_s is not None]
    cached = sum(t.result.cached_tokens or 0 for t in follow)
    prompt = sum(t.result.prompt_tokens or 0 for t in follow) or 1
    spread = Counter(home.values())
    lines = [
        f"follow-ups on the warm engine: {warm}/{len(follow)}",
        f"mean TTFT: first turns {_mean(first_ms)} ms, follow-ups {_mean(follow_ms)} ms "
        f"({cached / prompt:.0%} of follow-up prompt tokens came from the engine's prefix cache)",
        "new conversations per engine: " + ", ".join(f"{b}: {n}" for b, n in sorted(spread.items())),
    ]
    errors = len(turns) - len(ok)
    if errors:
        lines.append(f"errors: {errors}")
    return lines


def _contrast(engines: Sequence[Engine], turns: Sequence[Turn], conv: Conversation) -> str:
    mine = [t for t in turns if t.conversation == conv.index + 1]
    last = mine[-1]
    warm_s = last.result.ttft_s
    if last.turn < 2 or warm_s is None:
        return ""
    replies = [t.result.reply for t in mine]
    again = asyncio.run(resend_elsewhere(engines, last, conv, replies))
    if again is None or again[1].ttft_s is None:
        return ""
    engine, result = again
    cold_s = again[1].ttft_s
    cached = result.cached_tokens or 0
    what = " (the shared system prompt)" if cached else ""
    return (
        f"for contrast, turn {last.turn} of conversation {last.conversation} resent straight to {engine}, "
        f"which never saw that conversation: TTFT {cold_s * 1000:.0f} ms instead of "
        f"{warm_s * 1000:.0f} ms; cached there: {cached} of {result.prompt_tokens} tokens{what}"
    )


def _mean(values: Sequence[float]) -> str:
    return f"{statistics.fmean(values):.0f}" if values else "n/a"


def serving_help(url: str, engines: Sequence[Engine]) -> str:
    body = f'{{"model": "{MODEL}", "stream": true, "messages": [{{"role": "user", "content": "hello"}}]}}'
    return f"""
The gateway keeps serving at {url}/v1 (model "{MODEL}", {len(engines)} simulated engines). Try it:

  curl -sN -D - {url}/v1/chat/completions -H 'content-type: application/json' \\
    -d '{body}'

  .venv/bin/python - <<'EOF'
  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  raw = client.chat.completions.with_raw_response.create(
      model="{MODEL}", messages=[{{"role": "user", "content": "hello"}}])
  print(raw.headers["x-warmroute-backend"], raw.headers["x-warmroute-route"], raw.parse().choices[0].message)
  EOF

Send the same first messages again and the answer comes from the same engine (x-warmroute-backend).
Status page: {url}/admin/status (backends, pins, routing decisions; refreshes itself).
Gateway: {url}/readyz, {url}/metrics.  Engines: {", ".join(f"{e.url}/metrics" for e in engines)}
Ctrl-C stops the gateway and the engines."""


# -- main ---------------------------------------------------------------------------------------------------


def _port(requested: int) -> int:
    if requested == 0 or port_is_free(requested):
        return requested
    print(f"port {requested} is taken; using a free one")
    return 0


def run(args: argparse.Namespace, launch: Launcher, stop: StopRequest) -> int:
    started = time.monotonic()
    profile = dataclasses.replace(PROFILE, time_scale=args.time_scale)
    print(
        f"starting {ENGINES} simulated engines and the gateway (affinity policy) on 127.0.0.1 ...", flush=True
    )
    engines = launch.start_sims(ENGINES, profile, MODEL)
    stop.check()
    gateway = launch.start_gateway(engines, MODEL, "affinity", port=_port(args.port))
    stop.check()
    print(f"ready in {time.monotonic() - started:.1f} s: gateway {gateway.url}, engines "
          + ", ".join(f"{e.id} {e.url}" for e in engines))  # fmt: skip
    conversations = build(WORKLOAD)
    print(
        f"\n{len(conversations)} conversations x {WORKLOAD.turns} turns, streamed through the gateway; one "
        f"shared system prompt ({WORKLOAD.system_tokens} tokens), turn 1 adds ~{WORKLOAD.context_tokens} "
        f"tokens of context, each later turn ~{WORKLOAD.user_tokens}.\n"
        f"Engines prefill {profile.prefill_tps:.0f} uncached tokens/s; a cached prefix costs nothing.\n"
    )
    print(HEADER)
    turns = asyncio.run(play(gateway.url, conversations))
    print()
    print("\n".join(summary(turns)))
    print(_contrast(engines, turns, conversations[0]))
    print(f"\ndemo took {time.monotonic() - started:.1f} s")
    errors = sum(1 for t in turns if t.result.error is not None)
    if args.no_serve:
        return 1 if errors else 0
    print(serving_help(gateway.url, engines), flush=True)
    while True:
        time.sleep(0.5)
        stop.check()
        for child in launch.dead():
            print(f"\n{child.name} exited ({child.process.returncode}):\n{child.log_tail()}", file=sys.stderr)
            return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    with sigterm_as_interrupt() as stop:
        launch: Launcher | None = None
        try:
            launch = Launcher("warmroute-demo-", stop)
            return run(args, launch, stop)
        except LaunchError as exc:
            print(f"warmroute demo: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nstopping the gateway and the engines ...", flush=True)
            return 0
        finally:  # a signal from here on is only noted (StopRequest): the folder always goes
            if launch is not None:
                launch.close()
