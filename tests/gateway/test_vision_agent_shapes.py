"""Images on /v1/messages and /v1/responses for ``vision: embeds`` backends, the official SDKs as callers.

Neither vLLM's Messages route nor its Responses route takes image embeddings (their content parts are closed
lists), so an attempt holding images on an embeds backend goes as chat: the engine must receive
``/v1/chat/completions`` with ``image_embeds`` parts, and the client its own shape back. What the engine
received is read from its raw bytes; what the sidecar was asked, from its call log.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai
import pytest
from vision_fakes import EMBEDS_6X8, GRID_3, FakeSidecar

from config.settings import load_settings
from gateway.app import create_app

from upstreams import FAST_HEALTH, FakeEngine, serve

PNG_B64 = "iVBORw0KGgo="
CAT = f"data:image/png;base64,{PNG_B64}"
DOG = "https://images.example/dog.png"
EMBEDS_PART = {"type": "image_embeds", "image_embeds": {"image_embeds": EMBEDS_6X8, "image_grid_thw": GRID_3}}
B64_BLOCK = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_B64}}
URL_BLOCK = {"type": "image", "source": {"type": "url", "url": DOG}}


@dataclass
class Box:
    url: str
    engines: dict[str, FakeEngine]
    sidecar: FakeSidecar

    def received(self, name: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.engines[name].raw]

    def anthropic(self) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="k", max_retries=0)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="k", max_retries=0)


Make = Callable[..., Box]


@pytest.fixture
def box() -> Iterator[Make]:
    """``box({"e": "embeds", "n": "native"}, sidecar=FakeSidecar(...))``: fake engines, a fake sidecar. The
    dialect is vLLM's, which serves both shapes natively: a chat attempt is the images' doing."""
    stack = contextlib.ExitStack()

    def make(modes: dict[str, str], sidecar: FakeSidecar | None = None, dialect: str = "vllm") -> Box:
        fake = sidecar or FakeSidecar()
        sidecar_url, _ = stack.enter_context(serve(fake.app()))
        engines = {name: FakeEngine(name) for name in modes}
        backends = []
        for name, mode in modes.items():
            url, _ = stack.enter_context(serve(engines[name].app()))
            backends.append({"id": name, "url": url, "models": ["m"], "vision": mode, "dialect": dialect})
        settings = load_settings(
            None,
            backends=backends,
            sidecar={"url": sidecar_url},
            health=FAST_HEALTH,
            canary={"enabled": False},
        )
        url, _ = stack.enter_context(serve(create_app(settings)))
        return Box(url, engines, fake)

    with stack:
        yield make


# -- /v1/messages -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_image_blocks_reach_an_embeds_backend_as_chat_image_embeds(box: Make, stream: bool) -> None:
    b = box({"e": "embeds"})
    content: list[Any] = [{"type": "text", "text": "what are these?"}, B64_BLOCK, URL_BLOCK]
    messages: Any = [{"role": "user", "content": content}]
    client = b.anthropic()
    if stream:
        with client.messages.stream(model="m", max_tokens=16, messages=messages) as s:
            reply = s.get_final_message()
    else:
        reply = client.messages.create(model="m", max_tokens=16, messages=messages)
    assert reply.content[0].type == "text" and reply.content[0].text.startswith("e-0")
    assert b.engines["e"].paths == ["/v1/chat/completions"]
    (sent,) = b.received("e")
    assert sent["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "what are these?"}, EMBEDS_PART, EMBEDS_PART]}
    ]
    assert sorted(b.sidecar.calls) == sorted([CAT, DOG])


def test_a_tool_results_image_is_encoded_where_the_translation_puts_it(box: Make) -> None:
    b = box({"e": "embeds"})
    messages: Any = [
        {"role": "user", "content": "look"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "text", "text": "ok"}, B64_BLOCK],
                },
                {"type": "text", "text": "and?"},
            ],
        },
    ]
    tools: Any = [{"name": "shot", "input_schema": {"type": "object"}}]
    b.anthropic().messages.create(model="m", max_tokens=16, messages=messages, tools=tools)
    (sent,) = b.received("e")
    parts = [p for m in sent["messages"] if isinstance(m.get("content"), list) for p in m["content"]]
    assert EMBEDS_PART in parts and not any(p.get("type") == "image_url" for p in parts)
    assert b.sidecar.calls == [CAT]


def test_image_blocks_on_a_native_backend_go_as_the_clients_bytes(box: Make) -> None:
    b = box({"n": "native"})
    raw = json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [B64_BLOCK]}]})
    httpx.post(b.url + "/v1/messages", content=raw, timeout=10)
    assert b.engines["n"].paths == ["/v1/messages"] and b.engines["n"].raw == [raw.encode()]
    assert b.sidecar.calls == []


def test_a_count_of_image_blocks_goes_where_its_turn_would_as_the_clients_bytes(box: Make) -> None:
    """Not to the text-only backend; to the embeds one as sent: a count needs no embeddings."""
    b = box({"t": "none", "e": "embeds"})
    for i in range(3):
        raw = json.dumps(
            {"model": "m", "system": f"s{i}", "messages": [{"role": "user", "content": [B64_BLOCK]}]}
        )
        r = httpx.post(b.url + "/v1/messages/count_tokens", content=raw, timeout=10)
        assert (r.status_code, r.headers["x-warmroute-backend"]) == (200, "e")
        assert b.engines["e"].raw[-1] == raw.encode()
    assert b.engines["e"].paths == ["/v1/messages/count_tokens"] * 3 and b.engines["t"].paths == []
    assert b.sidecar.calls == []


def test_a_sidecar_refusal_is_an_anthropic_error_naming_the_clients_block(box: Make) -> None:
    b = box({"e": "embeds"}, sidecar=FakeSidecar(answers={DOG: (400, {"detail": "not an image"})}))
    with pytest.raises(anthropic.BadRequestError) as caught:
        b.anthropic().messages.create(
            model="m", max_tokens=8, messages=[{"role": "user", "content": [URL_BLOCK]}]
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "messages[0].content[0].source" in caught.value.message
    assert b.engines["e"].raw == []


def test_image_blocks_never_reach_a_text_only_backend(box: Make) -> None:
    b = box({"t": "none", "e": "embeds"})
    for i in range(3):
        messages: Any = [{"role": "user", "content": [B64_BLOCK, {"type": "text", "text": f"q{i}"}]}]
        b.anthropic().messages.create(model="m", max_tokens=8, messages=messages)
    assert b.engines["t"].raw == [] and len(b.engines["e"].raw) == 3


# -- /v1/responses ------------------------------------------------------------------------------------------


def _input(*images: str) -> Any:
    parts = [{"type": "input_text", "text": "what are these?"}]
    parts += [{"type": "input_image", "image_url": url, "detail": "auto"} for url in images]
    return [{"role": "user", "content": parts}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_input_image_parts_reach_an_embeds_backend_as_chat_image_embeds(box: Make, stream: bool) -> None:
    b = box({"e": "embeds"})
    client = b.openai()
    if stream:
        with client.responses.stream(model="m", input=_input(CAT, DOG), store=False) as s:
            text = s.get_final_response().output_text
    else:
        text = client.responses.create(model="m", input=_input(CAT, DOG), store=False).output_text
    assert text.startswith("e-0")
    assert b.engines["e"].paths == ["/v1/chat/completions"]
    (sent,) = b.received("e")
    assert sent["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "what are these?"}, EMBEDS_PART, EMBEDS_PART]}
    ]
    assert sorted(b.sidecar.calls) == sorted([CAT, DOG])


def test_input_images_never_reach_a_text_only_backend(box: Make) -> None:
    b = box({"t": "none", "n": "native"})
    for i in range(3):
        httpx.post(b.url + "/v1/responses", json={"model": "m", "input": _input(DOG), "instructions": f"{i}"})
    assert b.engines["t"].raw == [] and b.engines["n"].paths == ["/v1/responses"] * 3


def test_input_images_for_text_only_backends_are_a_400() -> None:
    engine = FakeEngine("t")
    with contextlib.ExitStack() as stack:
        url, _ = stack.enter_context(serve(engine.app()))
        backends = [{"id": "t", "url": url, "models": ["m"], "vision": "none"}]
        gw, _ = stack.enter_context(serve(create_app(load_settings(None, backends=backends))))
        with pytest.raises(openai.BadRequestError) as caught:
            openai.OpenAI(base_url=gw + "/v1", api_key="k", max_retries=0).responses.create(
                model="m", input=_input(DOG)
            )
    assert "text-only" in caught.value.message and engine.raw == []


def test_a_chained_image_request_to_an_embeds_backend_is_a_400_naming_previous_response_id(box: Make) -> None:
    """A chat engine keeps no responses: the translation refuses the chain rather than drop it."""
    b = box({"e": "embeds"})
    body = {"model": "m", "input": _input(DOG), "previous_response_id": "resp_1"}
    r = httpx.post(b.url + "/v1/responses", json=body, timeout=10)
    assert r.status_code in (400, 404, 409), r.text
    assert b.engines["e"].raw == [] and b.sidecar.calls == []


def _tool_outputs(*images: str) -> list[Any]:
    """A Codex-shaped turn: a call, its output with text and ``images`` (a screenshot), a user follow-up."""
    shots = [{"type": "input_image", "image_url": url} for url in images]
    return [
        {"role": "user", "content": "open the page"},
        {"type": "function_call", "call_id": "c1", "name": "shot", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_text", "text": "ok"}, *shots],
        },
        {"role": "user", "content": "what does it show?"},
    ]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_outputs_input_image_reaches_an_embeds_backend_after_its_tool_message(
    box: Make, stream: bool
) -> None:
    b = box({"e": "embeds"})
    client = b.openai()
    items: Any = _tool_outputs(CAT)
    if stream:
        with client.responses.stream(model="m", input=items, store=False) as s:
            text = s.get_final_response().output_text
    else:
        text = client.responses.create(model="m", input=items, store=False).output_text
    assert text.startswith("e-0") and b.engines["e"].paths == ["/v1/chat/completions"]
    (sent,) = b.received("e")
    assert sent["messages"][2:] == [
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "user", "content": [EMBEDS_PART]},
        {"role": "user", "content": "what does it show?"},
    ]
    assert b.sidecar.calls == [CAT]


def test_a_tool_outputs_input_image_never_reaches_a_text_only_backend(box: Make) -> None:
    b = box({"t": "none", "n": "native"})
    for i in range(3):
        body = {"model": "m", "input": _tool_outputs(DOG), "instructions": f"{i}"}
        assert httpx.post(b.url + "/v1/responses", json=body, timeout=10).status_code == 200
    assert b.engines["t"].raw == [] and b.engines["n"].paths == ["/v1/responses"] * 3


def test_a_tool_outputs_image_by_file_id_is_a_400_naming_it_for_an_embeds_backend(box: Make) -> None:
    b = box({"e": "embeds"})
    items = _tool_outputs()
    items[2]["output"].append({"type": "input_image", "file_id": "file_1"})
    r = httpx.post(b.url + "/v1/responses", json={"model": "m", "input": items}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input[2].output[1].type"
    assert b.engines["e"].raw == [] and b.sidecar.calls == []


def test_an_input_image_without_url_or_file_id_is_a_400_naming_it(box: Make) -> None:
    b = box({"e": "embeds"})
    body = {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "detail": "auto"}]}]}
    r = httpx.post(b.url + "/v1/responses", json=body, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].content[0].image_url"


# -- the shapes' image finders ------------------------------------------------------------------------------


def test_the_messages_finder_sees_tool_result_images_and_names_each_source() -> None:
    from gateway.shapes.messages import images

    body = {
        "messages": [
            {"role": "user", "content": [URL_BLOCK]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text"}, B64_BLOCK]}
                ],
            },
        ]
    }
    found = images(body)
    assert [(p.url, p.param) for p in found] == [
        (DOG, "messages[0].content[0].source"),
        (CAT, "messages[1].content[0].content[1].source"),
    ]


def test_the_responses_finder_sees_input_images_by_url_data_url_and_file_id() -> None:
    from gateway.shapes.responses import images

    body = {
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "x"}, {"type": "input_image", "image_url": DOG}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": CAT}]},
            {"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]},
            {"type": "function_call_output", "call_id": "c", "output": "ok"},
            {
                "type": "function_call_output",
                "call_id": "d",
                "output": [
                    {"type": "input_text", "text": "shot:"},
                    {"type": "input_image", "image_url": DOG},
                ],
            },
            {"role": "user", "content": [{"type": "input_image", "image_url": CAT}]},
        ]
    }
    assert [(p.url, p.param) for p in images(body)] == [
        (DOG, "input[0].content[1].image_url"),
        (CAT, "input[1].content[0].image_url"),
        ("file_id:file_1", "input[2].content[0].image_url"),
        (DOG, "input[4].output[1].image_url"),
        (CAT, "input[5].content[0].image_url"),
    ]
    assert images({"input": "just text"}) == ()


def test_a_lone_surrogate_in_a_later_turns_input_image_is_a_400_naming_it(box: Make) -> None:
    b = box({"e": "embeds"})
    later = [{"type": "input_image", "image_url": "https://x.example/\\ud800.png"}]
    raw = (
        '{"model": "m", "input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, '
        '{"role": "user", "content": ' + json.dumps(later).replace("\\\\ud800", "\\ud800") + "}]}"
    )
    r = httpx.post(
        b.url + "/v1/responses", content=raw, headers={"content-type": "application/json"}, timeout=10
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "input[2].content[0].image_url"
    assert b.engines["e"].raw == [] and b.sidecar.calls == []
