"""What the engine receives: the client's own bytes when nothing shapes the body; one deterministic
serialisation when a prepare step does; every attempt shaped from the original; the right credentials."""

from __future__ import annotations

import httpx

from backends.registry import Backend
from gateway.context import Draft, RequestContext, canonical_json

from clusters import ClusterFactory
from upstreams import FakeEngine

RAW = (
    b'{"model":"m",  "messages":[{"role":"user","content":"x \\u00e9"}],'
    b'"vendor_knob":{"z":1,"a":[2]}, "top_k":7}'
)
RR = {"routing": {"policy": "round_robin"}}


class TagBackend:
    """A prepare step: records which backend it shaped for, in the body."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    async def prepare(self, ctx: RequestContext, backend: Backend, draft: Draft) -> None:
        before = draft.read()
        self.seen.append((backend.id, before is not None and "shaped_for" in before))
        draft.edit()["shaped_for"] = backend.id


def post(url: str, raw: bytes = RAW, **headers: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json", **headers}
    )


def test_unshaped_body_reaches_the_engine_byte_for_byte(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    assert post(c.url).status_code == 200
    assert c.engines["a"].raw == [RAW]  # spacing, key order and escapes untouched


def test_shaped_body_is_serialised_once_and_each_attempt_starts_from_the_original(
    cluster: ClusterFactory,
) -> None:
    step = TagBackend()
    c = cluster(engines=[FakeEngine("a", fail_next=1), FakeEngine("b")], modules=(step,), **RR)
    r = post(c.url)
    assert (r.status_code, r.headers["x-warmroute-backend"]) == (200, "b")
    original = httpx.Response(200, content=RAW).json()
    assert c.engines["a"].raw == [canonical_json({**original, "shaped_for": "a"})]
    assert c.engines["b"].raw == [canonical_json({**original, "shaped_for": "b"})]
    assert step.seen == [("a", False), ("b", False)]  # the retry never saw the first attempt's edit
    assert c.engines["b"].raw[0] == (
        b'{"model":"m","messages":[{"role":"user","content":"x \xc3\xa9"}],'
        b'"vendor_knob":{"z":1,"a":[2]},"top_k":7,"shaped_for":"b"}'
    )


def test_shaping_is_deterministic(cluster: ClusterFactory) -> None:
    c = cluster(["a"], modules=(TagBackend(),))
    post(c.url)
    post(c.url)
    first, second = c.engines["a"].raw
    assert first == second and first != RAW


def test_client_authorization_is_forwarded_when_the_backend_has_no_key(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    post(c.url, authorization="Bearer client-key", **{"x-request-id": "req-7"})
    assert c.engines["a"].headers[-1]["authorization"] == "Bearer client-key"
    assert c.engines["a"].headers[-1]["x-request-id"] == "req-7"


def test_backend_key_replaces_the_client_key(cluster: ClusterFactory) -> None:
    c = cluster(engines=[FakeEngine("a", api_key="engine-secret")])
    post(c.url, authorization="Bearer client-key")
    post(c.url)
    assert [h["authorization"] for h in c.engines["a"].headers] == ["Bearer engine-secret"] * 2


def test_passthrough_keeps_percent_encoding_and_query(cluster: ClusterFactory) -> None:
    c = cluster(["a"])
    r = httpx.get(c.url + "/v1/files/a%20b?limit=2&after=x%2By")
    assert r.status_code == 200
    assert r.json()["target"] == "/v1/files/a%20b?limit=2&after=x%2By"
    assert c.engines["a"].paths == ["/v1/files/a%20b?limit=2&after=x%2By"]
    assert r.headers["x-warmroute-backend"] == "a"


def test_passthrough_body_is_forwarded_untouched(cluster: ClusterFactory) -> None:
    c = cluster(["a"], modules=(TagBackend(),))  # prepare steps shape only the endpoints that own their body
    raw = b'{"model": "m", "input": ["x"]}'
    r = httpx.post(c.url + "/v1/audio/speech", content=raw)
    assert r.json()["body"] == raw.decode()
    assert c.engines["a"].raw == [raw]
