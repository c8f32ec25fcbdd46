"""One pipeline: the gateway-enforced thinking budget is a follow-up exchange inside the one relay, so the
guard, the observation tap (metrics, learning), first-byte and prefill accounting see both phases."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from test_proxy_phases import backends_ab, run

from backends.registry import Backend, Registry
from config.settings import GuardAction, GuardConfig, Settings, ThinkingConfig
from gateway.context import Attempt, Draft, RequestContext
from gateway.continuation import Continuation
from gateway.exchange import RelayLimits
from gateway.guard import OutputGuard
from gateway.learning import DEFAULT_CHARS_PER_TOKEN, RoutingFeedback
from gateway.metrics import Metrics
from gateway.observe import Observation, Usage
from gateway.phases import BodyFilter, BodyFilterBase
from gateway.proxy import AdmitAll, Proxy
from gateway.shapes.table import CHAT
from gateway.sse import Pieces
from gateway.state import MemoryAffinityStore
from gateway.thinking import Thinking
from routing.keys import chat_key
from routing.params import RoutingParams
from routing.policies.ttft import TtftPolicy
from routing.types import BackendState

from transports import FakeTransport, Reply

pytestmark = pytest.mark.anyio

SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]
PARAMS = RoutingParams("ttft", 2.0, 8, False)
MSGS = [{"role": "user", "content": "why is the sky blue"}]
PHASE1_USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 8}}
PHASE2_USAGE = {"prompt_tokens": 20, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 17}}


class Enforce:
    """The budget step's decision for every attempt: the gateway enforces a budget of 5 (no dialect)."""

    async def prepare(self, ctx: RequestContext, backend: Backend, draft: Draft) -> None:
        draft.enforced = Thinking(5, None, True)
        draft.edit()["max_tokens"] = 5


class Recorder:
    def __init__(self) -> None:
        self.seen: list[Observation] = []

    def observe(self, obs: Observation) -> None:
        self.seen.append(obs)


def event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def delta(field: str | None, text: str | None = None, finish: str | None = None) -> bytes:
    d = {} if field is None else {field: text}
    return event(
        {"id": "c1", "object": "chat.completion.chunk", "choices": [{"delta": d, "finish_reason": finish}]}
    )


def phase1() -> Reply:
    words = [delta("reasoning_content", w) for w in ("a", " b", " c", " d", " e")]
    tail = [delta(None, finish="length"), event({"choices": [], "usage": PHASE1_USAGE}), b"data: [DONE]\n\n"]
    return Reply(200, SSE, [delta("role", "assistant"), *words, *tail])


def phase2(*words: str) -> Reply:
    chunks = [delta("role", "assistant"), *(delta("content", w) for w in words), delta(None, finish="stop")]
    return Reply(200, SSE, [*chunks, event({"choices": [], "usage": PHASE2_USAGE}), b"data: [DONE]\n\n"])


def chat(**extra: Any) -> RequestContext:
    body = {"model": "m", "messages": MSGS, "stream": True, "thinking_budget": 5, **extra}
    raw = json.dumps(body).encode()
    return RequestContext(
        "POST", "/v1/chat/completions", raw, body, "m", chat_key(body), TtftPolicy(PARAMS), [], {}, CHAT
    )


def build(
    fake: FakeTransport,
    *extra: object,
    parts: tuple[Settings, MemoryAffinityStore, Registry] | None = None,
    guard: GuardConfig | None = None,
    limits: RelayLimits | None = None,
) -> Proxy:
    """A proxy whose every attempt is gateway-enforced: metrics, ``extra``, the guard, the continuation."""
    settings, store, registry = parts or backends_ab()
    metrics = Metrics(registry)
    modules: list[object] = [metrics, Enforce(), *extra]
    if guard is not None:
        modules.append(OutputGuard(guard, metrics))
    modules.append(Continuation(ThinkingConfig(), metrics))
    return Proxy(settings.timeouts, registry, store, AdmitAll(), metrics, fake, modules, limits=limits)


