"""Session sources: their spellings, the session part of a Claude Code user id, what a value may be."""

from __future__ import annotations

import json

import pytest

from config.settings import DEFAULT_SESSION_SOURCES, ConfigError, load_settings
from routing.sessions import (
    MAX_JSON_USER_ID,
    MAX_VALUE_CHARS,
    SessionSource,
    SourceKind,
    body_value,
    parse_source,
    parse_sources,
    problem,
    user_id_session,
)

SESSION = "7b3f5a52-1c1e-4d7a-9b0e-2f8f8a6c9d11"


def test_each_spelling_parses_to_its_source_with_its_spelling_as_label() -> None:
    assert parse_source("header:X-Claude-Code-Session-Id", "x-session-id") == SessionSource(
        SourceKind.HEADER, "x-claude-code-session-id", "header:x-claude-code-session-id"
    )
    assert parse_source("body:prompt_cache_key", "x") == SessionSource(
        SourceKind.BODY, "prompt_cache_key", "body:prompt_cache_key"
    )
    source = parse_source("body-session:metadata.user_id", "x")
    assert (source.kind, source.path, source.label) == (
        SourceKind.BODY_SESSION,
        ("metadata", "user_id"),
        "body-session:metadata.user_id",
    )


def test_session_header_stands_for_the_configured_header_and_keeps_its_legacy_keys() -> None:
    assert parse_source("session_header", "X-My-Session") == SessionSource(
        SourceKind.HEADER, "x-my-session", "header:x-my-session", legacy=True
    )


@pytest.mark.parametrize("spec", ["cookie:sid", "header:", "body:a..b", "nothing", "body:.a"])
def test_an_unknown_spelling_is_a_value_error(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_source(spec, "x-session-id")


def test_the_defaults_in_order_and_a_source_named_twice_counts_where_it_first_comes() -> None:
    labels = [s.label for s in parse_sources(DEFAULT_SESSION_SOURCES, "x-session-id")]
    assert labels == [
        "header:x-claude-code-session-id",
        "header:session_id",
        "header:session-id",
        "header:x-session-affinity",
        "header:x-session-id",
        "body:prompt_cache_key",
        "body-session:metadata.user_id",
    ]
    twice = parse_sources(DEFAULT_SESSION_SOURCES, "X-Session-Affinity")  # the header is listed before
    assert [s.label for s in twice].count("header:x-session-affinity") == 1
    assert not next(s for s in twice if s.label == "header:x-session-affinity").legacy


def test_settings_refuse_an_unknown_source_and_accept_an_empty_list() -> None:
    backends = [{"id": "a", "url": "http://127.0.0.1:1", "models": ["m"]}]
    with pytest.raises(ConfigError, match="unknown session source"):
        load_settings(None, backends=backends, routing={"session_sources": ["cookie:sid"]})
    empty = load_settings(None, backends=backends, routing={"session_sources": []})
    assert empty.routing.session_sources == ()
    with pytest.raises(ConfigError, match="not an HTTP header name"):
        load_settings(None, backends=backends, routing={"subagent_header": "bad header"})


@pytest.mark.parametrize(
    ("user_id", "session"),
    [
        (f"user_{'a' * 64}_account_0c6f-uuid_session_{SESSION}", SESSION),
        (f"user_{'a' * 64}_account__session_{SESSION}", SESSION),  # no account (an API key login)
        (json.dumps({"device_id": "d" * 64, "account_uuid": "u", "session_id": SESSION}), SESSION),
        (" " + json.dumps({"session_id": SESSION}) + " ", SESSION),
        (f"user_{'a' * 64}", None),  # a user, no session: not an identity
        ("user_x_session_", None),
        (json.dumps({"device_id": "d"}), None),
        (json.dumps({"session_id": 7}), None),
        (json.dumps({"session_id": ""}), None),
        ('{"session_id": "unterminated', None),
        ("[" * 3000 + "]" * 3000, None),  # JSON-ish, not an object
        ("{" + '"a":[' * 2000 + "]" * 2000 + "}", None),  # too deep to bother: over the length bound
        ("", None),
    ],
)
def test_the_session_part_of_a_user_id_in_each_known_form_and_none_otherwise(
    user_id: str, session: str | None
) -> None:
    assert user_id_session(user_id) == session


def test_a_json_user_id_nested_past_the_parsers_depth_is_no_error() -> None:
    deep = '{"a":' + "[" * 2000 + "]" * 2000 + "}"  # under the length bound, past the recursion limit
    assert len(deep) <= MAX_JSON_USER_ID
    with pytest.raises(RecursionError):
        json.loads(deep)
    assert user_id_session(deep) is None


def test_body_value_follows_the_path_through_objects_only() -> None:
    body = {"metadata": {"user_id": "u"}, "list": [1]}
    assert body_value(body, ("metadata", "user_id")) == "u"
    assert body_value(body, ("metadata", "missing")) is None
    assert body_value(body, ("list", "0")) is None
    assert body_value(body, ("metadata", "user_id", "deeper")) is None


def test_a_value_is_bounded_and_free_of_control_characters() -> None:
    assert problem("s" * MAX_VALUE_CHARS) is None
    assert problem("s" * (MAX_VALUE_CHARS + 1)) == f"is longer than {MAX_VALUE_CHARS} characters"
    assert problem("a\tb") == "holds \\u0009 (no control characters or lone surrogates)"
    assert problem("a\x00") == "holds \\u0000 (no control characters or lone surrogates)"
    assert problem("a\x7f") == "holds \\u007f (no control characters or lone surrogates)"
    assert problem("a\x85") == "holds \\u0085 (no control characters or lone surrogates)"
    assert problem("a\ud800") == "holds \\ud800 (no control characters or lone surrogates)"
    assert problem("sessión-é-😀") is None
