"""Responses <-> chat, pure: the chat request a Responses request becomes, the response object of a chat
completion, and the numbered Responses events of a chat stream (however the engine cut it)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import BadRequest, UpstreamError
from gateway.translate import responses
from gateway.translate.common import Treatment

# -- request ------------------------------------------------------------------------------------------------


def test_a_codex_shaped_request_becomes_the_chat_request_asking_the_same() -> None:
    req = {
        "model": "m",
        "instructions": "You are Codex.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be terse"}]},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "look"},
                    {"type": "input_image", "image_url": "data:image/png;base64,QUJD", "detail": "low"},
                ],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hm"}],
                "encrypted_content": "xyz",
            },
            {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"cmd":["ls"]}'},
            {"type": "function_call", "call_id": "call_2", "name": "shell", "arguments": '{"cmd":["pwd"]}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "bin"},
            {"type": "function_call_output", "call_id": "call_2", "output": "/"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]},
            {"role": "user", "content": "thanks"},
        ],
        "tools": [
            {
                "type": "function",
                "name": "shell",
                "description": "run",
                "parameters": {"type": "object"},
                "strict": False,
            }
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "max_output_tokens": 1000,
        "reasoning": {"effort": "high", "summary": "auto"},
        "text": {
            "format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True},
            "verbosity": "low",
        },
        "stream": True,
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "session-1",
    }
    assert responses.request(req) == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "You are Codex."},
            {"role": "system", "content": "be terse"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {
                        "type": "image_url",
                        "image_url": {"url": "data:image/png;base64,QUJD", "detail": "low"},
                    },
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "hm",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "shell", "arguments": '{"cmd":["ls"]}'},
                    },
                    {
                        "id": "call_2",
                        "type": "function",
                        "function": {"name": "shell", "arguments": '{"cmd":["pwd"]}'},
                    },
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "bin"},
            {"role": "tool", "tool_call_id": "call_2", "content": "/"},
            {"role": "assistant", "content": "Done."},
            {"role": "user", "content": "thanks"},
        ],
        "parallel_tool_calls": True,
        "max_tokens": 1000,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "shell",
                    "description": "run",
                    "parameters": {"type": "object"},
                    "strict": False,
                },
            }
        ],
        "tool_choice": "auto",
        "reasoning_effort": "high",
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
        },
    }


def test_a_string_input_and_an_assistant_text_followed_by_a_call_share_one_message() -> None:
    assert responses.request({"model": "m", "input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]
    items = [
        {"role": "user", "content": "x"},
        {"type": "message", "role": "assistant", "content": "let me look"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "ok"}]},
    ]
    assert responses.request({"model": "m", "input": items})["messages"] == [
        {"role": "user", "content": "x"},
        {
            "role": "assistant",
            "content": "let me look",
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]


def test_tool_outputs_images_open_one_user_message_after_their_run_of_tool_messages() -> None:
    cat, dog = "data:image/png;base64,AAAA", "https://x.example/dog.png"
    items = [
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "d", "name": "f", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "c",
            "output": [{"type": "input_text", "text": "one"}, {"type": "input_image", "image_url": cat}],
        },
        {
            "type": "function_call_output",
            "call_id": "d",
            "output": [{"type": "input_image", "image_url": dog, "detail": "low"}],
        },
        {"role": "user", "content": "and?"},
    ]
    out = responses.request({"model": "m", "input": items})["messages"]
    assert out[2:] == [
        {"role": "tool", "tool_call_id": "c", "content": "one"},
        {"role": "tool", "tool_call_id": "d", "content": ""},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": cat}},
                {"type": "image_url", "image_url": {"url": dog, "detail": "low"}},
            ],
        },
        {"role": "user", "content": "and?"},
    ]
    last = responses.request({"model": "m", "input": items[:4]})["messages"]  # the output ends the input
    assert last[-1] == {"role": "user", "content": [{"type": "image_url", "image_url": {"url": cat}}]}
    file_part = {**items[3], "output": [{"type": "input_file", "file_id": "f1"}]}
    with pytest.raises(BadRequest) as caught:
        responses.request({"model": "m", "input": [*items[:3], file_part]})
    assert caught.value.param == "input[3].output[0].type"


def test_tool_choice_and_json_object() -> None:
    base = {"model": "m", "input": "x"}
    out = responses.request({**base, "tool_choice": {"type": "function", "name": "f"}})
    assert out["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert responses.request({**base, "text": {"format": {"type": "json_object"}}})["response_format"] == {
        "type": "json_object"
    }
    assert "response_format" not in responses.request({**base, "text": {"format": {"type": "text"}}})


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"background": True}, "background"),
        ({"prompt": {"id": "p"}}, "prompt"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {
                "tools": [
                    {"type": "function", "name": "f"},
                    {
                        "type": "custom",
                        "name": "g",
                        "format": {"type": "grammar", "syntax": "lark", "definition": "x"},
                    },
                ]
            },
            "tools[1].format",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice.type"),
        ({"input": 5}, "input"),
    ],
)
def test_what_cannot_be_translated_is_a_400_naming_the_client_s_field(
    change: dict[str, Any], param: str
) -> None:
    with pytest.raises(BadRequest) as err:
        responses.request({"model": "m", "input": "x", **change})
    assert err.value.param == param
    assert param in err.value.message


def test_store_false_and_harmless_fields_go_quietly_and_the_table_says_which() -> None:
    req = {
        "model": "m",
        "input": "x",
        "store": False,
        "background": False,
        "include": ["x"],
        "metadata": {"a": "b"},
        "prompt_cache_key": "k",
        "truncation": "auto",
        "user": "u",
        "safety_identifier": "s",
    }
    assert responses.request(req) == {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    refused = {e.field for e in responses.UNTRANSLATED if e.treatment is Treatment.REFUSED}
    assert {"previous_response_id", "store", "tools[].type"} <= refused
    dropped = {e.field for e in responses.UNTRANSLATED if e.treatment is Treatment.DROPPED}
    assert {"include", "prompt_cache_key", "reasoning.summary"} <= dropped


# -- whole answer -------------------------------------------------------------------------------------------

CHAT = {
    "id": "chatcmpl-9",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "reasoning_content": "think",
                "content": "Here.",
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}
                ],
            },
            "finish_reason": "tool_calls",
        }
    ],
    "usage": {
        "prompt_tokens": 100,
        "completion_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 64},
        "completion_tokens_details": {"reasoning_tokens": 3},
    },
}


def test_a_chat_completion_becomes_a_response_object() -> None:
    req = {
        "model": "m",
        "input": "x",
        "instructions": "be nice",
        "tools": [{"type": "function", "name": "ls"}],
    }
    out = responses.response(CHAT, req, created=5)
    assert out["output"] == [
        {
            "id": "rs_resp_chatcmpl-9",
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "think"}],
            "status": "completed",
        },
        {
            "id": "msg_resp_chatcmpl-9",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Here.", "annotations": [], "logprobs": []}],
        },
        {
            "id": "fc_call_1",
            "type": "function_call",
            "call_id": "call_1",
            "name": "ls",
            "arguments": "{}",
            "status": "completed",
        },
    ]
    assert out["usage"] == {
        "input_tokens": 100,
        "input_tokens_details": {"cached_tokens": 64, "cache_write_tokens": 0},
        "output_tokens": 7,
        "output_tokens_details": {"reasoning_tokens": 3},
        "total_tokens": 107,
    }
    assert (out["id"], out["object"], out["status"], out["created_at"]) == (
        "resp_chatcmpl-9",
        "response",
        "completed",
        5,
    )
    assert (out["instructions"], out["tools"], out["store"]) == ("be nice", req["tools"], False)


def test_a_length_stop_is_an_incomplete_response() -> None:
    doc = {"choices": [{"message": {"content": "ab"}, "finish_reason": "length"}]}
    out = responses.response(doc, {"model": "m"})
    assert (out["status"], out["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert out["usage"] is None  # not reported


# -- streamed answer ----------------------------------------------------------------------------------------


def events(raw: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for event in raw:
        head, data = event.decode().removesuffix("\n\n").split("\n")
        doc = json.loads(data.removeprefix("data: "))
        assert head == "event: " + doc["type"]
        out.append(doc)
    assert [d["sequence_number"] for d in out] == list(range(len(out)))  # numbered, from 0, no gap
    return out


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "c1", "model": "m", "choices": choices, **extra}


STREAM = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning": "plan"}),
    chunk({"content": "Lo"}),
    chunk({"content": "ok."}),
    chunk(
        {
            "tool_calls": [
                {"index": 0, "id": "call_a", "type": "function", "function": {"name": "ls", "arguments": ""}}
            ]
        }
    ),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"p":'}}]}),
    chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
    chunk({}, "tool_calls"),
    chunk(
        usage={"prompt_tokens": 50, "completion_tokens": 9, "prompt_tokens_details": {"cached_tokens": 32}}
    ),
]


def run(stream: list[dict[str, Any]], req: dict[str, Any] | None = None) -> list[bytes]:
    s = responses.ResponsesStream(req or {"model": "m"}, created=7)
    return [e for c in stream for e in s.chunk(c)] + s.finish()


def test_a_streamed_answer_with_reasoning_text_and_a_tool_call() -> None:
    out = events(run(STREAM))
    assert [(d["type"], d.get("output_index")) for d in out] == [
        ("response.created", None),
        ("response.in_progress", None),
        ("response.output_item.added", 0),
        ("response.content_part.added", 0),
        ("response.reasoning_text.delta", 0),
        ("response.reasoning_text.done", 0),
        ("response.content_part.done", 0),
        ("response.output_item.done", 0),
        ("response.output_item.added", 1),
        ("response.content_part.added", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.delta", 1),
        ("response.output_text.done", 1),
        ("response.content_part.done", 1),
        ("response.output_item.done", 1),
        ("response.output_item.added", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2),
        ("response.output_item.done", 2),
        ("response.completed", None),
    ]
    assert out[0]["response"]["status"] == "in_progress" and out[0]["response"]["output"] == []
    assert out[10] == {
        "type": "response.output_text.delta",
        "item_id": "msg_c1_1",
        "output_index": 1,
        "content_index": 0,
        "delta": "Lo",
        "logprobs": [],
        "sequence_number": 10,
    }
    assert out[12]["text"] == "Look."
    assert out[18] == {
        "type": "response.function_call_arguments.done",
        "item_id": "fc_call_a",
        "output_index": 2,
        "arguments": '{"p":1}',
        "name": "ls",
        "sequence_number": 18,
    }
    done = out[-1]["response"]
    assert done["status"] == "completed"
    assert [item["type"] for item in done["output"]] == ["reasoning", "message", "function_call"]
    assert done["output"] == [d["item"] for d in out if d["type"] == "response.output_item.done"]
    assert done["usage"]["input_tokens_details"] == {"cached_tokens": 32, "cache_write_tokens": 0}
    assert (done["usage"]["input_tokens"], done["usage"]["output_tokens"]) == (50, 9)


def test_a_length_stop_ends_with_response_incomplete() -> None:
    out = events(run([chunk({"content": "a"}), chunk({}, "length")]))
    assert out[-1]["type"] == "response.incomplete"
    assert out[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_an_error_mid_stream_is_an_upstream_error() -> None:
    s = responses.ResponsesStream({"model": "m"})
    s.chunk(chunk({"content": "a"}))
    with pytest.raises(UpstreamError, match="engine failed mid-stream: boom"):
        s.chunk({"error": {"message": "boom"}})


def _text(raw: list[bytes]) -> tuple[str, str, list[dict[str, Any]]]:
    docs = events(raw)
    text = "".join(d["delta"] for d in docs if d["type"] == "response.output_text.delta")
    args = "".join(d["delta"] for d in docs if d["type"] == "response.function_call_arguments.delta")
    return text, args, docs[-1]["response"]["output"]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=3), min_size=1, max_size=6))
def test_any_chunking_of_the_chat_stream_gives_the_same_response(sizes: list[int]) -> None:
    """Text and arguments cut into other fragments: the same text, arguments and final output items."""
    text, args = "Look, a fairly long answer.", '{"path": "/usr/local"}'
    stream, at, n = [chunk({"role": "assistant"})], 0, 0
    while at < len(text):
        stream.append(chunk({"content": text[at : at + sizes[n % len(sizes)]]}))
        at, n = at + sizes[n % len(sizes)], n + 1
    stream.append(
        chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "ls", "arguments": ""}}]})
    )
    at = 0
    while at < len(args):
        piece = args[at : at + sizes[n % len(sizes)]]
        stream.append(chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}))
        at, n = at + len(piece), n + 1
    stream.append(chunk({}, "tool_calls"))
    whole = [
        chunk({"content": text}),
        chunk({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "ls", "arguments": args}}]}),
        chunk({}, "tool_calls"),
    ]
    got, want = _text(run(stream)), _text(run(whole))
    assert got == want and got[:2] == (text, args)
