"""Session identity and volatile prefixes on real vLLM engines (CPU), read from the engines' own counters.

- Two sessions with one identical head and distinct ``x-claude-code-session-id`` values start on different
  engines (head hashing alone would put both on one), and each stays on its own.
- Claude Code's billing block (a new nonce every request, as the first system block): vLLM 0.32 drops it
  from system messages itself, so the gateway forwards the client's bytes and turn 2 still reads its whole
  head from the engine's prefix cache; the conversation key ignores the nonce, so both turns stay put.
- A volatile prefix vLLM does not know (configured in ``routing.volatile_prefixes``) is stripped by the
  gateway and turn 2 hits the cache; forwarded as sent (``strip_volatile: false``) the nonce changes the
  prompt from its first block, and turn 2 reads almost nothing from the cache.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from typing import Any

from openai import OpenAI

from config.settings import load_settings
from gateway.app import create_app

from .engines import PrefixCacheStats, VllmEngine
from .gateways import BACKEND_HEADER, BLOCK, FAST_HEALTH, MODEL, NO_THINKING, ROUTE_HEADER, settled
from .prompts import filler_text
from upstreams import serve

HEAD_TOKENS = 1500


@contextlib.contextmanager
def gateway(
    engines: list[VllmEngine], routing: dict[str, Any] | None = None, **backend: Any
) -> Iterator[str]:
    backends = [{"id": e.name, "url": e.base_url, "models": [MODEL], "dialect": "vllm", **backend}
                for e in engines]  # fmt: skip
    settings = load_settings(None, backends=backends, health=FAST_HEALTH, routing=routing or {})
    with serve(create_app(settings)) as (url, _server):
        yield url


def client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(url: str, messages: list[Any], headers: dict[str, str] | None = None) -> tuple[str, str, str, int]:
    raw = client(url).chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body=NO_THINKING,
        extra_headers=headers or {},
    )  # fmt: skip
    done = raw.parse()
    assert done.usage is not None
    reply = done.choices[0].message.content or ""
    return raw.headers[BACKEND_HEADER], raw.headers[ROUTE_HEADER], reply, done.usage.prompt_tokens


def test_session_ids_split_identical_heads_from_their_first_turn(vllm_engines: list[VllmEngine]) -> None:
    run = uuid.uuid4().hex[:8]
    head = [{"role": "system", "content": filler_text(HEAD_TOKENS, f"agent-{run}")},
            {"role": "user", "content": "Read the failing test and fix it."}]  # fmt: skip
    with gateway(vllm_engines) as url:
        first = {sid: chat(url, head, {"x-claude-code-session-id": f"{run}-{sid}"}) for sid in ("a", "b")}
        assert {b for b, *_ in first.values()} == {e.name for e in vllm_engines}
        assert [r for _, r, *_ in first.values()] == ["new_cheapest"] * 2  # the default policy (ttft)
        for sid, (home, _route, reply, _tokens) in first.items():
            follow = [*head, {"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
            backend, route, *_ = chat(url, follow, {"x-claude-code-session-id": f"{run}-{sid}"})
            assert (backend, route) == (home, "affinity_hit")


def volatile_turns(
    url: str, engines: list[VllmEngine], tag: str, prefix: str
) -> tuple[int, PrefixCacheStats, str]:
    """Two turns whose first system block (``prefix`` and a fresh nonce) differs; turn 2's prompt tokens,
    its cache counters and its route."""
    by_name = {e.name: e for e in engines}
    system_text = {"type": "text", "text": filler_text(HEAD_TOKENS, tag)}

    def system() -> dict[str, Any]:
        block = {"type": "text", "text": f"{prefix} cc_version=2.1.37.a1; cch={uuid.uuid4().hex};"}
        return {"role": "system", "content": [block, system_text]}

    user = {"role": "user", "content": "Read the failing test and fix it."}
    home, _route, reply, _tokens = chat(url, [system(), user])
    engine = by_name[home]
    before = engine.prefix_cache()
    follow = [system(), user, {"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
    backend, route, _reply, tokens = chat(url, follow)
    assert backend == home
    after = settled(engine.prefix_cache, lambda now: (now - before).queries >= tokens)
    return tokens, after - before, route


BILLING = "x-anthropic-billing-header:"
CLOCK = "x-agent-clock:"  # a volatile block vLLM knows nothing of


def test_a_fresh_billing_nonce_keeps_the_conversation_and_vllms_prefix_cache(
    vllm_engines: list[VllmEngine],
) -> None:
    run = uuid.uuid4().hex[:8]
    with gateway(vllm_engines) as url:  # vLLM drops the block itself: the client's bytes go
        tokens, hit, route = volatile_turns(url, vllm_engines, f"billing-{run}", BILLING)
    assert route == "affinity_hit"  # the key ignores the nonce
    assert hit.hits >= HEAD_TOKENS - 2 * BLOCK, (tokens, hit)
    with gateway(vllm_engines, strip_volatile=True) as url:  # the gateway strips it: the same prompt
        tokens, hit, route = volatile_turns(url, vllm_engines, f"strip-{run}", BILLING)
    assert route == "affinity_hit"
    assert hit.hits >= HEAD_TOKENS - 2 * BLOCK, (tokens, hit)


def test_a_volatile_block_the_engine_keeps_is_stripped_or_costs_the_whole_prefix(
    vllm_engines: list[VllmEngine],
) -> None:
    run = uuid.uuid4().hex[:8]
    routing = {"volatile_prefixes": [BILLING, CLOCK]}
    with gateway(vllm_engines, routing) as url:
        tokens, stripped, route = volatile_turns(url, vllm_engines, f"clock-{run}", CLOCK)
    assert route == "affinity_hit"
    assert stripped.hits >= HEAD_TOKENS - 2 * BLOCK, (tokens, stripped)
    with gateway(vllm_engines, routing, strip_volatile=False) as url:
        tokens, kept, route = volatile_turns(url, vllm_engines, f"kept-{run}", CLOCK)
    assert route == "affinity_hit"  # the key still ignores it
    assert kept.hits < BLOCK, (tokens, kept)  # the nonce sits in the first block: nothing after it matches
