import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backends.engine_metrics import parse_signals
from backends.sim import SimConfig
from backends.sim.testing import asgi_client
from config.settings import Dialect

pytestmark = pytest.mark.anyio


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(SimConfig(name="fast", time_scale=0)) as c:
        yield c


def chat(text: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}], **extra}


def long_text(n: int, tag: str = "w") -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def sse_events(body: str) -> list[str]:
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e.removeprefix("data: ") for e in events]


def metric_values(text: str) -> dict[str, float]:
    """name(+suffix) → value, asserting every sample carries the vLLM ``model_name`` label (but the
    configuration's info gauge, which vLLM labels with the configuration alone)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            continue
        for sample in family.samples:
            assert sample.labels["model_name"] == "sim-model"
            extra = [v for k, v in sorted(sample.labels.items()) if k != "model_name"]
            values["|".join([sample.name, *extra])] = sample.value
    return values


async def test_chat_completion_json_shape_and_usage(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/chat/completions", json=chat("hello there", max_tokens=5))
    assert r.status_code == 200
    assert r.headers["x-sim-name"] == "fast"
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "sim-model"
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 5
    assert choice["finish_reason"] == "length"
    assert "reasoning" not in choice["message"]
    assert body["usage"] == {
        "prompt_tokens": 3 + 2 + 2,
        "completion_tokens": 5,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_output_is_deterministic_per_prompt(client: httpx.AsyncClient) -> None:
    texts = []
    for text in ("same prompt", "same prompt", "other prompt"):
        r = await client.post("/v1/chat/completions", json=chat(text, max_tokens=30))
        texts.append(r.json()["choices"][0]["message"]["content"])
    assert texts[0] == texts[1] != texts[2]


async def test_multi_turn_follow_up_hits_the_cache(client: httpx.AsyncClient) -> None:
    turn1 = [{"role": "user", "content": long_text(200)}]
    r1 = (await client.post("/v1/chat/completions", json={"messages": turn1, "max_tokens": 20})).json()
    reply = r1["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    r2 = (await client.post("/v1/chat/completions", json={"messages": turn2, "max_tokens": 20})).json()
    first_prompt, cached = r1["usage"]["prompt_tokens"], r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached % 16 == 0
    assert (first_prompt - 1) // 16 * 16 <= cached < r2["usage"]["prompt_tokens"]


async def test_streaming_chat_chunks_and_usage(client: httpx.AsyncClient) -> None:
    body = chat("stream me", max_tokens=4, stream=True, stream_options={"include_usage": True})
    r = await client.post("/v1/chat/completions", json=body)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert len(text.split()) == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    no_usage = await client.post("/v1/chat/completions", json=chat("stream me", max_tokens=4, stream=True))
    assert all("usage" not in json.loads(e) for e in sse_events(no_usage.text)[:-1])


async def test_completions_json_and_stream(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/completions", json={"model": "sim-model", "prompt": "a b c", "max_tokens": 3})
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 3
    stream = await client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 3, "stream": True})
    chunks = [json.loads(e) for e in sse_events(stream.text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == body["choices"][0]["text"]
    ids = await client.post("/v1/completions", json={"prompt": [1, 2, 3, 4], "max_tokens": 1})
    assert ids.json()["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize(
    ("payload", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (json.dumps(chat("x") | {"model": "nope"}).encode(), 404, "model_not_found"),
        (json.dumps(chat("x", n=2)).encode(), 400, "invalid_value"),
        (json.dumps(chat("x", max_tokens=0)).encode(), 400, "invalid_value"),
        (json.dumps(chat("x", max_tokens="3")).encode(), 400, "invalid_value"),
        (json.dumps({"messages": "hi"}).encode(), 400, "invalid_value"),
        (json.dumps({"messages": [{"content": "no role"}]}).encode(), 400, "invalid_value"),
        (json.dumps(chat("x", max_tokens=200_000)).encode(), 400, "context_length_exceeded"),
    ],
)
async def test_bad_requests_get_openai_errors(
    client: httpx.AsyncClient, payload: bytes, status: int, code: str
) -> None:
    r = await client.post("/v1/chat/completions", content=payload)
    assert r.status_code == status
    error = r.json()["error"]
    assert error["code"] == code
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)


async def test_models_and_health() -> None:
    async with asgi_client(SimConfig(models=("m1", "m2"), time_scale=0)) as c:
        models = (await c.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["m1", "m2"]
        assert (await c.get("/health")).status_code == 200
        ok = await c.post("/v1/completions", json={"model": "m2", "prompt": "x", "max_tokens": 1})
        assert ok.status_code == 200 and ok.json()["model"] == "m2"


async def test_metrics_use_vllm_names_and_move(client: httpx.AsyncClient) -> None:
    before = metric_values((await client.get("/metrics")).text)
    for name in (
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert before[name] == 0
    body = chat(long_text(100), max_tokens=3)
    await client.post("/v1/chat/completions", json=body)
    second = (await client.post("/v1/chat/completions", json=body)).json()
    after = metric_values((await client.get("/metrics")).text)
    prompt_tokens = second["usage"]["prompt_tokens"]
    assert after["vllm:prefix_cache_queries_total"] == 2 * prompt_tokens
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert after["vllm:prefix_cache_hits_total"] == cached > 0
    assert after["vllm:prompt_tokens_total"] == 2 * prompt_tokens
    assert after["vllm:generation_tokens_total"] == 6
    assert after["vllm:request_success_total|length"] == 2
    assert after["vllm:num_requests_running"] == 0


async def test_reset_prefix_cache_and_stats(client: httpx.AsyncClient) -> None:
    body = chat(long_text(50), max_tokens=1)
    await client.post("/v1/chat/completions", json=body)
    assert (await client.post("/reset_prefix_cache")).status_code == 200
    again = (await client.post("/v1/chat/completions", json=body)).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stats = (await client.get("/sim/stats")).json()
    assert stats["requests"] == 2 and stats["cached_tokens"] == 0
    assert stats["paths"]["/v1/chat/completions"] == 2 and stats["paths"]["/reset_prefix_cache"] == 1
    assert stats["cache"]["blocks"] > 0 and stats["running"] == 0
    await client.get("/no/such/path")
    assert (await client.get("/sim/stats")).json()["paths"]["other"] == 1


async def test_two_simulators_in_one_process_keep_separate_metrics() -> None:
    async with (
        asgi_client(SimConfig(name="a", time_scale=0)) as a,
        asgi_client(SimConfig(name="b", time_scale=0)) as b,
    ):
        await a.post("/v1/chat/completions", json=chat("hello", max_tokens=2))
        assert metric_values((await a.get("/metrics")).text)["vllm:generation_tokens_total"] == 2
        assert metric_values((await b.get("/metrics")).text)["vllm:generation_tokens_total"] == 0
        assert (await b.get("/health")).headers["x-sim-name"] == "b"


async def test_priority_is_taken_under_the_priority_policy_and_refused_under_fcfs(
    client: httpx.AsyncClient,
) -> None:
    assert (
        await client.post("/v1/chat/completions", json=chat("x", max_tokens=2, priority=0))
    ).status_code == 200
    refused = await client.post("/v1/chat/completions", json=chat("x", max_tokens=2, priority=3))
    assert refused.status_code == 400 and "priority" in refused.json()["error"]["message"]
    async with asgi_client(SimConfig(time_scale=0, scheduling_policy="priority")) as by_priority:
        for priority in (3, -1):
            r = await by_priority.post(
                "/v1/chat/completions", json=chat("x", max_tokens=2, priority=priority)
            )
            assert r.status_code == 200
        r = await by_priority.post("/v1/chat/completions", json=chat("x", max_tokens=2, priority="high"))
        assert r.status_code == 400


async def test_metrics_give_the_kv_cache_size_as_vllm_does() -> None:
    async with asgi_client(SimConfig(cache_tokens=3000, block_size=16, time_scale=0)) as c:
        text = (await c.get("/metrics")).text
    (line,) = [x for x in text.splitlines() if x.startswith("vllm:cache_config_info{")]
    assert 'num_gpu_blocks="187"' in line and 'block_size="16"' in line and line.endswith(" 1.0")
    assert parse_signals(text, 0.0, Dialect.VLLM).kv_capacity == 187 * 16
