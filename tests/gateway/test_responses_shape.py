"""/v1/responses as an API shape: the client's bytes forwarded, usage counted, and stored state
(``previous_response_id``, GET/DELETE/cancel/input_items) reaching only the engine that owns it."""

from __future__ import annotations

import contextlib
import json
import time

import httpx
import openai
import pytest

from backends.registry import Registry
from config.settings import RedisConfig, RoutingConfig, load_settings
from gateway.app import create_app
from gateway.errors import ServerBusy
from gateway.observe import ResponseTap
from gateway.ownership import Recorder, ResponseOwnership
from gateway.redis_keys import RedisKeys
from gateway.redis_store import RedisAffinityStore, redis_pool
from gateway.shapes.responses import RESPONSES, usage
from gateway.sse import EventSplitter
from gateway.state import MemoryAffinityStore
from routing.keys import first_reply, reply_key, responses_key
from routing.shape import chat_shape
from routing.types import BackendState
from tools.procs import free_port
from tools.redis_server import CountingConnection, RedisServer

from clusters import Cluster, ClusterFactory
from responses_fakes import ResponsesEngine
from upstreams import FAST_HEALTH, serve

HEAD = {"model": "m", "instructions": "You are Codex.", "tools": [{"type": "function", "name": "sh"}]}


def two(cluster: ClusterFactory, **overrides: object) -> Cluster:
    return cluster(engines=[ResponsesEngine("a"), ResponsesEngine("b")], **overrides)


def engine_of(c: Cluster, response_id: str) -> str:
    return next(name for name, e in c.engines.items() if response_id in e.stored)  # type: ignore[attr-defined]


def response_id(r: httpx.Response) -> str:
    """The id of an answer: a body's, or a stream's ``response.created`` ``response.id``."""
    if r.headers["content-type"].startswith("text/event-stream"):
        created = json.loads(r.text.split("data: ", 1)[1].split("\n", 1)[0])
        assert created["type"] == "response.created"
        return str(created["response"]["id"])
    return str(r.json()["id"])


def metric_lines(c: Cluster) -> list[str]:
    c.wait_idle()
    return httpx.get(c.url + "/metrics").text.splitlines()


# -- the shape ------------------------------------------------------------------------------------------


def test_the_key_is_the_head_through_the_first_user_item_and_a_string_is_one_user_message() -> None:
    turn1 = {**HEAD, "input": "fix the bug"}
    turn2 = {**HEAD, "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "fix the bug"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
    ]}  # fmt: skip
    assert responses_key(turn1) == responses_key(turn2)
    assert responses_key(turn1) != responses_key({**turn1, "instructions": "You are Claude."})
    assert responses_key(turn1) != responses_key({**turn1, "tools": []})
    assert responses_key(turn1) != responses_key({**turn1, "input": "another task"})


def test_usage_is_read_from_a_body_and_from_response_completed() -> None:
    body = (
        b'{"id":"r","usage":{"input_tokens":9,"input_tokens_details":{"cached_tokens":4},"output_tokens":2}}'
    )
    got = usage(body)
    assert got is not None and (got.prompt_tokens, got.completion_tokens, got.cached_tokens) == (9, 2, 4)
    assert usage(b'event: response.created\ndata: {"response":{"usage":null}}\n\n') is None


def test_a_response_goes_as_the_client_s_bytes_and_its_usage_is_counted(cluster: ClusterFactory) -> None:
    c = cluster(engines=[ResponsesEngine("a")])
    raw = b'{"model": "m", "input": "hi", "x_unknown": {"kept": [1, 2]}, "store": true}'
    r = httpx.post(c.url + "/v1/responses", content=raw)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "resp_a0001"
    assert c.engines["a"].raw == [raw]
    streamed = httpx.post(c.url + "/v1/responses", json={"model": "m", "input": "hi", "stream": True})
    assert streamed.text.startswith("event: response.created\ndata: ")
    assert "[DONE]" not in streamed.text
    lines = metric_lines(c)
    assert 'warmroute_prompt_tokens_total{backend="a",model="m"} 14.0' in lines
    assert 'warmroute_cached_prompt_tokens_total{backend="a",model="m"} 10.0' in lines
    assert 'warmroute_completion_tokens_total{backend="a",model="m"} 6.0' in lines  # "a says N": 3 words


