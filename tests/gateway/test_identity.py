"""Session identity: sources in order, subagents, bounds; and through a gateway, pins per identity, the bytes
engines get, the counts of what keyed each request."""

from __future__ import annotations

import json
import logging
from collections import Counter
from typing import Any

import httpx
import pytest
from test_metrics import counts

from config.settings import RoutingConfig
from gateway.errors import BadRequest
from gateway.identity import Identity, SessionIdentity
from gateway.inbound import first_values
from gateway.state import MemoryAffinityStore
from routing.keys import chat_key, session_key, subagent_key

from clusters import ClusterFactory

SID = "0b5e2a6c-6b0f-4e52-9d55-1f0c3a9e7d21"
USER_ID = f"user_{'f' * 64}_account_5d1e0c7a-0000-4000-8000-000000000001_session_{SID}"
HEAD = [
    {"role": "system", "content": "You are a coding agent. " * 20},
    {"role": "user", "content": "Fix it."},
]
KEYED = "warmroute_session_keyed_requests_total"


def identity(**routing: Any) -> SessionIdentity:
    return SessionIdentity.from_config(RoutingConfig(**routing))


def h(**headers: str) -> list[tuple[bytes, bytes]]:
    return [(k.replace("_", "-").lower().encode(), v.encode()) for k, v in headers.items()]


def test_the_first_source_present_wins_in_the_default_order() -> None:
    ids = identity()
    headers = [
        (b"x-claude-code-session-id", b"claude"),
        (b"session_id", b"codex"),
        (b"session-id", b"codex2"),
        (b"x-session-affinity", b"opencode"),
        (b"x-session-id", b"legacy"),
    ]
    body = {"prompt_cache_key": "pck", "metadata": {"user_id": USER_ID}}
    expected = [
        ("claude", "header:x-claude-code-session-id"),
        ("codex", "header:session_id"),
        ("codex2", "header:session-id"),
        ("opencode", "header:x-session-affinity"),
        ("legacy", None),  # routing.session_header: keyed as before
    ]
    for i, (value, source) in enumerate(expected):
        got = ids.identify(first_values(headers[i:]), body, "m")
        label = source or "header:x-session-id"
        assert got == (session_key("m", value, source), Identity(label))
    assert ids.identify(first_values([]), body, "m") == (
        session_key("m", "pck", "body:prompt_cache_key"),
        Identity("body:prompt_cache_key"),
    )
    assert ids.identify(first_values([]), {"metadata": {"user_id": USER_ID}}, "m") == (
        session_key("m", SID, "body-session:metadata.user_id"),
        Identity("body-session:metadata.user_id"),
    )
    assert ids.identify(first_values([]), {"messages": []}, "m") is None


def test_todays_session_header_keys_as_it_always_did_and_a_changed_one_still_works() -> None:
    assert identity().identify(first_values(h(x_session_id="sid-1")), None, "m") == (
        "cbc20790ac828bc957486435accc0d36",  # session_key("m", "sid-1") before sources existed
        Identity("header:x-session-id"),
    )
    moved = identity(session_header="X-Conversation")
    assert moved.identify(first_values(h(x_conversation="sid-1")), None, "m") == (
        session_key("m", "sid-1"),
        Identity("header:x-conversation"),
    )
    assert (
        moved.identify(first_values(h(x_session_id="sid-1")), None, "m") is None
    )  # the old name is just a header now


def test_a_json_user_id_gives_its_session_and_one_without_a_session_is_no_identity() -> None:
    ids = identity()
    doc = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": SID})
    got = ids.identify(first_values([]), {"metadata": {"user_id": doc}}, "m")
    assert got is not None and got[0] == session_key("m", SID, "body-session:metadata.user_id")
    for user_id in (f"user_{'f' * 64}", json.dumps({"device_id": "d"}), {"session_id": SID}, 7):
        assert ids.identify(first_values([]), {"metadata": {"user_id": user_id}}, "m") is None


def test_body_values_that_are_not_strings_or_empty_are_absent() -> None:
    ids = identity()
    for value in (None, "", 5, ["a"], {"a": 1}):
        assert (
            ids.identify(first_values([(b"x-claude-code-session-id", b"")]), {"prompt_cache_key": value}, "m")
            is None
        )


