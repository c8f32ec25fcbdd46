"""A gateway-enforced thinking budget on a request translated to chat: Anthropic Messages to a chat-only
engine (the simulator as a real server, dialect ``openai``), with the official ``anthropic`` SDK as caller.

Phase 1 stops at the budget, phase 2 continues the translated chat body on the same engine; the client gets
one Message (thinking, then text), streamed or whole, with both phases' output tokens.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from backends.sim import SimConfig, SimServer
from config.settings import load_settings
from gateway.app import Gateway, create_app

from upstreams import serve

BUDGET = 1024  # Anthropic's least budget
REASONING = 1500  # what the simulator would think without a cap
ANSWER = 8


@pytest.fixture
def stack() -> Iterator[tuple[str, Gateway, SimServer]]:
    with contextlib.ExitStack() as stack:
        cfg = SimConfig(
            name="a", reasoning=True, reasoning_tokens=(REASONING, REASONING), answer_tokens=(ANSWER, ANSWER),
            time_scale=0.0, decode_tps=100000.0,
        )  # fmt: skip
        sim = stack.enter_context(SimServer(cfg))
        backends = [{"id": "a", "url": sim.base_url, "models": list(cfg.models), "dialect": "openai"}]
        settings = load_settings(None, backends=backends, canary={"enabled": False})
        app = create_app(settings)
        url, _ = stack.enter_context(serve(app))
        yield url, app.state.gateway, sim


def _ask(sim: SimServer) -> dict[str, Any]:
    return {
        "model": sim.cfg.models[0],
        "max_tokens": 4000,
        "messages": [{"role": "user", "content": "why is the sky blue"}],
        "thinking": {"type": "enabled", "budget_tokens": BUDGET},
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_translated_messages_request_is_capped_in_two_phases_and_answered_as_one_message(
    stack: tuple[str, Gateway, SimServer], stream: bool
) -> None:
    url, gw, sim = stack
    client = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0, timeout=60)
    if stream:
        with client.messages.stream(**_ask(sim)) as s:
            message = s.get_final_message()
    else:
        message = client.messages.create(**_ask(sim))
    kinds = [block.type for block in message.content]
    assert kinds == ["thinking", "text"], kinds
    thinking = message.content[0].thinking  # type: ignore[union-attr]
    assert len(thinking.split()) == BUDGET  # the cap: phase 1 stopped there
    assert len(message.content[1].text.split()) == ANSWER  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == BUDGET + ANSWER
    assert sim.engine.stats.requests == 2  # both phases, on the one engine
    assert gw.metrics.tally.truncations == 1
    assert gw.metrics.tally.budgets == {"gateway": 1}
