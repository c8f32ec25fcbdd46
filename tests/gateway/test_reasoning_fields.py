"""Reasoning output arrives in the field(s) the client expects, whichever the engine wrote."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator

import httpx
import pytest

from backends.sim import SimConfig, SimServer
from config.settings import load_settings
from gateway.app import create_app
from gateway.reasoning import FIELDS, ReasoningRelay
from gateway.shapes.table import CHAT

from upstreams import serve

MSGS = [{"role": "user", "content": "hi"}]


@contextlib.contextmanager
def _gateway(fields: str, thinks: bool = True) -> Iterator[str]:
    cfg = SimConfig(name="a", reasoning=True, reasoning_tokens=(4, 4), answer_tokens=(3, 3), time_scale=0.0)
    with SimServer(cfg) as sim:
        backends = [{"id": "a", "url": sim.base_url, "models": list(cfg.models), "dialect": "vllm"}]
        settings = load_settings(
            None,
            backends=backends,
            thinking={"reasoning_fields": fields},
            models={cfg.models[0]: {"thinks": thinks}},
        )
        with serve(create_app(settings)) as (url, _):
            yield url


def _body(stream: bool) -> dict[str, object]:
    return {"model": "sim-model", "messages": MSGS, "stream": stream}


@pytest.mark.parametrize(
    ("fields", "expected"), [("reasoning", {"reasoning"}), ("reasoning_content", {"reasoning_content"})]
)
def test_one_field_only(fields: str, expected: set[str]) -> None:
    with _gateway(fields) as url:
        r = httpx.post(url + "/v1/chat/completions", json=_body(False), timeout=10)
        message = r.json()["choices"][0]["message"]
        assert set(message) & set(FIELDS) == expected
        assert len(message[fields].split()) == 4
        assert "content-length" not in r.headers  # rewritten: its size is not the engine's any more
        with httpx.stream("POST", url + "/v1/chat/completions", json=_body(True), timeout=10) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
        deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
        thought = [d for d in deltas if set(d) & set(FIELDS)]
        assert len(thought) == 4 and all(set(d) & set(FIELDS) == expected for d in thought)


def test_a_model_that_does_not_think_is_relayed_untouched() -> None:
    with _gateway("reasoning", thinks=False) as url:
        message = httpx.post(url + "/v1/chat/completions", json=_body(False), timeout=10).json()["choices"][0]
        assert set(message["message"]) >= {"reasoning", "reasoning_content"}  # the simulator's own both


async def _collect(relay: ReasoningRelay, parts: list[bytes]) -> bytes:
    """The reads as the relay hands them to the filter: through its one splitter, event by event."""
    from backends.registry import Backend
    from config.settings import BackendConfig
    from gateway.context import Attempt, Draft, RequestContext
    from gateway.sse import EventSplitter
    from routing.policies.round_robin import RoundRobinPolicy

    ctx = RequestContext(
        "POST", "/v1/chat/completions", b"{}", {}, "m", "k", RoundRobinPolicy(), [], {}, CHAT
    )
    attempt = Attempt(Backend(BackendConfig(id="a", url="http://a", models=["m"])), Draft({}))
    f = relay.body_filter(ctx, attempt, 200, sse=True)
    assert f is not None and f.rewrites
    splitter = EventSplitter()
    out = [p.raw for part in parts for p in f.events(splitter.feed(part))]
    return b"".join(out) + splitter.close()


@pytest.mark.anyio
async def test_events_split_across_reads_are_rewritten_whole() -> None:
    from config.settings import ReasoningFields

    relay = ReasoningRelay(ReasoningFields.BOTH, lambda _m: True)
    event = b'data: {"choices":[{"delta":{"reasoning":"x"}}]}\n\n'
    plain = b'data: {"choices":[{"delta":{"content":"y"}}]}\n\n'
    out = await _collect(relay, [plain, event[:20], event[20:] + plain[:5], plain[5:], b"data: [DONE]\n\n"])
    assert out == (
        plain
        + b'data: {"choices":[{"delta":{"reasoning":"x","reasoning_content":"x"}}]}\n\n'
        + plain
        + b"data: [DONE]\n\n"
    )