def test_bad_fields_are_openai_shaped_400s_that_reach_no_engine(cluster: ClusterFactory) -> None:
    c = two(cluster)
    cases = {
        "input": {"model": "m", "input": 3},
        "previous_response_id": {"model": "m", "input": "x", "previous_response_id": "../etc"},
        "reasoning.effort": {"model": "m", "input": "x", "reasoning": {"effort": "extreme"}},
        "store": {"model": "m", "input": "x", "store": "yes"},
    }
    for param, body in cases.items():
        r = httpx.post(c.url + "/v1/responses", json=body)
        assert r.status_code == 400, (param, r.text)
        assert r.json()["error"]["param"] == param
    assert c.engines["a"].raw == c.engines["b"].raw == []


def test_a_stream_that_breaks_ends_with_the_responses_error_event(cluster: ClusterFactory) -> None:
    c = cluster(engines=[ResponsesEngine("a", break_stream=True)])
    r = httpx.post(c.url + "/v1/responses", json={"model": "m", "input": "hi", "stream": True})
    last = r.text.rstrip("\n").split("\n\n")[-1]
    assert last.startswith("event: error\ndata: ")
    event = json.loads(last.split("data: ", 1)[1])
    assert event["type"] == "error" and event["sequence_number"] == 0 and event["message"]
    assert "[DONE]" not in r.text
    c.wait_idle()


# -- ownership ------------------------------------------------------------------------------------------


def test_a_chain_of_three_turns_always_reaches_the_owner(cluster: ClusterFactory) -> None:
    c = two(cluster, routing={"policy": "least_loaded"})  # nothing but the owner record keeps it in place
    for chain in range(6):
        first = httpx.post(c.url + "/v1/responses", json={**HEAD, "input": f"task {chain}"}).json()
        owner = engine_of(c, first["id"])
        previous = first["id"]
        for turn in range(2):
            body = {**HEAD, "input": [{"role": "user", "content": f"next {turn}"}], "stream": turn == 1}
            r = httpx.post(c.url + "/v1/responses", json={**body, "previous_response_id": previous})
            assert r.status_code == 200, r.text
            assert r.headers["x-warmroute-backend"] == owner
            assert r.headers["x-warmroute-route"] == "response_owner"
            previous = response_id(r)
            assert engine_of(c, previous) == owner
    c.wait_idle()
    assert c.in_flight() == 0


def test_an_unknown_id_is_a_404_that_reaches_no_engine(cluster: ClusterFactory) -> None:
    c = two(cluster)
    body = {"model": "m", "input": "x", "previous_response_id": "resp_zz"}
    r = httpx.post(c.url + "/v1/responses", json=body)
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "response_not_found" and "resend" in error["message"]
    for path in ("/v1/responses/resp_zz", "/v1/responses/resp_zz/input_items"):
        assert httpx.get(c.url + path).status_code == 404
    assert httpx.post(c.url + "/v1/responses/resp_zz/cancel").status_code == 404
    assert httpx.delete(c.url + "/v1/responses/resp_zz").status_code == 404
    assert c.engines["a"].raw == c.engines["b"].raw == []


def test_owner_down_is_a_409_that_says_why_and_what_to_do(cluster: ClusterFactory) -> None:
    c = two(cluster)
    rid = httpx.post(c.url + "/v1/responses", json={**HEAD, "input": "task"}).json()["id"]
    owner = engine_of(c, rid)
    other = "b" if owner == "a" else "a"
    c.engines[owner].healthy = False
    backends = c.gateway.registry.backends
    c.wait_for(lambda: backends[owner].state is BackendState.DOWN, f"{owner} down")
    seen = len(c.engines[other].raw)
    r = httpx.post(c.url + "/v1/responses", json={**HEAD, "input": "more", "previous_response_id": rid})
    assert r.status_code == 409
    error = r.json()["error"]
    assert error["code"] == "response_owner_gone"
    assert f"backend {owner!r}" in error["message"] and "down" in error["message"]
    assert "resend the conversation's full input without previous_response_id" in error["message"]
    assert httpx.get(c.url + f"/v1/responses/{rid}").status_code == 409
    assert len(c.engines[other].raw) == seen  # never a silent other engine
    assert c.in_flight() == 0


