"""Whatever a client sends, a translator answers a chat request or a ``BadRequest`` naming a field (a 400 in
the route's shape), never another exception (which would be a 500); whatever an engine streams, the stream
translators give events or an ``UpstreamError``."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.errors import BadRequest, UpstreamError
from gateway.sse import Event
from gateway.translate import messages, responses
from gateway.translation import TRANSLATORS, _Stream

KINDS = st.sampled_from(
    [
        "text",
        "image",
        "tool_use",
        "tool_result",
        "thinking",
        "redacted_thinking",
        "message",
        "function_call",
        "function_call_output",
        "reasoning",
        "input_text",
        "output_text",
        "input_image",
        "base64",
        "url",
        "json_schema",
        "json_object",
        "enabled",
        "disabled",
        "adaptive",
        "function",
        "auto",
        "any",
        "tool",
        "none",
        "user",
        "assistant",
        "system",
        "developer",
    ]
)
NAMES = st.sampled_from(
    [
        "type",
        "role",
        "content",
        "text",
        "source",
        "id",
        "name",
        "input",
        "tool_use_id",
        "thinking",
        "media_type",
        "data",
        "url",
        "image_url",
        "call_id",
        "arguments",
        "output",
        "format",
        "schema",
        "effort",
        "budget_tokens",
        "description",
        "parameters",
        "input_schema",
        "tool_calls",
        "delta",
        "choices",
        "finish_reason",
        "index",
        "function",
        "usage",
        "reasoning_content",
        "prompt_tokens",
        "error",
    ]
)
VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2) | KINDS | st.text(max_size=3),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(NAMES, inner, max_size=5),
    max_leaves=16,
)
BLOCK = st.dictionaries(NAMES, VALUES, max_size=5) | st.fixed_dictionaries(
    {"type": KINDS},
    optional={
        n: VALUES
        for n in (
            "text",
            "source",
            "id",
            "name",
            "input",
            "tool_use_id",
            "content",
            "thinking",
            "image_url",
            "call_id",
            "arguments",
        )
    },
)
TURN = st.fixed_dictionaries(
    {"role": KINDS, "content": st.lists(BLOCK, max_size=4) | VALUES},
    optional={"type": KINDS, "call_id": VALUES, "name": VALUES, "arguments": VALUES, "output": VALUES},
)
FIELDS = ("tools", "tool_choice", "system", "instructions", "thinking", "output_config", "text", "reasoning")


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(TURN, max_size=4), st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=4))
def test_any_request_is_translated_or_refused_with_a_400(turns: list[Any], extra: dict[str, Any]) -> None:
    for translate, field in ((messages.request, "messages"), (responses.request, "input")):
        try:
            out = translate({"model": "m", field: turns, **extra})
        except BadRequest as err:
            assert err.param
        else:
            assert isinstance(out["messages"], list)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.dictionaries(NAMES, VALUES, max_size=4), max_size=6))
def test_any_engine_stream_gives_events_or_an_upstream_error(chunks: list[dict[str, Any]]) -> None:
    """Through the body filter: nothing but an ``UpstreamError`` (the client's shape's stream end) escapes."""
    for shape in ("messages", "responses"):
        f = _Stream(TRANSLATORS[shape].stream({"model": "m"}), "a")
        try:
            for chunk in chunks:
                out = f.events([Event(b"data: " + json.dumps(chunk).encode() + b"\n\n")])
                assert all(isinstance(p, Event) and p.raw.endswith(b"\n\n") for p in out)
            f.end()
        except UpstreamError:
            pass