class Prefill(BodyFilterBase):
    """A module that reads backend a's queued-prefill estimate when the attempt is shaped (after it was
    queued) and when the relay hands over the first events (after the first byte)."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry
        self.seen: list[int] = []

    async def prepare(self, ctx: RequestContext, backend: Backend, draft: Draft) -> None:
        self.seen.append(self.registry.backends["a"].prefilling)

    def body_filter(self, ctx: RequestContext, attempt: Attempt, status: int, sse: bool) -> BodyFilter:
        return self

    def events(self, pieces: Pieces) -> Pieces:
        if len(self.seen) == 1:
            self.seen.append(self.registry.backends["a"].prefilling)
        return pieces


def sse_body(sent: list[dict[str, Any]]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def test_the_enforced_path_is_observed_like_any_answer() -> None:
    fake = FakeTransport()
    fake.script("http://a", phase1(), phase2("Blue", " light"))
    fake.script("http://b", phase1(), phase2("Blue", " light"))
    recorder = Recorder()
    parts = backends_ab()
    feedback = RoutingFeedback(parts[2], PARAMS)
    proxy = build(fake, feedback, recorder, parts=parts)
    sent = await run(proxy, ctx := chat(stream_options={"include_usage": True}))
    assert ctx.lease is not None
    backend = ctx.lease.backend.id
    out = sse_body(sent)
    assert out.endswith(b"data: [DONE]\n\n") and b"event: error" not in out
    usage = json.loads(out.split(b"data: ")[-2])["usage"]
    assert usage == {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20,
                     "prompt_tokens_details": {"cached_tokens": 8}}  # fmt: skip
    # the observation: one, with the stitched usage, phase 1's first byte and the follow-up's status
    (obs,) = recorder.seen
    assert obs.usage == Usage(12, 8, 8) and obs.status == 200 and obs.outcome.value == "ok"
    assert obs.first_byte_s is not None and obs.streamed
    # metrics: TTFT once, tokens exactly, the answer's finish reason (phase 1's "length" was our cut)
    tally = proxy.metrics.tally
    assert tally.ttft[("m", backend)].count == 1
    assert tally.tokens[("m", backend)] == [12, 8, 8, 12]
    assert tally.truncations == 1 and tally.reasoning_tokens == 5
    # learning: the ttft policy's observer learned from it (characters per token from the reported prompt)
    assert feedback.chars_per_token.value != DEFAULT_CHARS_PER_TOKEN
    assert parts[2].total_in_flight() == 0


async def test_usage_is_learned_even_when_the_client_did_not_ask_for_it() -> None:
    fake = FakeTransport()
    fake.script("http://a", phase1(), phase2("Blue"))
    fake.script("http://b", phase1(), phase2("Blue"))
    recorder = Recorder()
    proxy = build(fake, recorder)
    sent = await run(proxy, ctx := chat())
    assert b'"usage"' not in sse_body(sent)  # not asked for: not sent
    assert ctx.lease is not None and recorder.seen[0].usage == Usage(12, 8, 8)
    assert proxy.metrics.tally.tokens[("m", ctx.lease.backend.id)] == [12, 8, 8, 12]


async def test_phase_two_reports_finish_reasons_and_the_first_byte_clears_the_prefill_queue() -> None:
    fake = FakeTransport()
    fake.script("http://a", phase1(), phase2("x", " y"))
    parts = backends_ab()
    parts[2].backends["b"].state = BackendState.DOWN
    probe = Prefill(parts[2])
    proxy = build(fake, RoutingFeedback(parts[2], PARAMS), probe, parts=parts, guard=GuardConfig())
    await run(proxy, ctx := chat())
    assert ctx.outcome.value == "ok"
    queued, at_first_byte = probe.seen
    assert queued > 0 and at_first_byte == 0  # left at phase 1's first byte, not at the release
    assert proxy.metrics.tally.finish_reasons == {("a", "stop"): 1}


async def test_a_repetition_loop_in_phase_two_is_cut_by_the_guard() -> None:
    fake = FakeTransport()
    loop = ["duct"] + [" duct"] * 20
    fake.script("http://a", phase1(), phase2(*loop))
    fake.script("http://b", phase1(), phase2(*loop))
    proxy = build(fake, guard=GuardConfig(repeat_count=4, max_period=2, action=GuardAction.END))
    sent = await run(proxy, ctx := chat())
    out = sse_body(sent)
    assert b"event: error" in out and b"output degenerated: 'duct' repeated" in out
    assert out.endswith(b"data: [DONE]\n\n")
    # three deltas went out; the fourth identical one tripped it and was not sent
    assert (out.count(b'"content":"duct"'), out.count(b'"content":" duct"')) == (1, 2)
    assert ctx.outcome.value == "mid_stream_error"
    assert ctx.lease is not None
    assert proxy.metrics.tally.guard_trips == {(ctx.lease.backend.id, "end"): 1}
    assert all(r.closed for r in fake.responses) and proxy.registry.total_in_flight() == 0


async def test_a_non_streamed_enforced_answer_keeps_the_prompt_details() -> None:
    thought = {"role": "assistant", "reasoning_content": "a b"}
    first = {"id": "c1", "usage": PHASE1_USAGE, "choices": [{"message": thought, "finish_reason": "length"}]}
    second = {"usage": PHASE2_USAGE, "choices": [{"message": {"content": "Blue."}, "finish_reason": "stop"}]}
    fake = FakeTransport()
    for url in ("http://a", "http://b"):
        fake.script(url, Reply(200, JSON, [json.dumps(first).encode()]), Reply.json(second))
    recorder = Recorder()
    proxy = build(fake, recorder)
    sent = await run(proxy, ctx := chat(stream=False, max_tokens=100))
    doc = json.loads(sse_body(sent))
    assert doc["usage"] == {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20,
                            "prompt_tokens_details": {"cached_tokens": 8}}  # fmt: skip
    assert doc["choices"][0]["message"]["content"] == "Blue." and doc["choices"][0]["finish_reason"] == "stop"
    (obs,) = recorder.seen
    assert obs.usage == Usage(12, 8, 8) and ctx.outcome.value == "ok"
    assert proxy.registry.total_in_flight() == 0


async def test_a_phase_event_or_body_over_the_bounds_is_refused_not_held() -> None:
    never = asyncio.Event()  # the engine would go on: the gateway must stop reading first
    fake = FakeTransport()
    fake.script("http://a", Reply(200, SSE, [b"data: " + b"x" * 2000, never]))
    fake.script("http://b", Reply(200, JSON, [b"{" + b" " * 1500, never]))
    proxy = build(fake, limits=RelayLimits(max_reply_bytes=1000, max_event_bytes=1024))
    registry = proxy.registry
    registry.backends["b"].state = BackendState.DOWN
    sent = await run(proxy, ctx := chat())
    assert b"sent an event too large to hold" in sse_body(sent) and ctx.outcome.value == "mid_stream_error"
    registry.backends["a"].state, registry.backends["b"].state = BackendState.DOWN, BackendState.READY
    sent = await run(proxy, ctx := chat(stream=False))
    assert sent[0]["status"] == 502 and ctx.outcome.value == "upstream_error"
    assert b"a reply larger than 1000 bytes" in sse_body(sent)
    assert all(r.closed and r.steps == [never] for r in fake.responses)  # read no further than the bound
    assert registry.total_in_flight() == 0
