"""The request body parser: a top-level key sent twice is refused however it is spelled, whether the object is
parsed whole (the common body) or member by member, and both nest exactly as deep."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import inbound
from gateway.errors import BadRequest

# Spellings of a few keys, escaped ones included: the same key may come back spelled another way.
KEYS = ['"model"', '"m\\u006fdel"', '"messages"', '"a/b"', '"a\\/b"', '"q\\"k"', '""', '"x"']
KEYS += ['"\\u00e9"', '"é"', '"user"', '"role"']
VALUES = ['"m"', "1", '"model"', '"x"', '""', "[]", '{"model": 1}', '"\\u00e9"', "null", '"a/b"', '"user"']
VALUES += ['[{"role": "user"}]', '["user", "model"]', '{"user" : "model" }', '"\\"user"', '{"\\"user": 1}']


def reference(text: str) -> dict[str, Any] | str:
    """json.loads, a top-level key sent twice as the error it gives (nested objects may repeat keys)."""
    seen: list[list[str]] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen.append([k for k, _ in items])
        return dict(items)

    doc = json.loads(text, object_pairs_hook=pairs)
    keys = seen[-1]  # the top level is the last object built
    twice = [k for i, k in enumerate(keys) if k in keys[:i]]
    return f"duplicate {twice[0]!a}" if twice else doc


def parsed(text: str) -> dict[str, Any] | str:
    try:
        return inbound.parse_object(text.encode())
    except BadRequest as err:
        assert err.message.startswith("duplicate key "), err.message
        return "duplicate " + err.message.split()[2]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KEYS), st.sampled_from(VALUES)), min_size=1, max_size=6))
def test_a_body_parses_as_json_and_a_key_sent_twice_is_refused_however_spelled(
    members: list[tuple[str, str]],
) -> None:
    text = "{" + ", ".join(f"{k}: {v}" for k, v in members) + "}"
    assert parsed(text) == reference(text)


def test_a_plain_body_is_parsed_whole_and_an_unclear_one_member_by_member() -> None:
    for whole in (
        '{"model": "m", "messages": [{"role": "user", "content": "a\\nb"}], "stream": true}',
        '{"model": "m", "messages": [{"role": "user", "content": "user"}], "user": "u1"}',  # "user" as values
    ):
        assert inbound._whole_object(whole) == json.loads(whole)
    for unclear in (
        '{"model": "m", "x": "\\u00e9"}',  # an escape that could spell a key
        '{"model": "m", "x": {"model": 1}}',  # the key's spelling twice as a key (once nested)
        '{"model": "m", "x": "model" }',  # once as a value, but spaced
        '{"a/b": 1}',  # a key with a slash (``\\/`` spells it too)
    ):
        assert inbound._whole_object(unclear) is None
        assert inbound.parse_object(unclear.encode()) == json.loads(unclear)


def _deepest(make: Any) -> int:
    lo, hi = 1, 5000  # lo parses, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            inbound.parse_object(make(mid))
            lo = mid
        except BadRequest:
            hi = mid
    return lo


def test_parsed_whole_a_body_nests_as_deep_as_member_by_member(monkeypatch: pytest.MonkeyPatch) -> None:
    def tools(d: int) -> bytes:
        return b'{"model": "m", "tools": [' + b"[" * d + b"]" * d + b"]}"

    def nested(d: int) -> bytes:
        return b'{"model": "m", "x": ' + b'{"a": ' * d + b"1" + b"}" * d + b"}"

    assert inbound._whole_object(tools(3).decode()) is not None
    edges = [_deepest(tools), _deepest(nested)]
    monkeypatch.setattr(inbound, "_WHOLE_AT", -1)  # member by member only
    assert [_deepest(tools), _deepest(nested)] == edges
