"""Against a real uvicorn server on 127.0.0.1: the official client, broken connections, disconnects."""

import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from backends.sim import SimConfig, SimServer


@pytest.fixture(scope="module")
def live_sim() -> Iterator[SimServer]:
    """A real uvicorn server on a free 127.0.0.1 port, shared by this module's tests."""
    with SimServer(SimConfig(name="live", time_scale=0.0, reasoning_tokens=(4, 8))) as sim:
        yield sim


@pytest.fixture
def http(live_sim: SimServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=live_sim.base_url, trust_env=False, timeout=5) as c:
        c.delete("/sim/faults")
        yield c


@pytest.fixture
def oai(live_sim: SimServer) -> Iterator[openai.OpenAI]:
    transport = openai.DefaultHttpxClient(trust_env=False, timeout=5)
    url = f"{live_sim.base_url}/v1"
    with openai.OpenAI(base_url=url, api_key="sk-sim", http_client=transport, max_retries=0) as client:
        yield client


def wait_for(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


PROMPT: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": " ".join(f"w{i}" for i in range(120))}
]


def test_openai_client_reads_streams_and_usage(oai: openai.OpenAI) -> None:
    full = oai.chat.completions.create(model="sim-model", messages=PROMPT, max_tokens=12)
    stream = oai.chat.completions.create(
        model="sim-model",
        messages=PROMPT,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == (usage.prompt_tokens - 1) // 16 * 16


def test_openai_client_sees_reasoning_and_completions(oai: openai.OpenAI) -> None:
    stream = oai.chat.completions.create(
        model="sim-model",
        messages=PROMPT,
        max_tokens=50,
        stream=True,
        extra_body={"thinking_token_budget": 2, "chat_template_kwargs": {"enable_thinking": True}},
    )
    reasoning = [(c.choices[0].delta.model_extra or {}).get("reasoning") for c in stream if c.choices]
    assert len([r for r in reasoning if r]) == 2
    completion = oai.completions.create(model="sim-model", prompt="once upon a time", max_tokens=4)
    assert len(completion.choices[0].text.split()) == 4
    assert [m.id for m in oai.models.list()] == ["sim-model"]


def test_openai_client_gets_404_for_unknown_models(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=PROMPT)


def test_die_mid_stream_breaks_the_connection(http: httpx.Client, live_sim: SimServer) -> None:
    http.post("/sim/faults", json={"die_mid_stream_after": 2})
    body = {"messages": PROMPT, "max_tokens": 10, "stream": True}
    lines: list[str] = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        http.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines.extend(line for line in r.iter_lines() if line)
    assert len(lines) == 2 and "[DONE]" not in lines[-1]
    wait_for(lambda: live_sim.engine.num_running == 0)


@pytest.fixture
def slow_sim() -> Iterator[SimServer]:
    with SimServer(SimConfig(name="slow", decode_tps=20, ttft_base_ms=0, answer_tokens=(400, 400))) as sim:
        yield sim


def test_client_disconnect_stops_a_stream(slow_sim: SimServer) -> None:
    body = {"messages": PROMPT, "max_tokens": 400, "stream": True}  # ~20 s if nobody stopped it
    with httpx.Client(base_url=slow_sim.base_url, trust_env=False) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            assert slow_sim.engine.num_running == 1
        wait_for(lambda: slow_sim.engine.num_running == 0)
        assert c.get("/sim/stats").json()["finished"] == {"abort": 1}


def test_client_disconnect_stops_a_non_streaming_request(slow_sim: SimServer) -> None:
    body = {"messages": PROMPT, "max_tokens": 400}
    with (
        httpx.Client(base_url=slow_sim.base_url, trust_env=False, timeout=0.3) as c,
        pytest.raises(httpx.ReadTimeout),
    ):
        c.post("/v1/chat/completions", json=body)
    wait_for(lambda: slow_sim.engine.num_running == 0)
    assert slow_sim.engine.stats.finished == {"abort": 1}


def test_module_entry_point_parses_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "backends.sim", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    assert "--decode-slowdown" in out.stdout and "--die-mid-stream-after" in out.stdout
