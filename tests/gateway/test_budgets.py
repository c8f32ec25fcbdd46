"""Thinking budgets: validated at the edge (400, engine never called) and shaped per dialect, per attempt."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from config.settings import load_settings
from gateway.app import create_app
from gateway.inbound import first_values

from upstreams import FAST_HEALTH, FakeEngine, serve

MSGS = [{"role": "user", "content": "hi"}]
MODELS = {"m": {"max_budget": 1000, "effort_budgets": {"none": 0, "low": 100, "high": 900}}}

Gw = tuple[str, dict[str, FakeEngine]]


@pytest.fixture
def gateway() -> Iterator[Callable[..., Gw]]:
    """``gateway({"a": "vllm"}, ...)``: fake engines of those dialects behind one gateway."""
    stack = contextlib.ExitStack()

    def make(dialects: dict[str, str], **overrides: Any) -> Gw:
        fakes = {name: FakeEngine(name) for name in dialects}
        backends = []
        for name, dialect in dialects.items():
            url, _ = stack.enter_context(serve(fakes[name].app()))
            backends.append({"id": name, "url": url, "models": ["m"], "dialect": dialect})
        overrides.setdefault("health", FAST_HEALTH)
        overrides.setdefault("models", MODELS)
        app = create_app(load_settings(None, backends=backends, **overrides))
        url, _ = stack.enter_context(serve(app))
        return url, fakes

    with stack:
        yield make


def _chat(url: str, headers: dict[str, str] | None = None, **fields: Any) -> httpx.Response:
    body = {"model": "m", "messages": MSGS, **fields}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers or {}, timeout=10)


# -- 1. validation: every invalid value is a 400 naming the field and what is allowed ------------------------

BAD = [
    ({"thinking_budget": "100"}, "thinking_budget", "an integer >= 0"),
    ({"thinking_budget": 1.5}, "thinking_budget", "an integer >= 0"),
    ({"thinking_budget": True}, "thinking_budget", "an integer >= 0"),
    ({"thinking_budget": -1}, "thinking_budget", "an integer >= 0"),
    ({"thinking_budget": 1001}, "thinking_budget", "between 0 and 1000"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "none, minimal, low, medium, high, xhigh, max"),
    ({"reasoning_effort": 3}, "reasoning_effort", "none, minimal, low, medium, high, xhigh, max"),
    ({"reasoning_effort": "none", "thinking_budget": 50}, "thinking_budget", "contradicts"),
    ({"reasoning_effort": "high", "thinking_budget": 0}, "thinking_budget", "contradicts"),
    ({"thinking_budget": 100, "max_tokens": 100}, "thinking_budget", "no room for an answer"),
    (
        {"thinking_budget": 200, "max_completion_tokens": 150, "max_tokens": 999},
        "thinking_budget",
        "below 150",
    ),
]


@pytest.mark.parametrize(("fields", "param", "says"), BAD)
def test_invalid_budget_is_400_and_no_engine_is_called(
    gateway: Callable[..., Gw], fields: dict[str, Any], param: str, says: str
) -> None:
    url, fakes = gateway({"a": "vllm"})
    r = _chat(url, **fields)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_request", param)
    assert says in err["message"]
    assert fakes["a"].requests == [] and fakes["a"].raw == []


@pytest.mark.parametrize(
    ("headers", "param", "says"),
    [
        ({"x-thinking-budget": "lots"}, "x-thinking-budget", "an integer >= 0"),
        ({"x-thinking-budget": "-5"}, "x-thinking-budget", "an integer >= 0"),
        ({"x-reasoning-effort": "turbo"}, "x-reasoning-effort", "none, minimal, low"),
        ({"x-thinking-budget": "5000"}, "thinking_budget", "between 0 and 1000"),
    ],
)
def test_invalid_budget_header_is_400(
    gateway: Callable[..., Gw], headers: dict[str, str], param: str, says: str
) -> None:
    url, fakes = gateway({"a": "vllm"})
    r = _chat(url, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and says in r.json()["error"]["message"]
    assert fakes["a"].raw == []


def test_budget_equal_below_max_tokens_is_accepted(gateway: Callable[..., Gw]) -> None:
    url, fakes = gateway({"a": "vllm"})
    assert _chat(url, thinking_budget=99, max_tokens=100).status_code == 200
    assert fakes["a"].requests[0]["thinking_token_budget"] == 99


# -- 2. native shaping: the exact body each dialect receives -------------------------------------------------


def _sent(
    gateway: Callable[..., Gw], dialect: str, headers: dict[str, str] | None = None, **fields: Any
) -> Any:
    url, fakes = gateway({"a": dialect})
    r = _chat(url, headers=headers, **fields)
    assert r.status_code == 200, r.text
    (raw,) = fakes["a"].raw
    return json.loads(raw)


def _expect(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": MSGS, **extra}


@pytest.mark.parametrize(
    ("dialect", "fields", "expected"),
    [
        ("vllm", {"thinking_budget": 300}, _expect(thinking_token_budget=300)),
        ("vllm", {"reasoning_effort": "low"}, _expect(reasoning_effort="low", thinking_token_budget=100)),
        ("vllm", {"reasoning_effort": "xhigh"}, _expect(reasoning_effort="xhigh")),  # no table entry: no cap
        ("vllm", {"thinking_budget": 0}, _expect(chat_template_kwargs={"enable_thinking": False})),
        (
            "vllm",
            {"reasoning_effort": "none", "chat_template_kwargs": {"x": 1}},
            _expect(reasoning_effort="none", chat_template_kwargs={"x": 1, "enable_thinking": False}),
        ),
        ("sglang", {"thinking_budget": 300}, _expect(custom_params={"thinking_budget": 300})),
        (
            "sglang",
            {"thinking_budget": 300, "reasoning_effort": "max", "custom_params": {"k": 2}},
            _expect(custom_params={"k": 2, "thinking_budget": 300}),  # "max" is not SGLang's: dropped
        ),
        ("sglang", {"thinking_budget": 0}, _expect(chat_template_kwargs={"enable_thinking": False})),
        (
            "llamacpp",
            {"thinking_budget": 300},
            _expect(thinking_budget_tokens=300, reasoning_budget_tokens=300),
        ),
        (
            "llamacpp",
            {"thinking_budget": 0},
            _expect(chat_template_kwargs={"enable_thinking": False}, reasoning_effort="none"),
        ),
        (
            "openai",
            {"reasoning_effort": "none"},
            _expect(reasoning_effort="none", chat_template_kwargs={"enable_thinking": False}),
        ),
        ("openai", {"reasoning_effort": "max"}, _expect()),  # not an OpenAI effort; no table entry: no cap
    ],
)
def test_each_dialect_receives_its_own_fields(
    gateway: Callable[..., Gw], dialect: str, fields: dict[str, Any], expected: dict[str, Any]
) -> None:
    assert _sent(gateway, dialect, **fields) == expected


def test_the_shaped_body_is_canonical_bytes(gateway: Callable[..., Gw]) -> None:
    url, fakes = gateway({"a": "vllm"})
    _chat(url, thinking_budget=7)
    assert fakes["a"].raw[0] == (
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"thinking_token_budget":7}'
    )


def test_headers_set_the_budget_and_the_body_wins(gateway: Callable[..., Gw]) -> None:
    assert _sent(gateway, "vllm", headers={"x-thinking-budget": "40"}) == _expect(thinking_token_budget=40)
    sent = _sent(gateway, "vllm", headers={"x-thinking-budget": "40"}, thinking_budget=41)
    assert sent == _expect(thinking_token_budget=41)
    sent = _sent(gateway, "sglang", headers={"x-reasoning-effort": "low"})
    assert sent == _expect(reasoning_effort="low", custom_params={"thinking_budget": 100})
    sent = _sent(gateway, "vllm", headers={"x-reasoning-effort": "high"}, reasoning_effort="low")
    assert sent == _expect(reasoning_effort="low", thinking_token_budget=100)


@pytest.mark.parametrize(
    ("dialect", "effort"),
    [("vllm", "low"), ("vllm", "xhigh"), ("vllm", "none"), ("sglang", "low"), ("sglang", "max"),
     ("llamacpp", "high"), ("openai", "none"), ("openai", "max")],
)  # fmt: skip
def test_a_header_effort_reaches_the_engine_as_the_body_s_would(
    gateway: Callable[..., Gw], dialect: str, effort: str
) -> None:
    """``x-reasoning-effort`` is the request's effort as ``reasoning_effort`` is: the engine gets the same
    body, its native effort control where the dialect takes that value (SGLang has no ``max``, OpenAI no
    ``max``: left out, the engine's default), as a translated Responses attempt does."""
    by_header = _sent(gateway, dialect, headers={"x-reasoning-effort": effort})
    assert by_header == _sent(gateway, dialect, reasoning_effort=effort)
    assert ("reasoning_effort" in by_header) == (effort not in {"max"} or dialect == "vllm")


def test_untouched_body_goes_as_the_clients_bytes(gateway: Callable[..., Gw]) -> None:
    url, fakes = gateway({"a": "vllm"})
    raw = b'{"model": "m",  "messages": [{"role": "user", "content": "hi"}]}'
    httpx.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert fakes["a"].raw == [raw]


def test_model_default_budget_and_non_thinking_model(gateway: Callable[..., Gw]) -> None:
    models = {"m": {"default_budget": 64}}
    url, fakes = gateway({"a": "vllm"}, models=models)
    _chat(url)
    assert json.loads(fakes["a"].raw[0]) == _expect(thinking_token_budget=64)
    url, fakes = gateway({"b": "vllm"}, models={"m": {"thinks": False}})
    _chat(url, thinking_budget=10)
    assert json.loads(fakes["b"].raw[0]) == _expect()  # nothing to cap; our field is not forwarded


def test_retry_on_another_dialect_starts_from_the_original_body(gateway: Callable[..., Gw]) -> None:
    url, fakes = gateway({"a": "vllm", "b": "sglang"})
    fakes["a"].fail_next = 1
    for i in range(20):  # until a new conversation lands on "a" first, fails there and is retried on "b"
        r = _chat(url, headers={"x-session-id": f"s{i}"}, thinking_budget=5, chat_template_kwargs={"k": 1})
        assert r.status_code == 200, r.text
        if fakes["a"].fail_next == 0:
            break
    assert r.headers["x-warmroute-backend"] == "b"
    vllm = _expect(chat_template_kwargs={"k": 1}, thinking_token_budget=5)
    sglang = _expect(chat_template_kwargs={"k": 1}, custom_params={"thinking_budget": 5})
    assert [json.loads(b) for b in fakes["a"].raw] == [vllm]
    assert json.loads(fakes["b"].raw[-1]) == sglang
    assert all(json.loads(b) == sglang for b in fakes["b"].raw)


@pytest.mark.parametrize("field", [{"thinking_budget": 5}, {"reasoning_effort": "low"}])
def test_completions_refuse_a_budget_in_the_body_naming_the_routes_that_take_one(
    gateway: Callable[..., Gw], field: dict[str, Any]
) -> None:
    url, fakes = gateway({"a": "vllm"})
    r = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "x", **field}, timeout=10)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_request", *field)
    assert err["message"].startswith(f"'{next(iter(field))}' does not apply to /v1/completions")
    for route in ("/v1/chat/completions", "/v1/messages", "/v1/responses"):
        assert route in err["message"]
    assert fakes["a"].raw == []


