"""Fuzzing: the admin API from its own OpenAPI document (schemathesis), the /v1 bodies (hypothesis).

Both run against a live gateway on 127.0.0.1 (uvicorn in a thread, lifespan included), with a bounded
number of cases, and assert that nothing answers 5xx and nothing hangs (every call has a 10 s timeout).
The gateway's httpx client (health probes, canaries) may reach nothing but 127.0.0.1: fuzzed backends
can carry any URL.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import hypothesis.strategies as st
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.types import Receive, Scope, Send

from config.settings import load_settings
from gateway.app import create_app

from upstreams import serve

ADMIN_EXAMPLES = 25  # per operation and strategy: (15 operations x 2 modes + 8 with id "a") x 25 = 950
V1_EXAMPLES = 300
CONFORMANCE = [status_code_conformance, content_type_conformance, response_schema_conformance]
FUZZ = settings(
    max_examples=ADMIN_EXAMPLES,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)


@pytest.fixture
def loopback_only(monkeypatch: pytest.MonkeyPatch) -> None:
    real = httpx.AsyncHTTPTransport.handle_async_request

    async def guarded(self: httpx.AsyncHTTPTransport, request: httpx.Request) -> httpx.Response:
        if request.url.host != "127.0.0.1":
            raise httpx.ConnectError("the fuzz test reaches nothing but 127.0.0.1", request=request)
        return await real(self, request)

    monkeypatch.setattr(httpx.AsyncHTTPTransport, "handle_async_request", guarded)


ANSWER = json.dumps(
    {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Mercury, Venus"},
                "finish_reason": "stop",
            }
        ]
    }
).encode()


async def tolerant_engine(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers 200 to anything (the canary included), so any 5xx the fuzzer sees is the gateway's own."""
    if scope["type"] != "http":
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False) and message["type"] == "http.request"
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]}
    )
    await send({"type": "http.response.body", "body": ANSWER})


@contextlib.contextmanager
def gateway() -> Iterator[str]:
    with serve(tolerant_engine) as (engine_url, _engine):
        backends = [{"id": "a", "url": engine_url, "models": ["m"]}]
        cfg = load_settings(None, backends=backends, health={"interval_s": 3600})
        with serve(create_app(cfg)) as (url, _server):
            yield url


def test_admin_api_from_its_openapi_document(loopback_only: None) -> None:
    with gateway() as url:
        schema = schemathesis.openapi.from_url(url + "/admin/openapi.json")
        cases: dict[int, int] = {}
        started = time.monotonic()
        expected = 0
        for result in schema.get_all_operations():
            operation = result.ok()
            strategies = [operation.as_strategy(generation_mode=m) for m in GenerationMode]
            if "{id}" in operation.path and operation.method.upper() != "DELETE":
                # Random ids are mostly 404s: also fuzz the bodies against the backend that exists.
                strategies.append(operation.as_strategy(path_parameters={"id": "a"}))
            expected += len(strategies) * ADMIN_EXAMPLES
            for strategy in strategies:

                @FUZZ
                @given(case=strategy)
                def one(case: Any) -> None:
                    response = case.call(base_url=url, timeout=10)
                    cases[response.status_code] = cases.get(response.status_code, 0) + 1
                    assert response.status_code < 500, (
                        case.method,
                        case.formatted_path,
                        case.body,
                        response.text,
                    )
                    # The document describes what came back: a declared status, its content type, its schema.
                    case.validate_response(response, checks=CONFORMANCE)

                one()
        total = sum(cases.values())
        print(
            f"schemathesis: {total} cases in {time.monotonic() - started:.1f} s, "
            f"by status {sorted(cases.items())}"
        )
        assert total == expected  # every strategy ran its full count: no case was skipped or filtered away
        assert httpx.get(url + "/healthz").status_code == 200


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool"]) | st.text(max_size=5)},
    optional={"content": JSON | st.text(max_size=30), "name": JSON},
)
VALID_CHAT = st.fixed_dictionaries(
    {
        "model": st.just("m"),
        "messages": st.lists(
            st.fixed_dictionaries(
                {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=30)}
            ),
            min_size=1,
            max_size=4,
        ),
    },
    optional={
        "stream": st.booleans(),
        "max_tokens": st.integers(-5, 50),
        "thinking_budget": st.integers(-5, 100_000) | JSON,
        "reasoning_effort": st.sampled_from(["low", "high", "none", "bogus"]),
        "temperature": st.floats(allow_nan=False) | JSON,
    },
)
CHAT = st.fixed_dictionaries(
    {},
    optional={
        "model": st.just("m") | JSON,
        "messages": st.lists(MESSAGE | JSON, max_size=4) | JSON,
        "stream": st.booleans() | JSON,
        "max_tokens": st.integers(-5, 50) | JSON,
        "thinking_budget": st.integers(-5, 100_000) | JSON,
        "reasoning_effort": st.sampled_from(["low", "high", "none", "bogus"]) | JSON,
        "tools": JSON,
        "prompt": st.text(max_size=30) | JSON,
    },
)
RAW = st.binary(max_size=200) | st.just(b"[" * 5000) | st.just(b'{"model": "m", "messages": [' * 2000)


def test_v1_bodies_never_get_a_5xx(loopback_only: None) -> None:
    with gateway() as url, httpx.Client(base_url=url, timeout=10) as client:
        statuses: dict[int, int] = {}

        @settings(FUZZ, max_examples=V1_EXAMPLES)
        @given(
            path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]),
            body=VALID_CHAT | CHAT | RAW,
            session=st.none() | st.text(max_size=10),
        )
        def one(path: str, body: dict[str, Any] | bytes, session: str | None) -> None:
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers = {"content-type": "application/json"}
            if session and session == session.strip() and session.isprintable() and session.isascii():
                headers["x-session-id"] = session
            response = client.post(path, content=raw, headers=headers)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            assert response.status_code < 500, (path, raw[:300], response.text)

        started = time.monotonic()
        one()
        total = sum(statuses.values())
        print(
            f"hypothesis /v1: {total} cases in {time.monotonic() - started:.1f} s, "
            f"by status {sorted(statuses.items())}"
        )
        assert total == V1_EXAMPLES
