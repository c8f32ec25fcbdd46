"""A thinking cap on ``/v1/messages`` for an engine that serves Messages natively but cannot cap thinking
there (SGLang's Messages route accepts ``budget_tokens`` without enforcing it; ``budget_enforcement:
gateway``): that attempt goes as chat completions, where the cap is the dialect's chat field or the gateway's
two phases, and the client gets Anthropic's shape back (the official ``anthropic`` SDK as caller).

The engine is the simulator, served on a socket, behind a recorder of the exact bytes it received and
answered; requests that need no cap still reach its own ``/v1/messages`` as the client's bytes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backends.sim import SimConfig
from backends.sim.app import create_sim_app, engine_of
from backends.sim.config import Faults
from config.settings import load_settings
from gateway.app import Gateway, create_app

from upstreams import serve

BUDGET = 1024  # Anthropic's least budget
SIM_MODEL = SimConfig().models[0]
REASONING = 1500  # what the simulator thinks without a cap
ANSWER = 8
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


@dataclass
class Exchange:
    path: str
    sent: bytes  # what the engine received
    answered: bytes = b""  # what it answered (a whole body, or the stream's events)
    status: int = 0

    def body(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.sent)
        return doc

    def chat_usage(self) -> dict[str, Any]:
        """The usage the engine reported on chat (a body's, or a stream's last usage chunk)."""
        if self.answered.startswith(b"{"):
            usage: dict[str, Any] = json.loads(self.answered)["usage"]
            return usage
        lines = [ln[6:] for ln in self.answered.split(b"\n") if ln.startswith(b"data: {")]
        found = [json.loads(ln)["usage"] for ln in lines if b'"usage"' in ln]
        return found[-1]  # type: ignore[no-any-return]


@dataclass
class Recorder:
    """An ASGI wrapper keeping each POST's path, request bytes and response bytes."""

    app: ASGIApp
    exchanges: list[Exchange] = field(default_factory=list)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        exchange = Exchange(scope["path"], b"".join(chunks))
        self.exchanges.append(exchange)
        given = False

        async def replay() -> Message:
            nonlocal given
            if given:
                return await receive()  # the disconnect, when it comes
            given = True
            return {"type": "http.request", "body": exchange.sent, "more_body": False}

        async def keep(message: Message) -> None:
            if message["type"] == "http.response.start":
                exchange.status = message["status"]
            elif message["type"] == "http.response.body":
                exchange.answered += message.get("body", b"")
            await send(message)

        await self.app(scope, replay, keep)


@dataclass
class Stack:
    url: str
    gw: Gateway
    engine: Recorder
    model: str

    def client(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="k", max_retries=0, timeout=60)

    def paths(self) -> list[str]:
        return [e.path for e in self.engine.exchanges]


Make = Callable[..., Stack]


@pytest.fixture
def stack() -> Iterator[Make]:
    """``stack({"dialect": "sglang"})``: one simulator that always thinks, serving /v1/messages natively,
    behind a gateway whose one backend has those settings."""
    with contextlib.ExitStack() as stack:

        def make(backend: dict[str, Any], **settings: Any) -> Stack:
            cfg = SimConfig(
                name="a", reasoning=True, reasoning_tokens=(REASONING, REASONING),
                answer_tokens=(ANSWER, ANSWER), time_scale=0.0, decode_tps=100000.0,
            )  # fmt: skip
            app = create_sim_app(cfg)
            stack.callback(engine_of(app).close)
            recorder = Recorder(app)
            sim_url, _ = stack.enter_context(serve(recorder))
            backends = [{"id": "a", "url": sim_url, "models": list(cfg.models), **backend}]
            gw_app = create_app(load_settings(None, backends=backends, canary={"enabled": False}, **settings))
            url, _ = stack.enter_context(serve(gw_app))
            return Stack(url, gw_app.state.gateway, recorder, cfg.models[0])

        yield make


def _ask(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "max_tokens": 4000,
        "messages": [{"role": "user", "content": "why is the sky blue"}],
        "thinking": {"type": "enabled", "budget_tokens": BUDGET},
        **extra,
    }


def _create(s: Stack, stream: bool, **extra: Any) -> anthropic.types.Message:
    client = s.client()
    if stream:
        with client.messages.stream(**_ask(s.model, **extra)) as events:
            return events.get_final_message()
    return client.messages.create(**_ask(s.model, **extra))