def test_completions_ignore_budget_headers_and_say_so(
    gateway: Callable[..., Gw], caplog: pytest.LogCaptureFixture
) -> None:
    """Clients set the budget headers on every request: on a route without reasoning they are no error, and
    they are announced (counted each time, logged once per header), and the engine gets the client's bytes."""
    caplog.set_level(logging.WARNING, "warmroute.budgets")
    url, fakes = gateway({"a": "vllm"})
    raw = b'{"model": "m", "prompt": "x"}'
    sent = {"content-type": "application/json", "x-thinking-budget": "5", "x-reasoning-effort": "low"}
    for headers in (sent, sent, {"content-type": "application/json", "x-thinking-budget": "lots"}):
        r = httpx.post(url + "/v1/completions", content=raw, headers=headers, timeout=10)
        assert r.status_code == 200, r.text
    assert fakes["a"].raw == [raw, raw, raw]
    text = httpx.get(url + "/metrics").text
    counted = 'warmroute_thinking_ignored_requests_total{header="%s",shape="completions"}'
    assert f"{counted % 'x-thinking-budget'} 3.0" in text
    assert f"{counted % 'x-reasoning-effort'} 2.0" in text
    logged = [r.getMessage() for r in caplog.records if r.name == "warmroute.budgets"]
    assert [m.split(" is ignored on ")[0] for m in logged] == [
        "header x-thinking-budget",
        "header x-reasoning-effort",
    ]
    assert all("/v1/completions" in m and "/v1/chat/completions" in m for m in logged)


