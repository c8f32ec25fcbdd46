import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from backends.sim import Faults, SimConfig
from backends.sim.testing import asgi_client
from backends.sim.text import REPEAT_WORD

pytestmark = pytest.mark.anyio


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with asgi_client(SimConfig(name="fast", time_scale=0)) as c:
        yield c


BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


async def test_fail_next_answers_500_n_times(client: httpx.AsyncClient) -> None:
    r = await client.post("/sim/faults", json={"fail_next": 2})
    assert r.json()["fail_next"] == 2
    statuses = [(await client.post("/v1/chat/completions", json=BODY)).status_code for _ in range(3)]
    assert statuses == [500, 500, 200]
    failed = await client.post("/sim/faults", json={"fail_next": 1})
    assert failed.status_code == 200
    r = await client.post("/v1/completions", json={"prompt": "x", "stream": True})
    assert r.status_code == 500 and r.json()["error"]["code"] == "simulated_failure"
    stats = (await client.get("/sim/stats")).json()
    assert stats["injected_failures"] == 3 and stats["faults"]["fail_next"] == 0


async def test_stall_delays_the_first_byte(client: httpx.AsyncClient) -> None:
    await client.post("/sim/faults", json={"stall_s": 0.15})
    start = time.perf_counter()
    r = await client.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200
    assert time.perf_counter() - start >= 0.15


async def test_repeat_token_loops_to_the_length_limit(client: httpx.AsyncClient) -> None:
    await client.post("/sim/faults", json={"repeat_token": True})
    body = (await client.post("/v1/chat/completions", json=BODY | {"max_tokens": 12})).json()
    assert body["choices"][0]["message"]["content"].split() == [REPEAT_WORD] * 12
    assert body["choices"][0]["finish_reason"] == "length"


async def test_health_fail_and_reset(client: httpx.AsyncClient) -> None:
    await client.post("/sim/faults", json={"health_fail": True, "die_mid_stream_after": 3})
    assert (await client.get("/health")).status_code == 503
    assert (await client.post("/sim/faults", json={"die_mid_stream_after": None})).json()[
        "die_mid_stream_after"
    ] is None
    reset = (await client.delete("/sim/faults")).json()
    assert reset == {
        "fail_next": 0,
        "die_mid_stream_after": None,
        "stall_s": 0.0,
        "repeat_token": False,
        "health_fail": False,
        "slow_factor": 1.0,
    }
    assert (await client.get("/health")).status_code == 200


@pytest.mark.parametrize(
    "payload",
    [{"fail_next": -1}, {"bogus": 1}, {"repeat_token": "yes"}, {"stall_s": -0.5}, {"fail_next": True}, [1]],
)
async def test_bad_fault_bodies_are_rejected(client: httpx.AsyncClient, payload: Any) -> None:
    r = await client.post("/sim/faults", content=json.dumps(payload))
    assert r.status_code == 400
    assert (await client.get("/sim/faults")).json()["fail_next"] == 0


async def test_faults_can_start_switched_on() -> None:
    async with asgi_client(SimConfig(time_scale=0, faults=Faults(fail_next=1, health_fail=True))) as c:
        assert (await c.get("/health")).status_code == 503
        assert (await c.post("/v1/chat/completions", json=BODY)).status_code == 500
        assert (await c.post("/v1/chat/completions", json=BODY)).status_code == 200