def test_get_delete_cancel_and_input_items_reach_the_owner(cluster: ClusterFactory) -> None:
    c = two(cluster, routing={"policy": "least_loaded"})
    rid = httpx.post(c.url + "/v1/responses", json={**HEAD, "input": "task"}).json()["id"]
    owner = engine_of(c, rid)
    engine = c.engines[owner]
    engine.paths.clear()
    for _ in range(3):  # least loaded alone would alternate
        assert httpx.get(c.url + f"/v1/responses/{rid}").json()["id"] == rid
    items = httpx.get(c.url + f"/v1/responses/{rid}/input_items?limit=2&order=asc")
    assert items.json()["data"] == ["task"]
    assert httpx.post(c.url + f"/v1/responses/{rid}/cancel").json()["status"] == "cancelled"
    assert httpx.delete(c.url + f"/v1/responses/{rid}").json()["deleted"] is True
    assert engine.paths == [
        *[f"GET /v1/responses/{rid}"] * 3,
        f"GET /v1/responses/{rid}/input_items?limit=2&order=asc",
        f"POST /v1/responses/{rid}/cancel",
        f"DELETE /v1/responses/{rid}",
    ]
    gone = httpx.get(c.url + f"/v1/responses/{rid}")  # the owner's own 404, as it sent it
    assert gone.status_code == 404 and "not found" in gone.json()["error"]["message"]


def test_a_bad_id_in_the_path_is_a_400(cluster: ClusterFactory) -> None:
    c = two(cluster)
    r = httpx.get(c.url + "/v1/responses/%20bad")
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_id"
    assert c.engines["a"].raw == c.engines["b"].raw == []


def test_store_false_is_not_recorded(cluster: ClusterFactory) -> None:
    c = cluster(engines=[ResponsesEngine("a")])
    rid = httpx.post(c.url + "/v1/responses", json={"model": "m", "input": "x", "store": False}).json()["id"]
    store = c.gateway.store
    assert isinstance(store, MemoryAffinityStore)
    assert store.owners.get(rid, 0.0) is None and len(store.owners) == 0


# -- the record is written before the client can see the id --------------------------------------------


@pytest.mark.anyio
async def test_the_owner_is_recorded_before_the_bytes_holding_the_id_are_sent() -> None:
    settings = load_settings(None, backends=[{"id": "a", "url": "http://127.0.0.1:9", "models": ["m"]}])
    store = MemoryAffinityStore(settings.routing)
    registry = Registry(settings.backends)
    seen: list[tuple[bytes, str | None]] = []

    async def client(message: dict[str, object]) -> None:
        if message["type"] == "http.response.body":
            seen.append((message["body"], await store.owner("resp_9")))  # type: ignore[arg-type]

    ctx = _context(registry)
    recorder = Recorder(ctx, client, store)
    head = [(b"content-type", b"text/event-stream")]
    await recorder.send({"type": "http.response.start", "status": 200, "headers": head})
    first, second = b"event: response.created\ndata: {", b'"response":{"id":"resp_9"}}\n\n'
    for chunk in (first, second):
        await recorder.send({"type": "http.response.body", "body": chunk, "more_body": True})
    assert seen == [(first, None), (second, "a")]  # the id reached the client once its owner was known


def _context(registry: Registry):  # type: ignore[no-untyped-def]
    from gateway.context import RequestContext
    from routing.policies.least_loaded import LeastLoadedPolicy

    ctx = RequestContext("POST", "/v1/responses", b"{}", {}, "m", "k", LeastLoadedPolicy(), [], {}, RESPONSES)
    ctx.lease = registry.lease("a")
    return ctx


# -- the openai SDK as caller -----------------------------------------------------------------------------


def test_the_openai_sdk_chains_streams_and_reads_errors_as_its_own(cluster: ClusterFactory) -> None:
    c = two(cluster, routing={"policy": "least_loaded"})
    client = openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0)
    first = client.responses.create(model="m", input="hello", instructions="be brief")
    owner = engine_of(c, first.id)
    assert first.output_text == f"{owner} says 1"
    assert first.usage is not None and first.usage.input_tokens_details.cached_tokens == 5
    stream = client.responses.create(model="m", input="again", previous_response_id=first.id, stream=True)
    events = list(stream)
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.strip() == f"{owner} says 2"
    second = events[-1].response.id
    third = client.responses.create(model="m", input="and again", previous_response_id=second)
    assert engine_of(c, third.id) == owner
    assert client.responses.retrieve(third.id).id == third.id
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id="resp_unknown")
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="m", input="x", reasoning={"effort": "extreme"})  # type: ignore[typeddict-item]
    c.wait_idle()


# -- two replicas sharing Redis ---------------------------------------------------------------------------


