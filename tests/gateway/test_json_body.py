"""The request body parser: a top-level key sent twice is refused however it is spelled."""

from __future__ import annotations

import json
from typing import Any

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
