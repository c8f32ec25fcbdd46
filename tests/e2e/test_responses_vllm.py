"""/v1/responses on real vLLM CPU engines with their response store on (the session's engines have it on): a
``previous_response_id`` chain through two gateway replicas sharing a real Redis reaches the owning engine
every turn, with the official ``openai`` SDK's Responses client as the caller (streamed and not)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import openai
import pytest

from config.settings import load_settings
from gateway.app import create_app
from tools.redis_server import RedisServer

from .engines import VllmEngine
from .gateways import BACKEND_HEADER, FAST_HEALTH, MODEL, ROUTE_HEADER
from upstreams import serve

QUICK = {"max_output_tokens": 8, "reasoning": {"effort": "none"}}


@pytest.fixture
def replicas(
    vllm_engines: list[VllmEngine], redis_server: RedisServer, redis_prefix: str
) -> Iterator[list[str]]:
    backends = [{"id": e.name, "url": e.base_url, "models": [MODEL], "dialect": "vllm"} for e in vllm_engines]
    settings = load_settings(
        None,
        backends=backends,
        health=FAST_HEALTH,
        redis={"url": redis_server.url, "prefix": redis_prefix, "timeout_s": 2.0},
        routing={"policy": "least_loaded"},  # nothing but the owner record keeps a chain in place
    )
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(serve(create_app(settings)))[0] for _ in range(2)]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_chain_through_two_replicas_reaches_the_owner_every_turn(replicas: list[str]) -> None:
    clients = [_client(url) for url in replicas]
    owners: set[str] = set()
    for chain in range(2):
        raw = clients[0].responses.with_raw_response.create(
            model=MODEL, input=f"Say a word about chain {chain}.", instructions="Be brief.", **QUICK
        )
        first = raw.parse()
        owner = raw.headers[BACKEND_HEADER]
        owners.add(owner)
        assert first.usage is not None and first.usage.input_tokens > 0
        previous = first.id
        for turn in range(1, 5):
            client = clients[turn % 2]  # the other replica, the instant the last answer ended
            if turn % 2:
                again = client.responses.with_raw_response.create(
                    model=MODEL, input=f"And turn {turn}?", previous_response_id=previous, **QUICK
                )
                assert (again.headers[BACKEND_HEADER], again.headers[ROUTE_HEADER]) == (
                    owner,
                    "response_owner",
                )
                previous = again.parse().id
                continue
            with client.responses.with_streaming_response.create(
                model=MODEL, input=f"And turn {turn}?", previous_response_id=previous, stream=True, **QUICK
            ) as streamed:
                assert streamed.headers[BACKEND_HEADER] == owner
                events = list(streamed.parse())
            assert events[0].type == "response.created" and events[-1].type == "response.completed"
            previous = events[-1].response.id  # type: ignore[union-attr]
        stored = clients[chain % 2].responses.retrieve(previous)  # either replica finds the owner
        assert stored.id == previous
    with pytest.raises(openai.NotFoundError):
        clients[1].responses.create(model=MODEL, input="x", previous_response_id="resp_nobody", **QUICK)
    # Usage read from the engines' own answers (a body's, response.completed's) on the replica that
    # started every chain.
    lines = httpx.get(replicas[0] + "/metrics").text.splitlines()
    for owner in owners:
        prefix = f'warmroute_prompt_tokens_total{{backend="{owner}",model="{MODEL}"}} '
        assert [float(line.removeprefix(prefix)) > 0 for line in lines if line.startswith(prefix)] == [True]
