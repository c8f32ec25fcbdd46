"""Volatile system text: left out of the key, and stripped from what an engine is sent where that engine
keeps it (per dialect and shape, or per backend setting); otherwise engines get the client's bytes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import anyio
import httpx
import pytest
from test_metrics import counts

from backends.registry import Backend
from config.settings import BackendConfig, load_settings
from gateway.app import create_app
from gateway.context import Draft, canonical_json
from gateway.inbound import require_model
from gateway.shapes.base import ApiShape
from gateway.shapes.table import CHAT
from gateway.volatile import VolatileStrip, strip_messages
from routing.keys import chat_key
from routing.volatile import BILLING_PREFIX, VolatileRules

from upstreams import FakeEngine, serve

RULES = VolatileRules()
SYSTEM_TEXT = "You are Claude Code, a coding agent."
FORWARD = "warmroute_volatile_normalised_requests_total"


def billing(nonce: str) -> dict[str, str]:
    return {
        "type": "text",
        "text": f"{BILLING_PREFIX} cc_version=2.1.37.e1f; cc_entrypoint=cli; cch={nonce};",
    }


def anthropic(nonce: str, **extra: Any) -> dict[str, Any]:
    system = [billing(nonce), {"type": "text", "text": SYSTEM_TEXT, "cache_control": {"type": "ephemeral"}}]
    return {"model": "m", "max_tokens": 64, "system": system, "messages": [{"role": "user", "content": "hi"}],
            **extra}  # fmt: skip


def chat(nonce: str) -> dict[str, Any]:
    system = {"role": "system", "content": [billing(nonce), {"type": "text", "text": SYSTEM_TEXT}]}
    return {"model": "m", "messages": [system, {"role": "user", "content": "hi"}], "stream": False}


def backend(dialect: str = "openai", strip: bool | None = None) -> Backend:
    cfg = {
        "id": "x",
        "url": "http://127.0.0.1:1",
        "models": ["m"],
        "dialect": dialect,
        "strip_volatile": strip,
    }
    return Backend(BackendConfig.model_validate(cfg))


async def shaped(body: dict[str, Any], b: Backend, rules: VolatileRules = RULES) -> Draft:
    draft = Draft(body)
    await VolatileStrip(rules).prepare(None, b, draft)  # type: ignore[arg-type]  # ctx is not read
    return draft


@pytest.mark.parametrize(
    ("dialect", "strip", "body", "stripped"),
    [
        ("openai", None, anthropic("1"), True),
        ("llamacpp", None, anthropic("1"), True),  # llama.cpp keeps it (its issue #20623)
        ("sglang", None, anthropic("1"), True),  # SGLang's Anthropic conversion keeps every system block
        ("vllm", None, anthropic("1"), False),  # vLLM's /v1/messages drops it before templating
        ("vllm", None, chat("1"), False),  # ... and so does its chat endpoint, from system messages
        ("vllm", True, anthropic("1"), True),
        ("vllm", True, chat("1"), True),
        ("llamacpp", False, anthropic("1"), False),
        ("openai", None, chat("1"), True),
        ("openai", False, chat("1"), False),
    ],
)
def test_each_dialect_and_setting_strips_or_forwards_the_block(
    dialect: str, strip: bool | None, body: dict[str, Any], stripped: bool
) -> None:
    before = json.loads(json.dumps(body))
    draft = anyio.run(shaped, body, backend(dialect, strip))
    assert body == before  # the inbound body is never changed: a retry starts from it
    assert draft.changed is stripped
    out = draft.read()
    assert out is not None
    if "system" in body:
        assert (out["system"] == body["system"][1:]) is stripped
    else:
        assert (out["messages"][0]["content"] == body["messages"][0]["content"][1:]) is stripped


def test_a_vllm_messages_body_still_loses_volatile_text_vllm_does_not_drop_itself() -> None:
    rules = VolatileRules((BILLING_PREFIX, "Current date:"))
    body = anthropic("1")
    body["system"].insert(1, {"type": "text", "text": "Current date: 2026-12-01"})
    out = anyio.run(shaped, body, backend("vllm"), rules).read()
    assert out is not None and out["system"] == [billing("1"), body["system"][2]]


def test_a_system_of_nothing_but_volatile_text_goes_and_so_does_an_emptied_message() -> None:
    body = {"model": "m", "system": billing("1")["text"], "messages": [{"role": "user", "content": "q"}]}
    out = anyio.run(shaped, body, backend()).read()
    assert out is not None and "system" not in out and out["messages"] is body["messages"]
    messages = [{"role": "system", "content": [billing("1")]}, {"role": "developer", "content": "keep"},
                {"role": "user", "content": [billing("2")]}]  # fmt: skip
    assert strip_messages(messages, RULES) == messages[1:]
    untouched = messages[1:]
    assert strip_messages(untouched, RULES) is untouched


# -- through a gateway --------------------------------------------------------------------------------


def _anthropic_key(body: dict[str, Any], model: str, _routing: Any) -> str:
    return chat_key({"model": model, "messages": body["messages"]})  # stand-in: the real shape is elsewhere


#: A stand-in /v1/messages shape for this test: the real one is its own module; the strip step only reads
#: the body's structure.
MESSAGES = ApiShape(name="messages-test", path="/v1/messages", validate=require_model, key=_anthropic_key)
Gateway = tuple[str, dict[str, FakeEngine], Any]


@pytest.fixture
def gateway() -> Iterator[Callable[..., Gateway]]:
    with contextlib.ExitStack() as stack:

        def start(backends: list[dict[str, Any]], **overrides: Any) -> Gateway:
            fakes = {b["id"]: FakeEngine(b["id"]) for b in backends}
            for b in backends:
                b.setdefault("models", ["m"])
                b["url"] = stack.enter_context(serve(fakes[b["id"]].app()))[0]
            settings = load_settings(None, backends=backends, canary={"enabled": False}, **overrides)
            app = create_app(settings, shapes=(CHAT, MESSAGES))
            url = stack.enter_context(serve(app))[0]
            return url, fakes, app.state.gateway

        yield start


class _C:
    def __init__(self, url: str) -> None:
        self.url = url


def test_engines_get_the_stripped_body_or_the_clients_bytes_as_their_dialect_needs(
    gateway: Callable[..., Gateway],
) -> None:
    url, engines, _ = gateway([{"id": "v", "dialect": "vllm"}, {"id": "l", "dialect": "llamacpp"}],
                              routing={"policy": "round_robin"})  # fmt: skip
    sent: dict[str, bytes] = {}
    for nonce in ("1", "2"):
        raw = json.dumps(anthropic(nonce), indent=2).encode()
        r = httpx.post(url + "/v1/messages", content=raw)
        assert r.status_code == 200, r.text
        sent[r.json()["served_by"]] = raw
    assert engines["v"].raw == [sent["v"]]  # vLLM drops it itself: the client's own bytes
    stripped = anthropic("whatever")
    stripped["system"] = stripped["system"][1:]
    assert engines["l"].raw == [canonical_json(stripped)]
    # Both keyed without it (the key helper of a shape drops it from its system blocks); one stripped.
    assert counts(_C(url), FORWARD) == {("key",): 2, ("forward",): 1}  # type: ignore[arg-type]


def test_chat_turns_with_fresh_nonces_key_alike_and_each_is_counted(gateway: Callable[..., Gateway]) -> None:
    # Affinity: one key, one pin (under ttft repeated first turns are twins of one head, placed apart).
    url, engines, _ = gateway([{"id": "a"}, {"id": "b"}], routing={"policy": "affinity"})
    homes = set()
    for nonce in ("1", "2", "3"):
        r = httpx.post(url + "/v1/chat/completions", json=chat(nonce))
        assert r.status_code == 200, r.text
        homes.add(r.headers["x-warmroute-backend"])
    assert len(homes) == 1  # one conversation, whatever its nonce
    (home,) = homes
    body = chat("0")
    body["messages"] = [
        {"role": "system", "content": body["messages"][0]["content"][1:]},
        body["messages"][1],
    ]
    assert engines[home].raw == [canonical_json(body)] * 3
    assert counts(_C(url), FORWARD) == {("key",): 3, ("forward",): 3}  # type: ignore[arg-type]


def test_a_backend_that_forwards_as_sent_gets_the_clients_bytes_and_the_key_still_ignores_the_nonce(
    gateway: Callable[..., Gateway],
) -> None:
    url, engines, _ = gateway([{"id": "a", "strip_volatile": False}])
    raws = [json.dumps(chat(n)).encode() for n in ("1", "2")]
    for raw in raws:
        assert httpx.post(url + "/v1/chat/completions", content=raw).status_code == 200
    assert engines["a"].raw == raws
    assert counts(_C(url), FORWARD) == {("key",): 2}  # type: ignore[arg-type]


def test_no_prefixes_no_step_and_no_count(gateway: Callable[..., Gateway]) -> None:
    url, engines, gw = gateway([{"id": "a"}], routing={"volatile_prefixes": []})
    raw = json.dumps(chat("1")).encode()
    assert httpx.post(url + "/v1/chat/completions", content=raw).status_code == 200
    assert engines["a"].raw == [raw]
    assert not [m for m in gw.proxy.phases.prepare if isinstance(m, VolatileStrip)]
    assert counts(_C(url), FORWARD) == {}  # type: ignore[arg-type]
