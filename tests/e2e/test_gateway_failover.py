"""Through the gateway: an engine dies mid-run, its conversations move to the survivor, and it comes back.

Kills an engine (SIGKILL to its whole process group, as a crash would) and restarts it at the end. Two
gateways watch it: the module's (health checks every 0.5 s, usually first to notice: `repin_unhealthy`) and
one whose health loop is too slow to notice, so its first request meets the dead engine (`retry_next`).
"""

from __future__ import annotations

import sys
import uuid

from openai import OpenAI

from .engines import VllmEngine
from .gateways import BLOCK, Conversation, RunningGateway, ask, running_gateway

CONVERSATIONS = 4
FIRST_TOKENS = 1500
TURN_TOKENS = 300
BLIND = {"interval_s": 600.0, "timeout_s": 5.0, "fail_threshold": 1}  # no health check after the first


def start(client: OpenAI, label: str) -> list[Conversation]:
    """Two turns of each of 4 new conversations: the affinity policy puts 2 on each engine."""
    convs = [
        Conversation(f"{label}-c{i}", first_tokens=FIRST_TOKENS, turn_tokens=TURN_TOKENS)
        for i in range(CONVERSATIONS)
    ]
    for _ in range(2):
        for conv in convs:
            ask(client, conv)
    assert all(len(c.backends) == 1 for c in convs)
    return convs


def on(engine: VllmEngine, convs: list[Conversation]) -> list[Conversation]:
    return [c for c in convs if c.backends == {engine.name}]


def test_killed_engine_conversations_move_to_the_survivor(
    affinity_gateway: RunningGateway, vllm_engines: list[VllmEngine]
) -> None:
    gw = affinity_gateway
    client = gw.client()
    engines = {e.name: e for e in vllm_engines}
    run = uuid.uuid4().hex[:8]
    with running_gateway(vllm_engines, "affinity", health=BLIND) as blind_gw:
        blind = blind_gw.client()
        blind_convs = start(blind, f"blind-{run}")
        convs = start(client, f"fail-{run}")
        victim = engines[convs[0].turns[0].backend]
        (survivor,) = (e for e in vllm_engines if e is not victim)
        moved, stayed = on(victim, convs), on(survivor, convs)
        assert len(moved) == len(stayed) == CONVERSATIONS // 2
        blind_moved = on(victim, blind_convs)
        assert len(blind_moved) == CONVERSATIONS // 2

        victim.kill()
        # At once, before the health loop (every 0.5 s) may notice: the first request finds a dead engine and
        # is retried on the survivor (`retry_next`), or the gateway already knows and re-pins
        # (`repin_unhealthy`). Neither is the client's business: no error reaches it, streamed or not.
        for i, conv in enumerate(moved):
            turn = ask(client, conv, stream=i == 0)
            assert turn.backend == survivor.name, turn
            assert turn.route in {"retry_next", "repin_unhealthy"}, turn
        for conv in stayed:
            turn = ask(client, conv)
            assert (turn.backend, turn.route) == (survivor.name, "affinity_hit"), turn
        assert gw.wait_state(victim.name, "down") == "down"

        # The blind gateway still thinks the engine is up: its first request there fails to connect (before
        # any byte), is retried on the survivor unseen by the client, and marks the engine down at once.
        retried = ask(blind, blind_moved[0], stream=True)
        assert (retried.backend, retried.route) == (survivor.name, "retry_next"), retried
        assert blind_gw.backend_state(victim.name) == "down"
        repinned = ask(blind, blind_moved[1])
        assert (repinned.backend, repinned.route) == (survivor.name, "repin_unhealthy"), repinned
        assert blind_gw.wait_idle() == 0

    for _ in range(2):  # the moved conversations now live on the survivor, and its cache holds them
        for conv in convs:
            turn = ask(client, conv, [survivor])
            assert turn.backend == survivor.name, turn
    for conv in convs:
        last, before_last = conv.turns[-1], conv.turns[-2]
        assert last.route == "affinity_hit", [(t.number, t.backend, t.route) for t in conv.turns]
        assert last.served.hits >= before_last.prompt_tokens - 2 * BLOCK, last
    assert gw.wait_idle() == 0
    routes = {c.tag.rsplit("-", 1)[1]: [f"{t.backend[-1]}:{t.route}" for t in c.turns] for c in convs}
    print(f"\n[e2e] killed {victim.name}; routes per turn: {routes}", file=sys.stderr)

    # Back up: the health loop marks it ready again, and it takes the next new conversation (no pins left).
    victim.start()
    waited = victim.wait_healthy()
    assert gw.wait_state(victim.name, "ready", timeout_s=10) == "ready"
    print(f"[e2e] {victim.name} restarted, healthy after {waited:.0f}s", file=sys.stderr)
    fresh = Conversation(f"fail-{run}-new", first_tokens=200)
    turn = ask(client, fresh)
    assert (turn.backend, turn.route) == (victim.name, "new_least_loaded"), turn