def test_a_chain_alternating_replicas_sharing_redis_reaches_the_owner_every_turn(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    with contextlib.ExitStack() as stack:
        engines = {n: ResponsesEngine(n) for n in ("a", "b", "c")}
        backends = [
            {"id": n, "url": stack.enter_context(serve(e.app()))[0], "models": ["m"]}
            for n, e in engines.items()
        ]
        redis = {"url": redis_server.url, "prefix": redis_prefix, "timeout_s": 2.0}
        settings = load_settings(
            None, backends=backends, redis=redis, routing={"policy": "least_loaded"}, health=FAST_HEALTH
        )
        replicas = [stack.enter_context(serve(create_app(settings)))[0] for _ in range(2)]
        reached = 0
        for chain in range(4):
            first = httpx.post(replicas[0] + "/v1/responses", json={**HEAD, "input": f"task {chain}"})
            rid = first.json()["id"]
            owner = next(n for n, e in engines.items() if rid in e.stored)
            for turn in range(1, 7):  # the follow-up goes to the other replica the instant the answer ended
                body = {**HEAD, "input": f"turn {turn}", "previous_response_id": rid, "stream": turn % 2 == 0}
                r = httpx.post(replicas[turn % 2] + "/v1/responses", json=body)
                assert r.status_code == 200, r.text
                reached += r.headers["x-warmroute-backend"] == owner
                rid = response_id(r)
                assert rid in engines[owner].stored
        assert reached == 4 * 6  # 100 %, and no engine's 404 on the way


def test_a_chained_turn_costs_two_redis_round_trips_the_owner_s_lookup_and_its_answer_s_record(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    """Before a chained turn is sent, only the owner is looked up: with one eligible backend no pin or
    counts decide anything, so they are not read. After it, its answer's id is recorded."""
    counting = CountingConnection.fresh()
    with contextlib.ExitStack() as stack:
        engines = {n: ResponsesEngine(n) for n in ("a", "b")}
        backends = [
            {"id": n, "url": stack.enter_context(serve(e.app()))[0], "models": ["m"]}
            for n, e in engines.items()
        ]
        redis = {"url": redis_server.url, "prefix": redis_prefix, "timeout_s": 2.0, "heartbeat_s": 60,
                 "lease_ttl_s": 120}  # fmt: skip
        settings = load_settings(
            None, backends=backends, redis=redis, routing={"policy": "affinity"}, health=FAST_HEALTH,
            admin={"sync_interval_s": 3600},  # no change-feed poll while round trips are counted
        )  # fmt: skip
        store = RedisAffinityStore(
            settings.redis, settings.routing, [b.id for b in settings.backends],
            pool=redis_pool(settings.redis, connection_class=counting),
        )  # fmt: skip
        url = stack.enter_context(serve(create_app(settings, store)))[0]
        first = httpx.post(url + "/v1/responses", json={**HEAD, "input": "task"})
        rid, owner = first.json()["id"], first.headers["x-warmroute-backend"]
        before, turns = counting.sent, 6
        for turn in range(1, turns + 1):
            body = {**HEAD, "input": f"turn {turn}", "previous_response_id": rid, "stream": turn % 2 == 0}
            r = httpx.post(url + "/v1/responses", json=body)
            assert r.status_code == 200 and r.headers["x-warmroute-backend"] == owner, r.text
            rid = response_id(r)
        per_turn = (counting.sent - before) / turns  # read before the gateway's shutdown writes its own
    assert per_turn == 2, per_turn


# -- reasoning effort through the budget machinery ----------------------------------------------------------


def test_reasoning_effort_goes_as_sent_where_the_dialect_reads_it(cluster: ClusterFactory) -> None:
    c = cluster(engines=[ResponsesEngine("a")])  # dialect openai: none, minimal, low, medium, high
    raw = b'{"model": "m", "input": "x", "reasoning": {"effort": "none", "summary": "auto"}}'
    assert httpx.post(c.url + "/v1/responses", content=raw).status_code == 200
    assert c.engines["a"].raw == [raw]  # the client's own bytes: "none" is its "off"
    lines = metric_lines(c)
    assert 'warmroute_thinking_budget_attempts_total{enforced="off"} 1.0' in lines


def test_an_effort_the_dialect_lacks_is_left_out_and_a_header_effort_is_spelled_in(
    cluster: ClusterFactory,
) -> None:
    # The engine caps thinking itself: its effort goes to its own Responses route (tests/gateway/
    # test_budget_as_chat.py: where the gateway enforces budgets, an effort's budget goes as chat).
    c = cluster(engines=[ResponsesEngine("a")], backend={"budget_enforcement": "native"})
    body = {"model": "m", "input": "x", "reasoning": {"effort": "max", "summary": "auto"}}
    assert httpx.post(c.url + "/v1/responses", json=body).status_code == 200
    headed = httpx.post(
        c.url + "/v1/responses", json={"model": "m", "input": "y"}, headers={"x-reasoning-effort": "low"}
    )
    assert headed.status_code == 200
    sent = c.engines["a"].requests
    assert sent[0]["reasoning"] == {"summary": "auto"}  # the engine's default effort, the rest as sent
    assert sent[1]["reasoning"] == {"effort": "low"}
    assert 'warmroute_thinking_budget_attempts_total{enforced="native"} 2.0' in metric_lines(c)


def test_a_thinking_budget_has_no_meaning_here_and_is_refused(cluster: ClusterFactory) -> None:
    """Neither OpenAI's Responses API nor vLLM's has a reasoning token budget: a budget in the body or the
    header is a 400 that names it and says what to ask with instead; it never reaches an engine."""
    c = cluster(engines=[ResponsesEngine("a")])
    r = httpx.post(c.url + "/v1/responses", json={"model": "m", "input": "x", "thinking_budget": 512})
    assert r.status_code == 400 and r.json()["error"]["param"] == "thinking_budget"
    message = r.json()["error"]["message"]
    assert "/v1/responses" in message and "'reasoning.effort'" in message
    assert "/v1/chat/completions" in message
    headed = httpx.post(
        c.url + "/v1/responses", json={"model": "m", "input": "x"}, headers={"x-thinking-budget": "512"}
    )
    assert headed.status_code == 400 and headed.json()["error"]["param"] == "x-thinking-budget"
    assert "'reasoning.effort'" in headed.json()["error"]["message"]
    bad = httpx.post(
        c.url + "/v1/responses", json={"model": "m", "input": "x"}, headers={"x-reasoning-effort": "lots"}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-reasoning-effort"
    assert c.engines["a"].raw == []


# -- what the routing feedback learns from this shape -------------------------------------------------------


def test_the_tap_reads_the_first_reply_from_output_text_deltas_and_from_a_body() -> None:
    events = (
        b'event: response.created\ndata: {"type":"response.created","response":{"id":"r"}}\n\n'
        b"event: response.reasoning_text.delta\n"
        b'data: {"type":"response.reasoning_text.delta","delta":"hmm"}\n\n'
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"Hel"}\n\n'
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"lo"}\n\n'
    )
    tap = ResponseTap(reply=True, text=RESPONSES.reply)
    tap.take(EventSplitter(1 << 16).feed(events))
    assert tap.reply() == "Hello"
    body = {"id": "r", "output": [{"type": "reasoning"}, {"type": "message", "content": [
        {"type": "output_text", "text": "Hi"}, {"type": "output_text", "text": " there"}]}]}  # fmt: skip
    plain = ResponseTap(reply=True, text=RESPONSES.reply)
    plain.feed(json.dumps(body).encode())
    assert plain.reply() == "Hi there"


def test_the_turns_are_read_from_input_items_and_a_chained_request_has_none() -> None:
    assert RESPONSES.conversation is not None
    turn2 = {"model": "m", "instructions": "sys", "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "task"}]},
        {"type": "reasoning", "summary": []},
        {"type": "function_call", "call_id": "c", "name": "sh", "arguments": '{"cmd":"ls"}'},
        {"type": "function_call_output", "call_id": "c", "output": "a.txt"},
    ]}  # fmt: skip
    messages = RESPONSES.conversation(turn2)
    assert messages is not None
    shape = chat_shape(messages)
    assert (shape.turn, shape.head_chars, shape.tail_chars) == (2, len("sys") + len("task"), len("a.txt"))
    assert first_reply(messages) == '{"cmd":"ls"}'
    assert RESPONSES.conversation({**turn2, "previous_response_id": "resp_1"}) is None


