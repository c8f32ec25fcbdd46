"""Images through the gateway by backend ``vision`` mode, against fake engines and a fake sidecar.

What the engine received is read from its raw bytes; what the sidecar was asked, from its call log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from vision_fakes import EMBEDS_6X8, GRID_1X3, GRID_3, FakeSidecar

from config.settings import ConfigError, VisionMode, load_settings
from gateway.app import Gateway, create_app

from upstreams import FAST_HEALTH, FakeEngine, serve

CAT = "data:image/png;base64,Y2F0"
DOG = "https://images.example/dog.png"


@dataclass
class Box:
    url: str
    engines: dict[str, FakeEngine]
    sidecar: FakeSidecar
    gateway: Gateway
    sidecar_server: Any

    def chat(
        self, messages: list[dict[str, Any]], session: str | None = None, **fields: Any
    ) -> httpx.Response:
        headers = {"x-session-id": session} if session else {}
        body = {"model": "m", "messages": messages, **fields}
        return httpx.post(self.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)

    def received(self, name: str) -> list[dict[str, Any]]:
        return [json.loads(raw) for raw in self.engines[name].raw]


Make = Callable[..., Box]


@pytest.fixture
def box() -> Iterator[Make]:
    """``box({"e": "embeds", "n": "native"}, sidecar=FakeSidecar(...), sidecar_cfg={...})``."""
    stack = contextlib.ExitStack()

    def make(
        modes: dict[str, str],
        sidecar: FakeSidecar | None = None,
        health: dict[str, Any] | None = None,
        routing: dict[str, Any] | None = None,
        **sidecar_cfg: Any,
    ) -> Box:
        fake = sidecar or FakeSidecar()
        sidecar_url, sidecar_server = stack.enter_context(serve(fake.app()))
        engines = {name: FakeEngine(name) for name in modes}
        backends = []
        for name, mode in modes.items():
            url, _ = stack.enter_context(serve(engines[name].app()))
            backends.append({"id": name, "url": url, "models": ["m"], "vision": mode})
        settings = load_settings(
            None,
            backends=backends,
            sidecar={"url": sidecar_url, **sidecar_cfg},
            health=health or FAST_HEALTH,
            routing=routing or {},
        )
        app = create_app(settings)
        url, _ = stack.enter_context(serve(app))
        return Box(url, engines, fake, app.state.gateway, sidecar_server)

    with stack:
        yield make


def user(*parts: Any) -> dict[str, Any]:
    return {"role": "user", "content": list(parts)}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


EMBEDS_PART = {"type": "image_embeds", "image_embeds": {"image_embeds": EMBEDS_6X8, "image_grid_thw": GRID_3}}


# -- shaping -----------------------------------------------------------------------------------------------


def test_a_text_only_request_to_an_embeds_backend_goes_as_the_clients_bytes_and_costs_no_encode(
    box: Make,
) -> None:
    b = box({"e": "embeds"})
    raw = b'{"model":"m",  "messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}] ,"x":1}'
    resp = httpx.post(b.url + "/v1/chat/completions", content=raw, timeout=10)
    assert resp.status_code == 200
    assert b.engines["e"].raw == [raw]
    assert b.sidecar.calls == []


def test_image_url_parts_become_image_embeds_parts_for_an_embeds_backend(box: Make) -> None:
    b = box({"e": "embeds"})
    messages = [
        {"role": "system", "content": "be brief"},
        user(text("what is this?"), image(CAT, detail="high"), text("and this?"), image(DOG)),
    ]
    assert b.chat(messages).status_code == 200
    (sent,) = b.received("e")
    assert sent["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [text("what is this?"), EMBEDS_PART, text("and this?"), EMBEDS_PART]},
    ]
    assert sorted(b.sidecar.calls) == sorted([CAT, DOG])
    # Raw base64, no data: prefix, and the grid is shape [3] (its header says so; see test_torchfile).
    assert not sent["messages"][1]["content"][1]["image_embeds"]["image_embeds"].startswith("data:")


def test_a_native_backend_gets_the_image_url_parts_as_the_client_sent_them(box: Make) -> None:
    b = box({"n": "native"})
    raw = json.dumps({"model": "m", "messages": [user(text("hi"), image(CAT))]}, indent=1).encode()
    assert httpx.post(b.url + "/v1/chat/completions", content=raw, timeout=10).status_code == 200
    assert b.engines["n"].raw == [raw]
    assert b.sidecar.calls == []


def test_each_unique_image_is_encoded_once_per_request_and_the_unique_ones_in_parallel(box: Make) -> None:
    # Two unique images, four parts across two turns; the fake answers only when two encodes overlap.
    b = box({"e": "embeds"}, sidecar=FakeSidecar(together=2))
    history = [
        user(image(CAT), text("one")),
        {"role": "assistant", "content": "a cat"},
        user(image(CAT), image(DOG), image(DOG)),
    ]
    resp = b.chat(history)
    assert resp.status_code == 200, resp.text
    assert sorted(b.sidecar.calls) == sorted([CAT, DOG])
    assert b.sidecar.max_active == 2
    (sent,) = b.received("e")
    assert sent["messages"][0]["content"] == [EMBEDS_PART, text("one")]
    assert sent["messages"][1] == {"role": "assistant", "content": "a cat"}
    assert sent["messages"][2]["content"] == [EMBEDS_PART, EMBEDS_PART, EMBEDS_PART]


def test_a_retry_on_another_embeds_backend_reuses_the_requests_encodings(box: Make) -> None:
    b = box({"e1": "embeds", "e2": "embeds"})
    b.engines["e1"].fail_next = 1  # answers 500 before any byte once: that request is retried on e2
    routes = []
    for i in range(12):
        resp = b.chat([user(image(CAT))], session=f"s{i}")
        assert resp.status_code == 200
        routes.append(resp.headers["x-warmroute-route"])
        if routes[-1] == "retry_next":
            break
    assert routes[-1] == "retry_next"
    assert len(b.sidecar.calls) == len(routes)  # one encode per request, the retried one included
    sent = [m["messages"][0]["content"] for name in ("e1", "e2") for m in b.received(name)]
    assert sent == [[EMBEDS_PART]] * (len(routes) + 1)


def test_max_parallel_bounds_the_encodes_in_flight(box: Make) -> None:
    b = box({"e": "embeds"}, max_parallel=1)
    assert b.chat([user(image(CAT), image(DOG), image(CAT + "x"))]).status_code == 200
    assert len(b.sidecar.calls) == 3
    assert b.sidecar.max_active == 1


def test_the_conversation_stays_pinned_across_turns_that_resend_its_image(box: Make) -> None:
    b = box({"e1": "embeds", "e2": "embeds"})
    first = [user(image(CAT), text("what is it?"))]
    r1 = b.chat(first)
    follow = [*first, {"role": "assistant", "content": "a cat"}, user(text("sure?"))]
    r2 = b.chat(follow)
    assert r1.headers["x-warmroute-backend"] == r2.headers["x-warmroute-backend"]
    assert r2.headers["x-warmroute-route"] == "affinity_hit"


# -- refusals ----------------------------------------------------------------------------------------------


def test_a_1x3_grid_from_the_sidecar_is_a_502_naming_it_and_never_reaches_the_engine(box: Make) -> None:
    bad = {"image_embeds": EMBEDS_6X8, "image_grid_thw": GRID_1X3, "tokens": 6, "cached": False}
    b = box({"e": "embeds"}, sidecar=FakeSidecar(answers={CAT: (200, bad)}))
    resp = b.chat([user(image(CAT))])
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["code"] == "vision_sidecar_error"
    assert b.gateway.settings.sidecar is not None
    assert f"vision sidecar {b.gateway.settings.sidecar.url}" in error["message"]
    assert "image_grid_thw of shape [1, 3]; engines need shape [3]" in error["message"]
    assert b.engines["e"].raw == []


@pytest.mark.parametrize(
    ("answer", "detail"),
    [
        ({"image_embeds": "data:x;base64,AAAA", "image_grid_thw": GRID_3}, "image_embeds is not raw base64"),
        ({"image_embeds": GRID_3, "image_grid_thw": GRID_3}, "image_embeds of shape [3] for None tokens"),
        ({"image_embeds": EMBEDS_6X8, "image_grid_thw": GRID_3, "tokens": 7}, "shape [6, 8] for 7 tokens"),
        ({"image_grid_thw": GRID_3}, "malformed encoding: 'image_embeds'"),
    ],
)
def test_a_malformed_encoding_is_a_502_that_says_what_is_wrong(
    box: Make, answer: dict[str, Any], detail: str
) -> None:
    b = box({"e": "embeds"}, sidecar=FakeSidecar(answers={CAT: (200, answer)}))
    resp = b.chat([user(image(CAT))])
    assert resp.status_code == 502
    assert detail in resp.json()["error"]["message"]
    assert b.engines["e"].raw == []


@pytest.mark.parametrize("status", [400, 413, 422])
def test_a_sidecar_4xx_is_the_clients_4xx_with_its_message_and_the_part_named(box: Make, status: int) -> None:
    refusal = {"error": {"message": "not an image (magic bytes 3c68746d)", "code": "not_an_image"}}
    b = box({"e": "embeds"}, sidecar=FakeSidecar(answers={DOG: (status, refusal)}))
    resp = b.chat([user(image(CAT)), {"role": "assistant", "content": "ok"}, user(text("x"), image(DOG))])
    assert resp.status_code == status
    assert resp.json()["error"] == {
        "message": "not an image (magic bytes 3c68746d)",
        "type": "invalid_request_error",
        "param": "messages[2].content[1].image_url",
        "code": "not_an_image",
    }
    assert b.engines["e"].raw == []


def test_a_busy_sidecar_is_a_503(box: Make) -> None:
    busy = {"error": {"message": "encode queue full (8 waiting)"}}
    b = box({"e": "embeds"}, sidecar=FakeSidecar(answers={CAT: (503, busy)}))
    resp = b.chat([user(image(CAT))])
    assert resp.status_code == 503
    assert resp.json()["error"]["code"] == "vision_unavailable"
    assert "is busy: encode queue full (8 waiting)" in resp.json()["error"]["message"]


def test_a_sidecar_slower_than_timeout_s_is_a_503_and_text_is_unaffected(box: Make) -> None:
    gate = threading.Event()
    b = box({"e": "embeds"}, sidecar=FakeSidecar(gate=gate), timeout_s=0.3)
    try:
        resp = b.chat([user(image(CAT))])
        assert resp.status_code == 503
        assert "did not encode the image within 0.3s" in resp.json()["error"]["message"]
        assert b.chat([{"role": "user", "content": "hi"}]).status_code == 200
    finally:
        gate.set()
    assert len(b.engines["e"].raw) == 1  # the text request only


def _stop_sidecar(b: Box) -> None:
    """Stop the fake sidecar; return once the gateway has seen it down (a refused encode or a probe)."""
    b.sidecar_server.should_exit = True
    host = b.gateway.sidecar
    assert host is not None
    with contextlib.suppress(httpx.HTTPError):
        while True:
            httpx.get(host.cfg.url + "/health", timeout=0.5)


def _until_down(b: Box) -> None:
    host = b.gateway.sidecar
    assert host is not None
    deadline = time.monotonic() + 5
    while host.available:
        assert time.monotonic() < deadline, "the gateway never saw the sidecar down"
        time.sleep(0.02)


def test_sidecar_down_means_503_for_images_to_embeds_backends_and_text_still_flows(box: Make) -> None:
    b = box({"e": "embeds"})
    _stop_sidecar(b)
    resp = b.chat([user(image(CAT))])  # refused at connect (that marks it down), or already seen down
    assert resp.status_code == 503
    assert resp.json()["error"]["code"] == "vision_unavailable"
    _until_down(b)
    resp = b.chat([user(image(DOG))])
    assert resp.status_code == 503
    assert "is not available: down" in resp.json()["error"]["message"]
    assert b.chat([{"role": "user", "content": "hi"}]).status_code == 200
    assert len(b.engines["e"].raw) == 1


def test_a_refused_encode_marks_the_sidecar_down_at_once(box: Make) -> None:
    # Probes far apart: only the refused connection of a real encode can tell the gateway.
    b = box({"e": "embeds"}, health={"interval_s": 600, "timeout_s": 1, "fail_threshold": 3})
    _stop_sidecar(b)
    resp = b.chat([user(image(CAT))])
    assert resp.status_code == 503
    assert resp.json()["error"]["message"].endswith("is unreachable")
    resp = b.chat([user(image(DOG))])
    assert resp.status_code == 503
    assert "is not available: down (health probe failed: connect failed:" in resp.json()["error"]["message"]
    assert b.sidecar.calls == []


def test_sidecar_down_sends_image_requests_to_a_native_backend_of_the_model(box: Make) -> None:
    b = box({"e": "embeds", "n": "native"})
    _stop_sidecar(b)
    _until_down(b)
    for i in range(4):
        resp = b.chat([user(image(DOG), text(str(i)))], session=f"s{i}")
        assert resp.status_code == 200
        assert resp.headers["x-warmroute-backend"] == "n"
    assert b.engines["e"].raw == []


def test_a_none_backend_never_gets_an_image_request_while_another_can_take_it(box: Make) -> None:
    b = box({"t": "none", "n": "native"})
    # Pin conversations to both backends, then send each an image: the pins on the text-only one move.
    first = {f"s{i}": b.chat([{"role": "user", "content": "hi"}], session=f"s{i}") for i in range(6)}
    assert {r.headers["x-warmroute-backend"] for r in first.values()} == {"t", "n"}
    text_only = len(b.engines["t"].raw)
    for session in first:
        resp = b.chat([user(image(CAT))], session=session)
        assert resp.status_code == 200
        assert resp.headers["x-warmroute-backend"] == "n"
    assert len(b.engines["t"].raw) == text_only
    # A new image conversation is claimed like any other (the text-only backend is absent, not a failure).
    fresh = [b.chat([user(image(DOG))], session="new").headers["x-warmroute-route"] for _ in range(2)]
    assert fresh == ["new_cheapest", "affinity_hit"]  # the default policy (ttft)
    assert all("image_url" not in raw.decode() for raw in b.engines["t"].raw)


def test_the_ttft_policy_never_sends_an_image_to_a_none_backend_either(box: Make) -> None:
    b = box({"t": "none", "n": "native"}, routing={"policy": "ttft"})
    text_only = {
        b.chat([{"role": "user", "content": f"hi {i}"}]).headers["x-warmroute-backend"] for i in range(6)
    }
    assert text_only == {"t", "n"}  # text spreads over both
    routed = {b.chat([user(text(f"look {i}"), image(CAT))]).headers["x-warmroute-backend"] for i in range(6)}
    assert routed == {"n"}
    assert all("image_url" not in raw.decode() for raw in b.engines["t"].raw)


def test_images_for_a_model_whose_backends_are_all_text_only_are_a_400(box: Make) -> None:
    b = box({"t1": "none", "t2": "none"})
    resp = b.chat([user(text("look"), image(CAT))])
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == (
        "model 'm' takes no images here: its backends (t1, t2) are text-only (vision: none)"
    )
    assert b.engines["t1"].raw == b.engines["t2"].raw == []
    assert b.chat([{"role": "user", "content": "hi"}]).status_code == 200


def test_an_image_part_without_a_url_is_a_400_naming_it(box: Make) -> None:
    b = box({"e": "embeds"})
    resp = b.chat([user(text("x"), {"type": "image_url", "image_url": {"detail": "low"}})])
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "messages[0].content[1].image_url"


@pytest.mark.parametrize("as_object", [True, False], ids=["url-object", "url-string"])
def test_a_lone_surrogate_in_a_later_turns_image_url_is_a_400_naming_the_part(
    box: Make, caplog: pytest.LogCaptureFixture, as_object: bool
) -> None:
    """The endpoint checks the conversation head only; an image in a later turn was posted to the sidecar as
    UTF-8 JSON, which it cannot be: a 500 and two tracebacks."""
    b = box({"e": "embeds"})
    url = "https://images.example/SURROGATE.png"
    part = image(url) if as_object else {"type": "image_url", "image_url": url}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}, user(part)]
    raw = json.dumps({"model": "m", "messages": messages}).replace("SURROGATE", "\\ud800").encode()
    caplog.set_level(logging.INFO)
    resp = httpx.post(b.url + "/v1/chat/completions", content=raw, timeout=10)
    param = "messages[2].content[0].image_url" + (".url" if as_object else "")
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] == {
        "message": f"invalid unicode: lone surrogate \\ud800 in {param}",
        "type": "invalid_request_error",
        "param": param,
        "code": "invalid_request",
    }
    assert b.sidecar.calls == [] and b.engines["e"].raw == []
    ours = [r for r in caplog.records if r.name.startswith("warmroute") and r.levelno >= logging.INFO]
    ours = [r for r in ours if not r.name.startswith(("warmroute.health", "warmroute.lifecycle"))]
    assert [r.getMessage() for r in ours] == [f"rejected a request body: {resp.json()['error']['message']}"]
    assert not [r for r in caplog.records if r.exc_info]


# -- settings ----------------------------------------------------------------------------------------------


def _backend(**extra: Any) -> dict[str, Any]:
    return {"id": "a", "url": "http://127.0.0.1:9", "models": ["m"], **extra}


def test_vision_defaults_to_native_and_the_sidecar_is_optional() -> None:
    s = load_settings(None, backends=[_backend()])
    assert s.backends[0].vision is VisionMode.NATIVE
    assert s.sidecar is None


def test_embeds_backends_need_a_sidecar() -> None:
    with pytest.raises(ConfigError, match=r"backends \['a'\] have vision: embeds, which needs a sidecar"):
        load_settings(None, backends=[_backend(vision="embeds")])


def test_a_managed_sidecar_needs_one_worker_and_its_url_is_a_root() -> None:
    sidecar = {"url": "http://127.0.0.1:8090/v1/", "managed": {"command": "sleep 1"}}
    with pytest.raises(ConfigError, match=r"a managed sidecar needs server\.workers: 1"):
        load_settings(None, sidecar=sidecar, server={"workers": 2})
    s = load_settings(None, sidecar=sidecar)
    assert s.sidecar is not None and s.sidecar.url == "http://127.0.0.1:8090"
    with pytest.raises(ConfigError, match=r"sidecar\.max_parallel"):
        load_settings(None, sidecar={"url": "http://x", "max_parallel": 0})