def test_a_subagent_gets_its_own_key_within_its_session() -> None:
    ids = identity()
    session = session_key("m", SID, "header:x-claude-code-session-id")
    main = ids.identify(first_values(h(x_claude_code_session_id=SID)), None, "m")
    sub = [(b"x-claude-code-session-id", SID.encode()), (b"x-claude-code-agent-id", b"agent-1"),
           (b"x-claude-code-parent-agent-id", b"main")]  # fmt: skip
    assert main == (session, Identity("header:x-claude-code-session-id"))
    assert ids.identify(first_values(sub), None, "m") == (
        subagent_key(session, "agent-1"),
        Identity("header:x-claude-code-session-id", subagent=True),
    )
    other = [*sub[:1], (b"x-claude-code-agent-id", b"agent-2")]
    assert ids.identify(first_values(other), None, "m") != ids.identify(first_values(sub), None, "m")
    # No session: the agent id alone names nothing (the head keys it); no subagent header: no split.
    assert ids.identify(first_values(sub[1:]), None, "m") is None
    assert identity(subagent_header=None).identify(first_values(sub), None, "m") == main


def test_configured_sources_replace_the_defaults_and_an_empty_list_keys_by_head() -> None:
    ids = identity(session_sources=["body:metadata.conversation", "header:x-team-session"])
    assert ids.labels == ("body:metadata.conversation", "header:x-team-session")
    headers = [(b"x-claude-code-session-id", b"c"), (b"x-team-session", b"t")]
    assert ids.identify(first_values(headers), {}, "m") == (session_key("m", "t", "header:x-team-session"),
                                               Identity("header:x-team-session"))  # fmt: skip
    got = ids.identify(first_values(headers), {"metadata": {"conversation": "conv"}}, "m")
    assert got is not None and got[1] == Identity("body:metadata.conversation")
    assert (
        identity(session_sources=[]).identify(first_values(headers), {"prompt_cache_key": "p"}, "m") is None
    )


@pytest.mark.parametrize(
    ("headers", "body", "param", "why"),
    [
        (h(x_claude_code_session_id="s" * 257), None, "header:x-claude-code-session-id",
         "is longer than 256 characters"),
        ([(b"session_id", b"a\tb")], None, "header:session_id", "holds \\u0009"),
        ([], {"prompt_cache_key": "a\x00b"}, "body:prompt_cache_key", "holds \\u0000"),
        ([], {"prompt_cache_key": "a\ud800"}, "body:prompt_cache_key", "holds \\ud800"),
        ([], {"metadata": {"user_id": f"user_x_session_{'s' * 300}"}}, "body-session:metadata.user_id",
         "is longer than 256 characters"),
        (h(x_session_id="ok", x_claude_code_agent_id="\x01"), None, "header:x-claude-code-agent-id",
         "holds \\u0001"),
    ],
)  # fmt: skip
def test_a_value_too_long_or_with_control_characters_is_a_400_naming_its_source(
    caplog: pytest.LogCaptureFixture, headers: list[tuple[bytes, bytes]], body: Any, param: str, why: str
) -> None:
    caplog.set_level(logging.INFO, "warmroute.identity")
    with pytest.raises(BadRequest) as exc:
        identity().identify(first_values(headers), body, "m")
    assert exc.value.param == param
    assert exc.value.message.startswith(f"session identity from {param} {why}")
    assert [r.getMessage() for r in caplog.records] == [f"rejected a request: {exc.value.message}"]


# -- through a gateway --------------------------------------------------------------------------------


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> httpx.Response:
    raw = json.dumps(body).encode()
    r = httpx.post(url + "/v1/chat/completions", content=raw, headers=headers or {})
    assert r.status_code == 200, r.text
    return r