def test_under_the_ttft_policy_a_first_streamed_reply_is_learned(cluster: ClusterFactory) -> None:
    c = cluster(engines=[ResponsesEngine("a")], routing={"policy": "ttft"})
    body = {**HEAD, "input": "task", "stream": True}
    assert httpx.post(c.url + "/v1/responses", json=body).status_code == 200
    c.wait_idle()
    feedback = c.gateway.feedback
    assert feedback is not None
    key = reply_key(responses_key({**HEAD, "input": "task"}), "a says 1 ")
    assert feedback.replies.get(key, time.monotonic()) == "a"


# -- admin "where would this go and why" --------------------------------------------------------------------


def test_explain_takes_a_responses_body_and_names_the_owner_of_a_chain(cluster: ClusterFactory) -> None:
    c = two(cluster, routing={"policy": "affinity"})
    sample = {**HEAD, "input": "task"}
    fresh = httpx.post(c.url + "/admin/route/explain", json={"path": "/v1/responses", "body": sample})
    assert fresh.status_code == 200, fresh.text
    assert fresh.json()["key"] == responses_key(sample) and fresh.json()["reason"] == "new_least_loaded"
    rid = httpx.post(c.url + "/v1/responses", json=sample).json()["id"]
    owner = engine_of(c, rid)
    chained = {**HEAD, "input": "more", "previous_response_id": rid}
    e = httpx.post(c.url + "/admin/route/explain", json={"path": "/v1/responses", "body": chained}).json()
    assert (e["backend"], e["reason"], e["pin_action"]) == (owner, "response_owner", "none")
    assert [cand["id"] for cand in e["candidates"]] == [owner]
    unknown = {**chained, "previous_response_id": "resp_nobody"}
    r = httpx.post(c.url + "/admin/route/explain", json={"path": "/v1/responses", "body": unknown})
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    assert sum(len(e.raw) for e in c.engines.values()) == 1  # the dry runs reached no engine


