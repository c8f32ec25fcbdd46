"""Unknown /v1 paths are forwarded (engines serve routes the gateway cannot know), and the engine's 404
reaches the client in OpenAI's error shape: rewritten when the engine's framework answered plain text or
``{"detail": ...}``, byte for byte when it was OpenAI-shaped already."""

from __future__ import annotations

import json
from dataclasses import dataclass

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from clusters import ClusterFactory
from upstreams import FakeEngine

OPENAI_404 = b'{"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "code": 404}}'
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@dataclass
class NarrowEngine(FakeEngine):
    """Serves health, models and chat only: every other path gets its framework's own 404."""

    def app(self) -> Starlette:  # type: ignore[override]
        inner = Starlette(
            routes=[
                Route("/health", self._health),
                Route("/v1/models", self._models),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/detail", self._detail, methods=["GET", "POST"]),
                Route("/v1/openai-shaped", self._openai, methods=["GET", "POST"]),
            ]
        )

        async def recording(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and scope["path"] not in ("/health", "/v1/chat/completions"):
                self.paths.append(scope["path"])
            await inner(scope, receive, send)

        return recording  # type: ignore[return-value]

    async def _detail(self, _request: Request) -> Response:
        return JSONResponse({"detail": "Not Found"}, status_code=404)  # FastAPI's (vLLM's) unknown route

    async def _openai(self, _request: Request) -> Response:
        return Response(OPENAI_404, status_code=404, media_type="application/json")


def test_an_unknown_v1_path_is_forwarded_and_its_404_is_openai_shaped(cluster: ClusterFactory) -> None:
    c = cluster(engines=[NarrowEngine("a")], routing={"policy": "affinity"})  # no /metrics scrapes
    for method, path in [("POST", "/v1/nope"), ("GET", "/v1/nope/deeper?x=1"), ("POST", "/v1/detail")]:
        r = httpx.request(method, c.url + path, json=CHAT if method == "POST" else None)
        route = path.split("?")[0]
        assert r.status_code == 404, r.text
        assert r.headers["content-type"] == "application/json"
        assert r.headers["x-warmroute-backend"] == "a"
        assert json.loads(r.content) == {
            "error": {
                "message": f"{method} {route}: backend 'a' has no such route",
                "type": "invalid_request_error",
                "param": "path",
                "code": "not_found",
            }
        }
    assert c.engines["a"].paths == ["/v1/nope", "/v1/nope/deeper", "/v1/detail"]  # each forwarded once
    c.wait_idle()
    lines = httpx.get(c.url + "/metrics").text.splitlines()
    assert 'warmroute_requests_total{backend="a",outcome="http_4xx"} 3.0' in lines
    # The connection stays usable: an ordinary request right after is answered.
    assert httpx.post(c.url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_an_openai_shaped_404_from_the_engine_goes_through_unchanged(cluster: ClusterFactory) -> None:
    c = cluster(engines=[NarrowEngine("a")])
    r = httpx.post(c.url + "/v1/openai-shaped", json=CHAT)
    assert (r.status_code, r.content) == (404, OPENAI_404)
    assert r.headers["x-warmroute-backend"] == "a"
