"""Messages <-> chat, pure: the chat request a Messages request becomes, the Messages answer of a chat
completion, and the Anthropic events of a chat stream (however the engine cut it)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import BadRequest, UpstreamError
from gateway.translate import messages
from gateway.translate.common import Treatment

# -- request ------------------------------------------------------------------------------------------------


def test_a_claude_code_shaped_request_becomes_the_chat_request_asking_the_same() -> None:
    req = {
        "model": "m",
        "max_tokens": 4096,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=1;"},
            {"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "list /"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "use ls", "signature": "sig"},
                    {"type": "text", "text": "Listing."},
                    {"type": "tool_use", "id": "toolu_1", "name": "ls", "input": {"path": "/"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "bin"}],
                    },
                    {"type": "text", "text": "and now?"},
                ],
            },
        ],
        "tools": [
            {"name": "ls", "description": "list", "input_schema": {"type": "object"}, "cache_control": {}},
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "stop_sequences": ["END"],
        "stream": True,
        "metadata": {"user_id": "u"},
        "thinking": {"type": "enabled", "budget_tokens": 2048},
    }
    assert messages.request(req) == {
        "model": "m",
        "messages": [
            {
                "role": "system",
                "content": "x-anthropic-billing-header: cc_version=2.1; cch=1;\nYou are a coding agent.",
            },
            {"role": "user", "content": "list /"},
            {
                "role": "assistant",
                "content": "Listing.",
                "tool_calls": [
                    {
                        "id": "toolu_1",
                        "type": "function",
                        "function": {"name": "ls", "arguments": '{"path":"/"}'},
                    }
                ],
                "reasoning_content": "use ls",
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "bin"},  # before the user's text
            {"role": "user", "content": "and now?"},
        ],
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 40,
        "stop": ["END"],
        "max_tokens": 4096,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [
            {
                "type": "function",
                "function": {"name": "ls", "description": "list", "parameters": {"type": "object"}},
            }
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "thinking_budget": 2048,
    }


def test_images_become_image_url_parts() -> None:
    req = {
        "model": "m",
        "max_tokens": 10,
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": "QUJD"},
                    },
                    {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1/cat.png"}},
                    {"type": "text", "text": "what?"},
                ],
            }
        ],
    }
    assert messages.request(req)["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
                {"type": "image_url", "image_url": {"url": "http://127.0.0.1/cat.png"}},
                {"type": "text", "text": "what?"},
            ],
        }
    ]


@pytest.mark.parametrize(
    ("thinking", "config", "fields"),
    [
        ({"type": "disabled"}, None, {"thinking_budget": 0}),
        ({"type": "adaptive"}, {"effort": "high"}, {"reasoning_effort": "high"}),
        (None, {"effort": "max"}, {"reasoning_effort": "max"}),
        ({"type": "disabled"}, {"effort": "low"}, {"thinking_budget": 0}),  # off wins: no contradiction sent
        (None, None, {}),
    ],
)
def test_thinking_becomes_the_gateway_s_budget_fields(
    thinking: dict[str, Any] | None, config: dict[str, Any] | None, fields: dict[str, Any]
) -> None:
    req: dict[str, Any] = {"model": "m", "max_tokens": 9000, "messages": [{"role": "user", "content": "x"}]}
    if thinking is not None:
        req["thinking"] = thinking
    if config is not None:
        req["output_config"] = config
    out = messages.request(req)
    assert {k: out[k] for k in ("thinking_budget", "reasoning_effort") if k in out} == fields


def test_tool_choices_and_structured_output() -> None:
    base = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    tools = [{"name": "f", "input_schema": {"type": "object"}}]
    choices = {"auto": "auto", "none": "none", "tool": {"type": "function", "function": {"name": "f"}}}
    for kind, expected in choices.items():
        choice = {"type": kind, **({"name": "f"} if kind == "tool" else {})}
        assert messages.request({**base, "tools": tools, "tool_choice": choice})["tool_choice"] == expected
    assert "tool_choice" not in messages.request(base)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    out = messages.request({**base, "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert out["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"mcp_servers": [{"type": "url", "url": "http://127.0.0.1"}]}, "mcp_servers"),
        ({"container": "c1"}, "container"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "document", "source": {}}],
                            }
                        ],
                    }
                ]
            },
            "messages[0].content[0].content[0].type",
        ),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
            "messages[0].content[0].source.type",
        ),
        ({"system": [{"type": "image"}]}, "system[0]"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
        ({"messages": "hi"}, "messages"),
    ],
)
def test_what_cannot_be_translated_is_a_400_naming_the_client_s_field(
    change: dict[str, Any], param: str
) -> None:
    req = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], **change}
    with pytest.raises(BadRequest) as err:
        messages.request(req)
    assert err.value.param == param
    assert param in err.value.message


def test_harmless_fields_are_dropped_and_the_table_says_which() -> None:
    req = {
        "model": "m",
        "max_tokens": 5,
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}],
            }
        ],
        "cache_control": {"type": "ephemeral"},
        "metadata": {"user_id": "u"},
        "service_tier": "auto",
        "context_management": {"edits": []},
    }
    out = messages.request(req)
    assert out == {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 5}
    dropped = {e.field for e in messages.UNTRANSLATED if e.treatment is Treatment.DROPPED}
    assert {"cache_control", "metadata", "service_tier", "context_management"} <= dropped
    refused = {e.field for e in messages.UNTRANSLATED if e.treatment is Treatment.REFUSED}
    assert {"mcp_servers", "container", "tools[].type"} <= refused


# -- whole answer -------------------------------------------------------------------------------------------


def test_a_chat_completion_becomes_a_message_with_thinking_text_and_tool_use() -> None:
    chat = {
        "id": "chatcmpl-1",
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "reasoning": "think",
                    "content": "Here.",
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "ls", "arguments": '{"p": "/"}'},
                        },
                        {"id": "call_2", "type": "function", "function": {"name": "pwd", "arguments": ""}},
                    ],
                },
                "finish_reason": "tool_calls",
            }
        ],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": 7,
            "prompt_tokens_details": {"cached_tokens": 64},
        },
    }
    assert messages.response(chat, "m") == {
        "id": "msg_chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [
            {"type": "thinking", "thinking": "think", "signature": ""},
            {"type": "text", "text": "Here."},
            {"type": "tool_use", "id": "call_1", "name": "ls", "input": {"p": "/"}},
            {"type": "tool_use", "id": "call_2", "name": "pwd", "input": {}},
        ],
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 36,
            "output_tokens": 7,
            "cache_read_input_tokens": 64,
            "cache_creation_input_tokens": 0,
        },
    }


@pytest.mark.parametrize(
    ("choice", "stop"),
    [
        ({"finish_reason": "stop"}, ("end_turn", None)),
        ({"finish_reason": "length"}, ("max_tokens", None)),
        ({"finish_reason": "content_filter"}, ("refusal", None)),
        ({"finish_reason": "stop", "stop_reason": "END"}, ("stop_sequence", "END")),  # vLLM names the match
        (
            {"finish_reason": "stop", "stop_reason": 128001},
            ("end_turn", None),
        ),  # a stop token id: no sequence
    ],
)
def test_stop_reasons(choice: dict[str, Any], stop: tuple[str, str | None]) -> None:
    doc = {"choices": [{"message": {"content": "x"}, **choice}]}
    out = messages.response(doc, "m")
    assert (out["stop_reason"], out["stop_sequence"]) == stop
    assert out["usage"] == {
        "input_tokens": 0,
        "output_tokens": 0,
    }  # no usage reported: zeros, no cache fields
    assert out["content"] == [{"type": "text", "text": "x"}]


def test_reasoning_content_and_unparsable_arguments_are_kept() -> None:
    doc = {
        "choices": [
            {
                "message": {
                    "reasoning_content": "r",
                    "content": None,
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{not json"}}],
                },
                "finish_reason": "tool_calls",
            }
        ]
    }
    out = messages.response(doc, "m")
    assert out["content"] == [
        {"type": "thinking", "thinking": "r", "signature": ""},
        {"type": "tool_use", "id": "c", "name": "f", "input": {"arguments": "{not json"}},
    ]


# -- streamed answer ----------------------------------------------------------------------------------------


def events(raw: list[bytes]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for event in raw:
        head, data = event.decode().removesuffix("\n\n").split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        doc = json.loads(data.removeprefix("data: "))
        assert doc["type"] == head.removeprefix("event: ")  # the event name is its type, as Anthropic's
        out.append((doc["type"], doc))
    return out


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "c1", "model": "m", "choices": choices, **extra}


TOOL_STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning": "plan"}),
    chunk({"reasoning": " more"}),
    chunk({"content": "I will"}),
    chunk({"content": " look."}),
    chunk(
        {
            "tool_calls": [
                {"index": 0, "id": "call_a", "type": "function", "function": {"name": "ls", "arguments": ""}}
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"pa'}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'th":"/"}'}}]}),
    chunk({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "pwd", "arguments": "{}"}}]}),
    chunk({}, "tool_calls"),
    chunk(
        usage={"prompt_tokens": 50, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 32}}
    ),
]

TOOL_EVENTS = [
    (
        "message_start",
        {
            "type": "message_start",
            "message": {
                "id": "msg_c1",
                "type": "message",
                "role": "assistant",
                "model": "m",
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            },
        },
    ),
    (
        "content_block_start",
        {
            "type": "content_block_start",
            "index": 0,
            "content_block": {"type": "thinking", "thinking": "", "signature": ""},
        },
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "plan"}},
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": " more"}},
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 0}),
    (
        "content_block_start",
        {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "I will"}},
    ),
    (
        "content_block_delta",
        {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": " look."}},
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 1}),
    (
        "content_block_start",
        {
            "type": "content_block_start",
            "index": 2,
            "content_block": {"type": "tool_use", "id": "call_a", "name": "ls", "input": {}},
        },
    ),
    (
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": '{"pa'},
        },
    ),
    (
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": 2,
            "delta": {"type": "input_json_delta", "partial_json": 'th":"/"}'},
        },
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 2}),
    (
        "content_block_start",
        {
            "type": "content_block_start",
            "index": 3,
            "content_block": {"type": "tool_use", "id": "call_b", "name": "pwd", "input": {}},
        },
    ),
    (
        "content_block_delta",
        {
            "type": "content_block_delta",
            "index": 3,
            "delta": {"type": "input_json_delta", "partial_json": "{}"},
        },
    ),
    ("content_block_stop", {"type": "content_block_stop", "index": 3}),
    (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": {
                "input_tokens": 18,
                "output_tokens": 9,
                "cache_read_input_tokens": 32,
                "cache_creation_input_tokens": 0,
            },
        },
    ),
    ("message_stop", {"type": "message_stop"}),
]


def run(stream: list[dict[str, Any]]) -> list[bytes]:
    s = messages.MessagesStream("m")
    out = [e for c in stream for e in s.chunk(c)]
    return out + s.finish()


def test_a_streamed_answer_with_reasoning_text_and_two_tool_calls_split_across_chunks() -> None:
    assert events(run(TOOL_STREAM)) == TOOL_EVENTS


def test_finish_is_sent_once_and_an_empty_stream_still_ends_properly() -> None:
    s = messages.MessagesStream("m")
    first = events(s.finish())
    assert [name for name, _ in first] == ["message_start", "message_delta", "message_stop"]
    assert first[1][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert s.finish() == []


def test_a_usage_only_final_chunk_and_a_length_stop() -> None:
    stream = [
        chunk({"content": "ab"}),
        chunk({}, "length"),
        chunk(usage={"prompt_tokens": 3, "completion_tokens": 2}),
    ]
    out = events(run(stream))
    assert out[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
        "usage": {"input_tokens": 3, "output_tokens": 2},
    }


def test_an_error_mid_stream_is_an_upstream_error() -> None:
    s = messages.MessagesStream("m")
    s.chunk(chunk({"content": "a"}))
    with pytest.raises(UpstreamError, match="engine failed mid-stream: out of memory"):
        s.chunk({"error": {"message": "out of memory", "type": "InternalServerError"}})


def test_interleaved_parallel_tool_calls_cannot_be_blocks() -> None:
    s = messages.MessagesStream("m")
    s.chunk(chunk({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": "{"}}]}))
    s.chunk(chunk({"tool_calls": [{"index": 1, "id": "b", "function": {"name": "g", "arguments": "{"}}]}))
    with pytest.raises(UpstreamError, match="interleaved"):
        s.chunk(chunk({"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}))


def _resplit(stream: list[dict[str, Any]], cuts: list[int]) -> list[dict[str, Any]]:
    """The same answer cut elsewhere: every text, reasoning and argument fragment re-split at ``cuts``."""
    out: list[dict[str, Any]] = []
    for n, c in enumerate(stream):
        delta = c["choices"][0]["delta"] if c["choices"] else None
        for field in ("content", "reasoning"):
            if delta and isinstance(delta.get(field), str) and len(delta[field]) > 1:
                at = 1 + cuts[n % len(cuts)] % (len(delta[field]) - 1)
                out.append(chunk({field: delta[field][:at]}))
                out.append(chunk({field: delta[field][at:]}))
                break
        else:
            out.append(c)
    return out


def _merged(raw: list[bytes]) -> list[tuple[str, Any]]:
    """Events with consecutive deltas of one block merged: what a client puts together."""
    out: list[tuple[str, Any]] = []
    for name, doc in events(raw):
        if (
            name == "content_block_delta"
            and out
            and out[-1][0] == name
            and out[-1][1]["index"] == doc["index"]
        ):
            prev = out[-1][1]["delta"]
            for key in ("text", "thinking", "partial_json"):
                if key in prev:
                    prev[key] += doc["delta"][key]
            continue
        out.append((name, doc))
    return out


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=50), min_size=1, max_size=8))
def test_any_chunking_of_the_chat_stream_gives_the_same_message(cuts: list[int]) -> None:
    assert _merged(run(_resplit(TOOL_STREAM, cuts))) == _merged(run(TOOL_STREAM))


def test_a_tool_result_s_image_opens_the_user_message_after_the_tool_messages() -> None:
    png = {"type": "base64", "media_type": "image/png", "data": "QUJD"}
    turn = {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "t1",
                "content": [{"type": "text", "text": "screenshot taken"}, {"type": "image", "source": png}],
            },
            {"type": "text", "text": "what do you see?"},
        ],
    }
    assert messages.request({"model": "m", "max_tokens": 5, "messages": [turn]})["messages"] == [
        {"role": "tool", "tool_call_id": "t1", "content": "screenshot taken"},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
                {"type": "text", "text": "what do you see?"},
            ],
        },
    ]