def test_identical_heads_with_distinct_sessions_spread_evenly_on_their_first_turn(
    cluster: ClusterFactory,
) -> None:
    c = cluster(["a", "b", "c", "d"])
    body = {"model": "m", "messages": HEAD}
    placed = {
        f"s{i}": post(c.url, body, {"x-claude-code-session-id": f"s{i}"}).headers["x-warmroute-backend"]
        for i in range(16)
    }
    assert sorted(Counter(placed.values()).values()) == [4, 4, 4, 4]
    follow = {"model": "m", "messages": [*HEAD, {"role": "assistant", "content": "ok"}, {"role": "user",
              "content": "next"}]}  # fmt: skip
    for sid, backend in placed.items():
        r = post(c.url, follow, {"x-claude-code-session-id": sid})
        assert (r.headers["x-warmroute-backend"], r.headers["x-warmroute-route"]) == (backend, "affinity_hit")
    store = c.gateway.store
    assert isinstance(store, MemoryAffinityStore)
    for sid, backend in placed.items():
        assert store.table.get(session_key("m", sid, "header:x-claude-code-session-id"), 0.0) == backend
    assert store.table.get(chat_key(body), 0.0) is None  # the head itself was never pinned
    assert counts(c, KEYED) == {("session", "header:x-claude-code-session-id"): 32}


def test_each_source_pins_its_own_conversation_and_the_engine_gets_the_clients_bytes(
    cluster: ClusterFactory,
) -> None:
    c = cluster(["a", "b"])
    bodies = [
        ({"model": "m", "messages": HEAD, "prompt_cache_key": "codex-1"}, {}),
        ({"model": "m", "messages": HEAD, "metadata": {"user_id": USER_ID}}, {}),
        ({"model": "m", "messages": HEAD}, {"session_id": "codex-2"}),
        ({"model": "m", "messages": HEAD}, {"x-session-affinity": "opencode-1"}),
        ({"model": "m", "messages": HEAD}, {"X-Session-Id": "legacy-1"}),
        ({"model": "m", "messages": HEAD}, {}),
    ]
    for body, headers in bodies:
        raw = json.dumps(body, indent=1).encode()  # not our serialisation: what arrives must be these bytes
        r = httpx.post(c.url + "/v1/chat/completions", content=raw, headers=headers)
        assert r.status_code == 200, r.text
        assert c.engines[r.headers["x-warmroute-backend"]].raw[-1] == raw
    store = c.gateway.store
    assert isinstance(store, MemoryAffinityStore)
    pinned = {
        session_key("m", "codex-1", "body:prompt_cache_key"),
        session_key("m", SID, "body-session:metadata.user_id"),
        session_key("m", "codex-2", "header:session_id"),
        session_key("m", "opencode-1", "header:x-session-affinity"),
        session_key("m", "legacy-1"),
        chat_key({"model": "m", "messages": HEAD}),
    }
    assert all(store.table.get(k, 0.0) is not None for k in pinned)
    assert counts(c, KEYED) == {
        ("session", "body:prompt_cache_key"): 1,
        ("session", "body-session:metadata.user_id"): 1,
        ("session", "header:session_id"): 1,
        ("session", "header:x-session-affinity"): 1,
        ("session", "header:x-session-id"): 1,
        ("session", "head"): 1,
    }


def test_a_subagent_is_pinned_apart_from_its_session_and_counted_as_one(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"])
    main = {"x-claude-code-session-id": SID}
    sub = {**main, "x-claude-code-agent-id": "agent-7", "x-claude-code-parent-agent-id": "main"}
    first = post(c.url, {"model": "m", "messages": HEAD}, main).headers["x-warmroute-backend"]
    other = post(c.url, {"model": "m", "messages": HEAD}, sub).headers["x-warmroute-backend"]
    assert first != other  # a second conversation: the least loaded engine
    for _ in range(2):
        assert post(c.url, {"model": "m", "messages": HEAD}, sub).headers["x-warmroute-backend"] == other
    store = c.gateway.store
    assert isinstance(store, MemoryAffinityStore)
    session = session_key("m", SID, "header:x-claude-code-session-id")
    assert store.table.get(session, 0.0) == first
    assert store.table.get(subagent_key(session, "agent-7"), 0.0) == other
    assert counts(c, KEYED) == {
        ("session", "header:x-claude-code-session-id"): 1,
        ("subagent", "header:x-claude-code-session-id"): 3,
    }


def test_a_body_source_keys_completions_too(cluster: ClusterFactory) -> None:
    c = cluster(["a", "b"])
    body = {"model": "m", "prompt": "same prompt", "prompt_cache_key": "p-1"}
    r = httpx.post(c.url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    store = c.gateway.store
    assert isinstance(store, MemoryAffinityStore)
    key = session_key("m", "p-1", "body:prompt_cache_key")
    assert store.table.get(key, 0.0) == r.headers["x-warmroute-backend"]
