"""The shape table drives the routes, and a new API shape is one value: a toy shape defined here, handed to
``create_app``, gets conversation affinity, token metrics read from where its answers keep usage, and its
own error rendering (a bad request, and a stream that breaks), without any other module knowing it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from config.settings import RoutingConfig, load_settings
from gateway.app import HotPath, create_app
from gateway.endpoints import Endpoint
from gateway.errors import BadRequest, GatewayError
from gateway.observe import Usage
from gateway.shapes.base import ApiShape, ErrorShape
from gateway.shapes.table import PASSTHROUGH, RESPONSES, SHAPES

from clusters import ClusterFactory
from upstreams import FakeEngine

# -- the toy shape: everything the gateway needs to know of it, in one value --------------------------------


def toy_validate(body: dict[str, Any]) -> str:
    model, thread = body.get("model"), body.get("thread")
    if not isinstance(model, str) or not model:
        raise BadRequest("a toy talk names its model", param="model")
    if not isinstance(thread, str) or not thread:
        raise BadRequest("a toy talk names its thread", param="thread")
    return model


def toy_key(body: dict[str, Any], model: str, routing: RoutingConfig) -> str:
    return f"toy:{model}:{body['thread']}"  # the thread is the conversation


def toy_usage(tail: bytes) -> Usage | None:
    """The last ``"meter"`` object: ``{"in", "out", "cached"}`` (where OpenAI has ``usage``)."""
    at = tail.rfind(b'"meter"')
    if at < 0:
        return None
    text = tail[at + len(b'"meter"') :].decode().lstrip().removeprefix(":").lstrip()
    meter = json.JSONDecoder().raw_decode(text)[0]
    return Usage(meter["in"], meter["out"], meter["cached"])


def toy_body(err: GatewayError) -> bytes:
    return json.dumps({"toy_error": err.message, "code": err.code}).encode()


def toy_stream_end(err: GatewayError) -> bytes:
    return b"event: failure\ndata: " + toy_body(err) + b"\n\n"


TOY = ApiShape(
    name="toy",
    path="/v1/toy/talk",
    validate=toy_validate,
    key=toy_key,
    errors=ErrorShape(toy_body, toy_stream_end, content_type=b"application/vnd.toy+json"),
    usage=toy_usage,
    text_key=b'"said":',
)

METER = {"meter": {"in": 7, "out": 2, "cached": 5}}


@dataclass
class ToyEngine(FakeEngine):
    """The fake engine, also serving the toy route: JSON, or a stream (broken after one event if asked)."""

    def app(self) -> Starlette:  # type: ignore[override]
        routes: list[BaseRoute] = [Route("/v1/toy/talk", self._talk, methods=["POST"])]
        return Starlette(routes=routes + list(super().app().routes))

    async def _talk(self, request: Request) -> Response:
        raw = await request.body()
        self.raw.append(raw)
        body = json.loads(raw)
        if not body.get("stream"):
            return JSONResponse({"said": "ok", "served_by": self.name, **METER})

        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"said": "o"}\n\n'
            if body.get("break"):
                raise RuntimeError("the engine falls over mid-stream")
            yield b"data: " + json.dumps(METER).encode() + b"\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


# -- the table drives the routes ----------------------------------------------------------------------------


def mounted(shapes: tuple[ApiShape, ...]) -> HotPath:
    settings = load_settings(None, backends=[{"id": "a", "url": "http://127.0.0.1:9", "models": ["m"]}])
    hot = create_app(settings, shapes=shapes).app
    assert isinstance(hot, HotPath)
    return hot


def test_every_shape_is_mounted_and_nothing_else_under_v1_but_the_catalogue_and_passthrough() -> None:
    for shapes in (SHAPES, (*SHAPES, TOY)):
        hot = mounted(shapes)
        paths = [p for s in shapes for p in (s.path, s.path + "/")]
        assert list(hot.routes) == [("POST", p) for p in paths]  # the hot path: exactly the table's
        for (_method, path), endpoint in hot.routes.items():
            assert isinstance(endpoint, Endpoint)
            assert endpoint.shape.path == path.rstrip("/")  # each endpoint holds its own shape
        v1 = [r for r in hot.app.routes if isinstance(r, Route) and r.path.startswith("/v1")]
        stored = [f"/v1/responses/{{response_id}}{tail}" for tail in ("", "/cancel", "/input_items")]
        stored = stored if RESPONSES in shapes else []  # a stored response's routes, to its owner
        catalogue = ["/v1/models", "/v1/models/{model:path}", "/v1/{rest:path}"]
        assert [r.path for r in v1] == [*paths, *stored, *catalogue]
        assert [r.endpoint for r in v1[: len(paths)]] == [hot.routes["POST", p] for p in paths]
        fallback = v1[-1].endpoint
        assert isinstance(fallback, Endpoint) and fallback.shape is PASSTHROUGH
    assert [s.name for s in SHAPES] == ["chat", "completions", "messages", "count_tokens", "responses"]


def test_without_a_shape_its_path_is_passed_through(cluster: ClusterFactory) -> None:
    c = cluster(engines=[ToyEngine("a")])  # the default table: no toy shape
    r = httpx.post(c.url + "/v1/toy/talk", json={"model": "m"})  # no thread: nobody here validates it
    assert r.status_code == 200, r.text
    assert r.json()["served_by"] == "a"


# -- a toy shape, end to end --------------------------------------------------------------------------------


def test_a_new_shape_gets_affinity_and_its_body_goes_as_the_client_sent_it(cluster: ClusterFactory) -> None:
    c = cluster(engines=[ToyEngine("a"), ToyEngine("b")], shapes=(*SHAPES, TOY))
    sent = b'{"model":"m","thread":"t1","thinking_budget":5,"say":"hi"}'
    routes, served = [], []
    for _ in range(3):
        r = httpx.post(c.url + "/v1/toy/talk", content=sent, headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        routes.append(r.headers["x-warmroute-route"])
        served.append(r.headers["x-warmroute-backend"])
    assert routes == ["new_cheapest", "affinity_hit", "affinity_hit"]  # the default policy (ttft)
    assert len(set(served)) == 1
    other = httpx.post(c.url + "/v1/toy/talk", json={"model": "m", "thread": "t2"})
    assert other.headers["x-warmroute-route"] == "new_cheapest"
    assert other.headers["x-warmroute-backend"] != served[0]  # the first backend holds a conversation
    # No budget, no reasoning rewrite: the engine got the client's own bytes, each time.
    assert c.engines[served[0]].raw == [sent] * 3
    assert c.engines["a"].requests == c.engines["b"].requests == []  # no chat request went anywhere


def test_a_new_shape_s_usage_is_read_where_its_answers_keep_it(cluster: ClusterFactory) -> None:
    c = cluster(engines=[ToyEngine("a")], shapes=(*SHAPES, TOY))
    assert httpx.post(c.url + "/v1/toy/talk", json={"model": "m", "thread": "t"}).status_code == 200
    streamed = httpx.post(c.url + "/v1/toy/talk", json={"model": "m", "thread": "t", "stream": True})
    assert streamed.content == b'data: {"said": "o"}\n\ndata: ' + json.dumps(METER).encode() + b"\n\n"
    c.wait_idle()
    lines = httpx.get(c.url + "/metrics").text.splitlines()
    assert 'warmroute_prompt_tokens_total{backend="a",model="m"} 14.0' in lines
    assert 'warmroute_completion_tokens_total{backend="a",model="m"} 4.0' in lines
    assert 'warmroute_cached_prompt_tokens_total{backend="a",model="m"} 10.0' in lines


def test_a_new_shape_renders_its_own_errors(cluster: ClusterFactory) -> None:
    c = cluster(engines=[ToyEngine("a")], shapes=(*SHAPES, TOY))
    bad = httpx.post(c.url + "/v1/toy/talk", json={"model": "m"})
    assert (bad.status_code, bad.headers["content-type"]) == (400, "application/vnd.toy+json")
    assert bad.json() == {"toy_error": "a toy talk names its thread", "code": "invalid_request"}
    unknown = httpx.post(c.url + "/v1/toy/talk", json={"model": "nope", "thread": "t"})
    assert unknown.status_code == 404
    assert unknown.json()["toy_error"].startswith("model 'nope' is not served here")
    broken = httpx.post(
        c.url + "/v1/toy/talk", json={"model": "m", "thread": "t", "stream": True, "break": True}
    )
    assert broken.status_code == 200
    head, _, end = broken.content.partition(b"\n\n")
    assert head == b'data: {"said": "o"}'
    assert end.startswith(b"event: failure\ndata: {")
    assert end.endswith(b"}\n\n") and b"[DONE]" not in end  # its own terminator, not OpenAI's
    assert json.loads(end.removeprefix(b"event: failure\ndata: "))["code"] == "upstream_error"
    # The OpenAI shapes are untouched: chat still answers errors in OpenAI's shape.
    chat = httpx.post(c.url + "/v1/chat/completions", json={"model": "m"})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
    c.wait_idle()
    lines = httpx.get(c.url + "/metrics").text.splitlines()
    assert 'warmroute_requests_total{backend="a",outcome="mid_stream_error"} 1.0' in lines


def test_the_admin_dry_run_keys_a_new_shape_as_its_endpoint_does(cluster: ClusterFactory) -> None:
    c = cluster(engines=[ToyEngine("a")], shapes=(*SHAPES, TOY))
    sample = {"model": "m", "thread": "t9"}
    r = httpx.post(c.url + "/admin/route/explain", json={"path": "/v1/toy/talk", "body": sample})
    assert r.status_code == 200, r.text
    assert (r.json()["key"], r.json()["reason"]) == ("toy:m:t9", "new_cheapest")
    bad = httpx.post(c.url + "/admin/route/explain", json={"path": "/v1/toy/talk", "body": {"model": "m"}})
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "thread")
    gone = httpx.post(c.url + "/admin/route/explain", json={"path": "/v1/embeddings", "key": "k"})
    assert (gone.status_code, gone.json()["error"]["param"]) == (422, "path")
    assert "/v1/toy/talk" in gone.json()["error"]["message"]
    assert c.engines["a"].raw == []  # a dry run: nothing reached the engine