def test_owner_draining_or_removed_is_a_409_never_another_engine(cluster: ClusterFactory) -> None:
    c = two(cluster)
    drained = httpx.post(c.url + "/v1/responses", json={**HEAD, "input": "one"}).json()["id"]
    owner = engine_of(c, drained)
    assert httpx.post(c.url + f"/admin/backends/{owner}/drain", timeout=10).status_code == 200
    r = httpx.get(c.url + f"/v1/responses/{drained}")
    assert r.status_code == 409 and "draining" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "response_id"
    assert httpx.delete(c.url + f"/admin/backends/{owner}", timeout=10).status_code == 200
    chained = {**HEAD, "input": "two", "previous_response_id": drained}
    gone = httpx.post(c.url + "/v1/responses", json=chained)
    assert gone.status_code == 409 and "has been removed" in gone.json()["error"]["message"]
    other = "b" if owner == "a" else "a"
    assert all("previous_response_id" not in body for body in c.engines[other].requests)
    assert c.in_flight() == 0


# -- the store: Redis shared, and Redis gone ----------------------------------------------------------------


@pytest.mark.anyio
async def test_owners_are_shared_through_redis_with_the_ttl_and_kept_locally_when_it_is_gone(
    redis_server: RedisServer, redis_prefix: str
) -> None:
    routing = RoutingConfig(response_owner_ttl_s=60)
    cfg = RedisConfig(url=redis_server.url, prefix=redis_prefix, timeout_s=2.0)
    one, two = (RedisAffinityStore(cfg, routing, ["a", "b"]) for _ in range(2))
    try:
        await one.own("resp_1", "b")
        assert await two.owner("resp_1") == "b"  # another replica's record
        assert await two.owner("resp_2") is None
        ttl_ms = await one.client.pttl(RedisKeys(redis_prefix).response_owner("resp_1"))
        assert 59_000 < ttl_ms <= 60_000
    finally:
        await one.aclose()
        await two.aclose()
    gone = RedisConfig(url=f"redis://127.0.0.1:{free_port()}", prefix=redis_prefix, timeout_s=0.5)
    alone = RedisAffinityStore(gone, routing, ["a", "b"])
    try:
        await alone.own("resp_3", "a")  # degrades, and keeps the record locally
        assert alone.status()["degraded"] is True
        assert await alone.owner("resp_3") == "a"
        settings = load_settings(None, backends=[{"id": "a", "url": "http://127.0.0.1:9", "models": ["m"]}])
        ownership = ResponseOwnership(alone, Registry(settings.backends))
        with pytest.raises(ServerBusy):  # not known here, and the shared record cannot be read
            await ownership.owner("resp_4", "previous_response_id")
    finally:
        await alone.aclose()
