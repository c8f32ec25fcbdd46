"""Responses ``custom`` tools through the chat translation: a free-form tool as a function taking one string,
its calls back as ``custom_tool_call`` items, whole and streamed (the openai SDK's own types read them)."""

from __future__ import annotations

import json
from typing import Any

from openai.types.responses import Response, ResponseCustomToolCall

from gateway.translate import custom_tools, responses

PATCH = {"type": "custom", "name": "apply_patch", "description": "apply a patch", "format": {"type": "text"}}
PATCH_TEXT = '*** Begin Patch\n*** Update File: a.py\n-x = "1"\n+x = "2"\n*** End Patch'


def test_a_free_form_custom_tool_goes_as_a_function_taking_one_string() -> None:
    chat = responses.request({"model": "m", "input": "fix it", "tools": [PATCH, {**PATCH, "name": "plain"}]})
    function = chat["tools"][0]["function"]
    assert chat["tools"][0]["type"] == "function"
    assert (function["name"], function["description"]) == ("apply_patch", "apply a patch")
    assert function["parameters"]["required"] == ["input"]
    assert function["parameters"]["properties"]["input"]["type"] == "string"
    no_format = responses.request({"model": "m", "input": "x", "tools": [{"type": "custom", "name": "t"}]})
    assert no_format["tools"][0]["function"]["name"] == "t"


def test_a_named_custom_tool_choice_is_that_function() -> None:
    chat = responses.request(
        {
            "model": "m",
            "input": "x",
            "tools": [PATCH],
            "tool_choice": {"type": "custom", "name": "apply_patch"},
        }
    )
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}


def test_custom_calls_and_their_outputs_in_the_input_become_tool_calls_and_tool_messages() -> None:
    items: list[Any] = [
        {"role": "user", "content": "fix it"},
        {"type": "custom_tool_call", "call_id": "c1", "name": "apply_patch", "input": PATCH_TEXT},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
    ]
    chat = responses.request({"model": "m", "input": items, "tools": [PATCH]})
    call = chat["messages"][1]["tool_calls"][0]
    assert call["id"] == "c1" and call["function"]["name"] == "apply_patch"
    assert json.loads(call["function"]["arguments"]) == {"input": PATCH_TEXT}
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "Done!"}


def _completion(arguments: str, name: str = "apply_patch") -> dict[str, Any]:
    call = {"id": "c9", "type": "function", "function": {"name": name, "arguments": arguments}}
    message = {"role": "assistant", "content": None, "tool_calls": [call]}
    return {
        "id": "x",
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls"}],
    }


def test_a_call_of_a_custom_tool_answers_as_a_custom_tool_call_with_its_input_decoded() -> None:
    req = {"model": "m", "input": "fix it", "tools": [PATCH, {"type": "function", "name": "ls"}]}
    resp = responses.response(_completion(custom_tools.encode(PATCH_TEXT)), req, created=1)
    (item,) = resp["output"]
    parsed = ResponseCustomToolCall.model_validate(item)
    assert (parsed.call_id, parsed.name, parsed.input) == ("c9", "apply_patch", PATCH_TEXT)
    Response.model_validate(resp)
    assert (
        responses.response(_completion('{"p": 1}', "ls"), req, created=1)["output"][0]["type"]
        == "function_call"
    )


def test_arguments_that_are_not_the_shim_object_pass_as_the_input() -> None:
    assert custom_tools.decode("just text") == "just text"
    assert custom_tools.decode('{"other": 1}') == '{"other": 1}'
    assert custom_tools.decode(custom_tools.encode('é\n"q"')) == 'é\n"q"'


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "c1", "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_a_streamed_custom_call_sends_its_decoded_input_as_the_sdk_reads_it() -> None:
    arguments = custom_tools.encode(PATCH_TEXT)
    head = {"index": 0, "id": "c9", "type": "function", "function": {"name": "apply_patch", "arguments": ""}}
    stream = [_chunk({"tool_calls": [head]})]
    stream += [_chunk({"tool_calls": [{"index": 0, "function": {"arguments": arguments[i : i + 7]}}]})
               for i in range(0, len(arguments), 7)]  # fmt: skip
    stream.append(_chunk({}, "tool_calls"))
    s = responses.ResponsesStream({"model": "m", "input": "x", "tools": [PATCH]}, created=1)
    raw = [e for c in stream for e in s.chunk(c)] + s.finish()
    out = [json.loads(e.split(b"data: ", 1)[1]) for e in raw]
    kinds = [d["type"] for d in out]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.custom_tool_call_input.delta",
        "response.custom_tool_call_input.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert "".join(d["delta"] for d in out if d["type"].endswith("input.delta")) == PATCH_TEXT
    assert out[4]["input"] == PATCH_TEXT and out[2]["item"]["type"] == "custom_tool_call"
    final = Response.model_validate(out[-1]["response"])
    assert isinstance(final.output[0], ResponseCustomToolCall) and final.output[0].input == PATCH_TEXT
