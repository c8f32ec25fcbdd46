"""The gateway-enforced thinking budget on the simulator: two phases on one backend, one response."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from backends.sim import SimConfig, SimServer
from config.settings import DEFAULT_EARLY_STOP, ThinkingConfig
from gateway.app import Gateway, create_app
from gateway.continuation import Continuation, _Phase
from gateway.metrics import Metrics
from gateway.shapes.table import CHAT

from upstreams import PROBE_TIMEOUT_S, serve

MSGS = [{"role": "user", "content": "why is the sky blue"}]
Gw = tuple[str, Gateway, dict[str, SimServer]]


@pytest.fixture
def gateway() -> Iterator[Callable[..., Gw]]:
    """Simulators that always think (20 reasoning tokens, then 8 answer tokens) behind one gateway."""
    stack = contextlib.ExitStack()

    def make(names: tuple[str, ...] = ("a", "b"), enforcement: str = "auto", **sim: Any) -> Gw:
        sims: dict[str, SimServer] = {}
        backends = []
        for name in names:
            cfg = SimConfig(
                name=name,
                reasoning=True,
                reasoning_tokens=(20, 20),
                answer_tokens=(8, 8),
                time_scale=sim.get("time_scale", 0.0),
                decode_tps=sim.get("decode_tps", 1000.0),
            )
            sims[name] = stack.enter_context(SimServer(cfg))
            backends.append(
                {
                    "id": name,
                    "url": sims[name].base_url,
                    "models": list(cfg.models),
                    "dialect": "openai",
                    "budget_enforcement": enforcement,
                }
            )
        from config.settings import load_settings

        # No admission canary: these tests count the requests each engine received.
        settings = load_settings(
            None,
            backends=backends,
            health={"interval_s": 0.2, "timeout_s": PROBE_TIMEOUT_S},
            canary={"enabled": False},
        )
        app = create_app(settings)
        url, _ = stack.enter_context(serve(app))
        return url, app.state.gateway, sims

    with stack:
        yield make


def _model(sims: dict[str, SimServer]) -> str:
    return next(iter(sims.values())).cfg.models[0]


def _requests(sims: dict[str, SimServer]) -> dict[str, int]:
    return {n: s.engine.stats.requests for n, s in sims.items()}


def test_non_streamed_reasoning_is_capped_and_stitched(gateway: Callable[..., Gw]) -> None:
    url, gw, sims = gateway()
    body = {"model": _model(sims), "messages": MSGS, "thinking_budget": 5, "max_tokens": 100}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    out = r.json()
    message = out["choices"][0]["message"]
    assert len(message["reasoning"].split()) == 5 and message["reasoning_content"] == message["reasoning"]
    assert len(message["content"].split()) == 8
    assert out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] == 5 + 8
    assert out["usage"]["total_tokens"] == out["usage"]["prompt_tokens"] + 13
    phase1_prompt = out["usage"]["prompt_tokens"]
    # both phases went to the one backend that answered, and phase 2 found phase 1's prompt in its cache
    counts = _requests(sims)
    assert sorted(counts.values()) == [0, 2]
    engine = sims[r.headers["x-warmroute-backend"]].engine
    assert engine.stats.prefix_cache_hits >= phase1_prompt - engine.cfg.block_size
    assert gw.metrics.tally.truncations == 1 and gw.metrics.tally.reasoning_tokens == 5
    assert gw.metrics.tally.budgets == {"gateway": 1}


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        chunks.append(json.loads(line[6:]))
    return chunks


def test_streamed_reasoning_is_capped_and_stitched(gateway: Callable[..., Gw]) -> None:
    url, _gw, sims = gateway()
    body = {
        "model": _model(sims),
        "messages": MSGS,
        "stream": True,
        "stream_options": {"include_usage": True},
        "thinking_budget": 6,
    }
    chunks = _stream(url, body)
    assert len({c["id"] for c in chunks}) == 1
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    kinds = ["r" if "reasoning" in d["delta"] else "c" if d["delta"].get("content") else "-" for d in deltas]
    text = "".join(kinds)
    assert text.strip("-") == "r" * 6 + "c" * 8  # reasoning, then the answer, nothing interleaved
    assert [d["finish_reason"] for d in deltas if d["finish_reason"]] == ["stop"]
    assert all(
        d["delta"].get("reasoning_content") == d["delta"]["reasoning"]
        for d in deltas
        if "reasoning" in d["delta"]
    )
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and usage["completion_tokens"] == 14
    assert sorted(_requests(sims).values()) == [0, 2]


def test_no_usage_chunk_unless_asked_and_budget_not_reached(gateway: Callable[..., Gw]) -> None:
    url, gw, sims = gateway(("a",))
    chunks = _stream(url, {"model": _model(sims), "messages": MSGS, "stream": True, "thinking_budget": 50})
    assert all("usage" not in c for c in chunks)  # phase 1 forced usage on; the client did not ask
    assert sum(1 for c in chunks if c["choices"] and "reasoning" in c["choices"][0]["delta"]) == 20
    assert _requests(sims) == {"a": 1} and gw.metrics.tally.truncations == 0


def test_the_openai_client_reads_the_stitched_stream(gateway: Callable[..., Gw]) -> None:
    url, _gw, sims = gateway(("a",))
    client = openai.OpenAI(base_url=url + "/v1", api_key="x")
    stream = client.chat.completions.create(
        model=_model(sims), messages=MSGS, stream=True, extra_body={"thinking_budget": 3}, max_tokens=50
    )
    content = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert len(content.split()) == 8


def test_disconnect_in_phase_two_cancels_the_engine(gateway: Callable[..., Gw]) -> None:
    url, gw, sims = gateway(("a",), time_scale=1.0, decode_tps=20.0)  # the 8 answer tokens take ~0.4 s
    engine = sims["a"].engine
    body = {"model": _model(sims), "messages": MSGS, "stream": True, "thinking_budget": 2}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # the first answer token: phase 2 is under way
    deadline = time.monotonic() + 5
    while engine.stats.finished["abort"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats.requests == 2
    assert engine.stats.finished["abort"] == 1 and engine.stats.finished["length"] == 1
    while gw.registry.total_in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gw.registry.total_in_flight() == 0


def test_phase_two_body() -> None:
    cont = Continuation(ThinkingConfig(), Metrics.__new__(Metrics))
    original = {
        "model": "m",
        "messages": MSGS,
        "thinking_budget": 4,
        "reasoning_effort": "high",
        "max_completion_tokens": 40,
        "chat_template_kwargs": {"k": 1},
    }
    phase = _Phase(reasoning=["a", " b"], usage={"prompt_tokens": 9, "completion_tokens": 4})
    out = cont.phase2_body(original, phase, stream=False)
    assert out == {
        "model": "m",
        "messages": [*MSGS, {"role": "assistant", "content": "<think>\na b" + DEFAULT_EARLY_STOP}],
        "max_completion_tokens": 36,
        "chat_template_kwargs": {"k": 1, "enable_thinking": False},
        "continue_final_message": True,
        "add_generation_prompt": False,
        "stream": False,
    }
    assert original["messages"] == MSGS  # the client's body is never mutated
    answered = _Phase(reasoning=["r"], content=["The"], usage={"completion_tokens": 4})
    tail = cont.phase2_body(original, answered, stream=True)["messages"][-1]["content"]
    assert tail == "<think>\nr\n</think>\n\nThe"  # the answer had begun: continue it, no early-stop phrase


def test_disconnect_in_phase_one_cancels_the_engine_and_sends_no_phase_two(
    gateway: Callable[..., Gw],
) -> None:
    url, gw, sims = gateway(("a",), time_scale=1.0, decode_tps=20.0)  # 20 reasoning tokens take ~1 s
    engine = sims["a"].engine
    body = {"model": _model(sims), "messages": MSGS, "stream": True, "thinking_budget": 15}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
        for line in r.iter_lines():
            if '"reasoning"' in line:
                break  # phase 1 is under way
    deadline = time.monotonic() + 5
    while engine.stats.finished["abort"] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats.finished["abort"] == 1 and engine.stats.requests == 1
    while gw.registry.total_in_flight() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gw.registry.total_in_flight() == 0


def test_a_silent_engine_ends_the_stitched_stream_with_an_error() -> None:
    import threading

    from config.settings import load_settings

    from upstreams import FakeEngine

    gate = threading.Event()  # never set: the engine goes silent after its first chunk
    fake = FakeEngine("a", gate=gate)
    with serve(fake.app()) as (engine_url, _):
        backends = [{"id": "a", "url": engine_url, "models": ["m"], "dialect": "openai"}]
        settings = load_settings(None, backends=backends, timeouts={"read_s": 0.3})
        with serve(create_app(settings)) as (url, _):
            body = {"model": "m", "messages": MSGS, "stream": True, "thinking_budget": 5}
            started = time.monotonic()
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=10)
            gate.set()
    assert r.status_code == 200 and time.monotonic() - started < 5  # read_s 0.3 and a loaded machine's slack
    assert (
        r.text.endswith("data: [DONE]\n\n") and "event: error" in r.text and "sent nothing for 0.3s" in r.text
    )
    assert json.loads(fake.raw[0])["max_tokens"] == 5  # phase 1 carried the budget as its token limit


def test_an_answer_cut_at_the_budget_is_continued_without_the_early_stop() -> None:
    cfg = SimConfig(name="a", reasoning=True, reasoning_tokens=(3, 3), answer_tokens=(8, 8), time_scale=0.0)
    with SimServer(cfg) as sim:
        backends = [{"id": "a", "url": sim.base_url, "models": list(cfg.models), "dialect": "openai"}]
        from config.settings import load_settings

        settings = load_settings(None, backends=backends, canary={"enabled": False})  # counts requests
        with serve(create_app(settings)) as (url, _):
            body = {"model": cfg.models[0], "messages": MSGS, "thinking_budget": 5, "max_tokens": 100}
            out = httpx.post(url + "/v1/chat/completions", json=body, timeout=10).json()
    message = out["choices"][0]["message"]
    assert len(message["reasoning"].split()) == 3  # the thought ended by itself, inside the budget
    assert out["usage"]["completion_tokens"] == 5 + 8  # 3 reasoning + 2 answer tokens, then 8 more
    assert out["choices"][0]["finish_reason"] == "stop" and sim.engine.stats.requests == 2


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"], ids=["lf", "crlf", "cr"])
def test_a_phase_is_read_in_any_sse_framing_cut_anywhere(newline: bytes) -> None:
    from backends.registry import Backend
    from config.settings import BackendConfig
    from gateway.context import Attempt, Draft, RequestContext
    from gateway.sse import EventSplitter
    from gateway.thinking import Thinking
    from routing.policies.round_robin import RoundRobinPolicy

    backend = Backend(BackendConfig(id="a", url="http://a", models=["m"]))

    def delta(text: str) -> bytes:
        return json.dumps({"id": "x", "choices": [{"delta": {"content": text}}]}).encode()

    stream = newline.join(
        [b": ping", b"", b"data: " + delta("a"), b"", b"data:" + delta("b"), b"", b"data: [DONE]", b"", b""]
    )
    body = {"model": "m", "messages": MSGS, "stream": True}
    ctx = RequestContext(
        "POST", "/v1/chat/completions", b"{}", body, "m", "k", RoundRobinPolicy(), [], {}, CHAT
    )
    draft = Draft(body)
    draft.enforced = Thinking(5, None, True)
    cont = Continuation(ThinkingConfig(), Metrics.__new__(Metrics))
    stitch = cont.body_filter(ctx, Attempt(backend, draft), 200, sse=True)
    assert stitch is not None
    splitter = EventSplitter()
    reads = [stream[i : i + 3] for i in range(0, len(stream), 3)]  # CRLFs cut between CR and LF too
    out = [p.raw for r in [*reads, b"data: " + delta("c") + b"\n\n"] for p in stitch.events(splitter.feed(r))]
    assert out == [
        b'data: {"id":"x","choices":[{"delta":{"content":"a"}}]}\n\n',
        b'data: {"id":"x","choices":[{"delta":{"content":"b"}}]}\n\n',
    ]  # the comment dropped, anything after [DONE] too