def _anthropic_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error", body
    message: str = body["error"]["message"]
    return message


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_gateway_enforced_backend_gets_two_chat_phases_and_the_client_one_message(
    stack: Make, stream: bool
) -> None:
    s = stack({"dialect": "vllm", "budget_enforcement": "gateway"})
    message = _create(s, stream)
    assert s.paths() == [CHAT, CHAT]  # both phases as chat, none on its own /v1/messages
    phase1, phase2 = (e.body() for e in s.engine.exchanges)
    assert "thinking" not in phase1 and "thinking_budget" not in phase1
    assert "thinking_token_budget" not in phase1  # the gateway caps it, not the engine
    assert phase1["messages"] == [{"role": "user", "content": "why is the sky blue"}]
    assert phase1["max_tokens"] == BUDGET  # phase 1 stops at the budget
    assert phase1.get("stream", False) is stream
    if stream:
        assert phase1["stream_options"] == {"include_usage": True}
    last = phase2["messages"][-1]
    assert last["role"] == "assistant" and last["content"].startswith("<think>\n")
    assert len(last["content"].split()) > BUDGET  # phase 1's thought, continued
    assert phase2["continue_final_message"] is True and phase2["add_generation_prompt"] is False
    assert phase2["max_tokens"] == 4000 - BUDGET

    assert [b.type for b in message.content] == ["thinking", "text"]
    assert len(message.content[0].thinking.split()) == BUDGET  # type: ignore[union-attr]
    assert len(message.content[1].text.split()) == ANSWER  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"
    engine_usage = s.engine.exchanges[0].chat_usage()
    cached = (engine_usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert message.usage.output_tokens == BUDGET + ANSWER
    assert message.usage.input_tokens == engine_usage["prompt_tokens"] - cached  # the prompt counted once
    assert (message.usage.cache_read_input_tokens or 0) == cached
    assert s.gw.metrics.tally.budgets == {"gateway": 1}
    assert s.gw.metrics.tally.truncations == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_sglang_backend_gets_chat_with_its_own_cap_field(stack: Make, stream: bool) -> None:
    s = stack({"dialect": "sglang"})
    message = _create(s, stream)
    (exchange,) = s.engine.exchanges
    assert exchange.path == CHAT
    sent = exchange.body()
    assert sent["custom_params"] == {"thinking_budget": BUDGET}  # SGLang caps it on chat
    assert "thinking" not in sent and "thinking_budget" not in sent
    assert sent["max_tokens"] == 4000
    # The simulator reads no custom_params: it thinks all it would; the client gets it as one Message.
    usage = exchange.chat_usage()
    assert [b.type for b in message.content] == ["thinking", "text"]
    assert len(message.content[0].thinking.split()) == REASONING  # type: ignore[union-attr]
    assert message.usage.output_tokens == usage["completion_tokens"] == REASONING + ANSWER
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert message.usage.input_tokens == usage["prompt_tokens"] - cached
    assert s.gw.metrics.tally.budgets == {"native": 1}


@pytest.mark.parametrize(
    "backend", [{"dialect": "sglang"}, {"dialect": "vllm", "budget_enforcement": "gateway"}]
)
def test_without_a_cap_to_enforce_the_engine_gets_the_clients_bytes_on_its_own_route(
    stack: Make, backend: dict[str, Any]
) -> None:
    s = stack(backend)
    off = json.dumps(_ask(s.model, thinking={"type": "disabled"})).encode()
    plain = json.dumps({k: v for k, v in _ask(s.model).items() if k != "thinking"}).encode()
    for raw in (off, plain):
        r = httpx.post(
            s.url + MESSAGES, content=raw, headers={"content-type": "application/json"}, timeout=30
        )
        assert r.status_code == 200, r.text
        assert r.json()["type"] == "message"
    assert s.paths() == [MESSAGES, MESSAGES]
    assert [e.sent for e in s.engine.exchanges] == [off, plain]


def test_bad_input_keeps_anthropic_s_error_shape_and_reaches_no_engine(stack: Make) -> None:
    s = stack({"dialect": "sglang"})

    def post(body: dict[str, Any]) -> httpx.Response:
        return httpx.post(s.url + MESSAGES, json=body, timeout=30)

    small = _ask(s.model, thinking={"type": "enabled", "budget_tokens": 1000})
    assert "thinking.budget_tokens" in _anthropic_error(post(small), 400)
    no_room = _ask(s.model, max_tokens=BUDGET)
    assert "max_tokens" in _anthropic_error(post(no_room), 400)
    # A block the translation to chat cannot carry: refused naming it, where the cap needs chat.
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    with_doc = _ask(s.model, messages=[{"role": "user", "content": [document]}])
    assert "messages[0].content[0].type" in _anthropic_error(post(with_doc), 400)
    assert s.engine.exchanges == []
    # Without a cap the same document goes to the engine's own route, as the client sent it.
    del with_doc["thinking"]
    raw = json.dumps(with_doc).encode()
    httpx.post(s.url + MESSAGES, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert s.paths() == [MESSAGES] and s.engine.exchanges[0].sent == raw


def test_a_derived_budget_goes_as_chat_unless_the_translation_refuses_the_request(stack: Make) -> None:
    """A model's default budget is the gateway's, not the client's: a request the translation cannot carry
    goes to the engine's own route as sent rather than being refused."""
    s = stack({"dialect": "sglang"}, models={SIM_MODEL: {"default_budget": 2048}})
    plain = {k: v for k, v in _ask(s.model).items() if k != "thinking"}
    assert httpx.post(s.url + MESSAGES, json=plain, timeout=30).status_code == 200
    assert s.paths() == [CHAT] and s.engine.exchanges[0].body()["custom_params"] == {"thinking_budget": 2048}
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    raw = json.dumps({**plain, "messages": [{"role": "user", "content": [document]}]}).encode()
    httpx.post(s.url + MESSAGES, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert s.paths() == [CHAT, MESSAGES] and s.engine.exchanges[1].sent == raw


def test_a_retry_on_an_engine_that_caps_it_itself_gets_the_clients_bytes() -> None:
    """Per attempt: the SGLang attempt went as chat and failed before its first byte; the retry on vLLM,
    whose Messages route caps ``budget_tokens`` itself, is the client's body on its own route."""
    with contextlib.ExitStack() as stack:
        recorders: dict[str, Recorder] = {}
        backends = []
        for name, dialect, fail in (("s", "sglang", 1), ("v", "vllm", 0)):
            cfg = SimConfig(name=name, time_scale=0.0, faults=Faults(fail_next=fail))
            app = create_sim_app(cfg)
            stack.callback(engine_of(app).close)
            recorders[name] = Recorder(app)
            sim_url, _ = stack.enter_context(serve(recorders[name]))
            backends.append({"id": name, "url": sim_url, "models": list(cfg.models), "dialect": dialect})
        settings = load_settings(None, backends=backends, canary={"enabled": False})
        url, _ = stack.enter_context(serve(create_app(settings)))
        sent: dict[str, bytes] = {}
        for i in range(4):  # new conversations spread over both engines: one reaches "s" first
            raw = json.dumps(_ask(SIM_MODEL, system=f"agent {i}")).encode()
            r = httpx.post(
                url + MESSAGES, content=raw, headers={"content-type": "application/json"}, timeout=30
            )
            assert r.status_code == 200, r.text
            sent[f"agent {i}"] = raw
    failed = recorders["s"].exchanges[0]
    assert (failed.path, failed.status) == (CHAT, 500)  # the translated attempt, failed before its first byte
    system = failed.body()["messages"][0]["content"]
    retried = [e for e in recorders["v"].exchanges if e.sent == sent[system]]
    assert [e.path for e in retried] == [MESSAGES]  # the client's bytes on vLLM's own route


# -- /v1/responses: an effort's budget (the model's effort table, as on chat) -------------------------------

LOW = 512  # the default effort table's "low"
RESPONSES = "/v1/responses"


def _openai(s: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="k", max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_responses_effort_where_the_gateway_enforces_budgets_goes_as_two_chat_phases(
    stack: Make, stream: bool
) -> None:
    s = stack({"dialect": "vllm", "budget_enforcement": "gateway"})
    ask: dict[str, Any] = {
        "model": s.model, "input": "why is the sky blue", "reasoning": {"effort": "low"}, "store": False,
        "max_output_tokens": 4000,
    }  # fmt: skip
    client = _openai(s)
    if stream:
        with client.responses.stream(**ask) as events:
            response = events.get_final_response()
    else:
        response = client.responses.create(**ask)
    assert s.paths() == [CHAT, CHAT]
    phase1, phase2 = (e.body() for e in s.engine.exchanges)
    assert phase1["reasoning_effort"] == "low" and phase1["max_tokens"] == LOW
    assert "reasoning" not in phase1 and "thinking_token_budget" not in phase1
    assert phase2["continue_final_message"] is True and phase2["max_tokens"] == 4000 - LOW
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"], kinds
    reasoning = response.output[0].content[0].text  # type: ignore[union-attr,index]
    assert len(reasoning.split()) == LOW
    assert len(response.output_text.split()) == ANSWER
    assert response.status == "completed"
    usage = s.engine.exchanges[0].chat_usage()
    assert response.usage is not None
    assert response.usage.output_tokens == LOW + ANSWER
    assert response.usage.input_tokens == usage["prompt_tokens"]  # the prompt counted once
    assert s.gw.metrics.tally.budgets == {"gateway": 1}


def test_a_responses_effort_goes_to_the_engines_own_route_where_it_caps_thinking_itself(stack: Make) -> None:
    s = stack({"dialect": "vllm"})  # vLLM caps budgets itself: its Responses route takes the effort
    raw = json.dumps(
        {"model": s.model, "input": "hi", "reasoning": {"effort": "low"}, "store": False}
    ).encode()
    r = httpx.post(s.url + RESPONSES, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text
    assert s.paths() == [RESPONSES] and s.engine.exchanges[0].sent == raw


def test_a_responses_effort_on_a_response_the_engine_may_store_goes_to_its_own_route(stack: Make) -> None:
    """``store`` left out: the engine keeps the response for a later ``previous_response_id``, which a
    translated answer could not serve; so the effort goes to the engine's own route, as sent."""
    s = stack({"dialect": "vllm", "budget_enforcement": "gateway"})
    raw = json.dumps({"model": s.model, "input": "hi", "reasoning": {"effort": "low"}}).encode()
    r = httpx.post(s.url + RESPONSES, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text
    assert s.paths() == [RESPONSES] and s.engine.exchanges[0].sent == raw
    follow = {"model": s.model, "input": "more", "previous_response_id": r.json()["id"]}
    assert httpx.post(s.url + RESPONSES, json=follow, timeout=30).status_code == 200


def test_a_chained_responses_effort_goes_to_the_owner_s_own_route_as_sent(stack: Make) -> None:
    """Only the engine's Responses route holds the previous response: a chain is never translated, and
    the effort's budget, which the client did not ask for, is not enforced there."""
    s = stack({"dialect": "vllm", "budget_enforcement": "gateway"})
    first = httpx.post(
        s.url + RESPONSES, json={"model": s.model, "input": "hi", "reasoning": {"effort": "none"}}, timeout=30
    )
    assert first.status_code == 200, first.text
    body = {"model": s.model, "input": "more", "previous_response_id": first.json()["id"], "store": False}
    raw = json.dumps({**body, "reasoning": {"effort": "low"}}).encode()
    r = httpx.post(s.url + RESPONSES, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 200, r.text
    assert s.paths() == [RESPONSES, RESPONSES] and s.engine.exchanges[1].sent == raw


@pytest.mark.parametrize(
    "backend",
    [{"dialect": "sglang"}, {"dialect": "vllm", "budget_enforcement": "gateway"}],
    ids=["no-responses-route", "gateway-enforced"],
)
def test_a_header_effort_reaches_a_translated_attempt_as_the_body_s_would(
    stack: Make, backend: dict[str, Any]
) -> None:
    """An effort from ``x-reasoning-effort`` is the request's effort, as one in ``reasoning.effort`` is: the
    chat body the engine receives is the same bytes either way (SGLang: no Responses route, its cap in
    ``custom_params``; gateway-enforced: phase 1 capped at the effort's budget)."""
    s = stack(backend)
    ask = {"model": s.model, "input": "why is the sky blue", "store": False, "max_output_tokens": 4000}
    by_body = httpx.post(s.url + RESPONSES, json={**ask, "reasoning": {"effort": "low"}}, timeout=30)
    assert by_body.status_code == 200, by_body.text
    sent_by_body = [e.sent for e in s.engine.exchanges]
    by_header = httpx.post(s.url + RESPONSES, json=ask, headers={"x-reasoning-effort": "low"}, timeout=30)
    assert by_header.status_code == 200, by_header.text
    sent_by_header = [e.sent for e in s.engine.exchanges[len(sent_by_body) :]]
    assert set(s.paths()) == {CHAT}
    assert sent_by_header == sent_by_body
    first = json.loads(sent_by_header[0])
    assert first["reasoning_effort"] == "low" and "reasoning" not in first
    if backend["dialect"] == "sglang":
        assert first["custom_params"] == {"thinking_budget": LOW} and first["max_tokens"] == 4000
    else:
        assert first["max_tokens"] == LOW and len(sent_by_header) == 2  # two phases, the first capped
    assert by_header.json()["output"][-1]["type"] == "message"