def test_metrics_count_budgets_by_enforcement(gateway: Callable[..., Gw]) -> None:
    url, _fakes = gateway({"a": "vllm"})
    _chat(url, thinking_budget=5)
    _chat(url, thinking_budget=0)
    _chat(url, thinking_budget=6)
    _chat(url)  # no budget: not counted
    text = httpx.get(url + "/metrics").text
    assert 'warmroute_thinking_budget_attempts_total{enforced="native"} 2.0' in text
    assert 'warmroute_thinking_budget_attempts_total{enforced="off"} 1.0' in text
    assert 'warmroute_thinking_budget_attempts_total{enforced="gateway"} 0.0' in text


def test_a_budget_header_sent_twice_counts_with_its_first_value() -> None:
    from config.settings import ThinkingConfig
    from gateway.budgets import BudgetPolicy
    from gateway.errors import BadRequest

    policy = BudgetPolicy(ThinkingConfig(), {})
    name = policy.budget_header
    body = {"model": "m", "messages": []}
    first = policy.resolve(body, first_values([(b"accept", b"*/*"), (name, b" 7 "), (name, b"oops")]), "m")
    assert first is not None and first.budget == 7 and first.explicit
    with pytest.raises(BadRequest):
        policy.resolve(body, first_values([(name, b"oops"), (name, b"7")]), "m")
    assert policy.resolve(body, first_values([(b"accept", b"*/*")]), "m") == policy.resolve(
        body, first_values([]), "m"
    )
