"""OpenAI wire format for the simulator: request validation in, response and SSE chunk bodies out."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from backends.sim.config import SimConfig
from backends.sim.engine import RequestUsage
from backends.sim.text import FinishReason, OutputPlan, OutputSpec, PieceKind
from backends.sim.tokens import TemplateError, render_chat, tokenize

REASONING_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"})


class Endpoint(StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"
    MESSAGES = "messages"
    RESPONSES = "responses"


class SimError(Exception):
    """An error answered in OpenAI's shape ``{"error": {"message", "type", "code", "param"}}``.

    ``anthropic_body`` renders the same error in Anthropic's shape, for ``/v1/messages``.
    """

    def __init__(
        self,
        status: int,
        message: str,
        code: str | int,
        kind: str = "invalid_request_error",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.kind = kind
        self.param = param

    def body(self) -> dict[str, Any]:
        error = {"message": self.message, "type": self.kind, "code": self.code, "param": self.param}
        return {"error": error}

    def anthropic_body(self) -> dict[str, Any]:
        kind = "api_error" if self.kind == "server_error" else self.kind
        return {"type": "error", "error": {"type": kind, "message": self.message}}


def bad_request(message: str, code: str = "invalid_value") -> SimError:
    return SimError(400, message, code)


@dataclass(frozen=True, slots=True)
class SimRequest:
    endpoint: Endpoint
    model: str
    prompt_text: str
    prompt_tokens: tuple[str, ...]
    stream: bool
    include_usage: bool
    spec: OutputSpec
    priority: int = 0  # vLLM's request field: lower is scheduled first under the priority policy
    #: A chat continuing its final assistant message: (the prompt before that message, its words).
    continues: tuple[str, tuple[str, ...]] | None = None


# -- request validation ------------------------------------------------------------------------------------


def optional_int(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"'{name}' must be an integer")
    if value < minimum:
        raise bad_request(f"'{name}' must be >= {minimum}, got {value}")
    return value


def optional_bool(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean")
    return value


def _thinking(body: Mapping[str, Any], cfg: SimConfig) -> bool:
    """An explicit off (``enable_thinking: false`` or ``reasoning_effort: "none"``) wins, then an explicit
    on, then the engine default (``--reasoning``)."""
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(f"'reasoning_effort' must be one of {sorted(REASONING_EFFORTS)}, got {effort!r}")
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, Mapping):
        raise bad_request("'chat_template_kwargs' must be an object")
    enable = optional_bool(kwargs, "enable_thinking")
    if enable is False or effort == "none":
        return False
    if enable or effort is not None:
        return True
    return cfg.reasoning


def optional_tools(body: Mapping[str, Any]) -> list[Any] | None:
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("'tools' must be a list")
    return tools


def chat_prompt(
    messages: Sequence[Any],
    body: Mapping[str, Any],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> str:
    """``messages`` rendered through the chat template with the body's ``tools``; a template error is the
    client's (400). Chat, Messages and Responses all reach the engine's prompt this way."""
    tools = optional_tools(body)
    try:
        return render_chat(
            messages,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
        )
    except TemplateError as exc:
        raise bad_request(str(exc)) from exc


def _prompt(body: Mapping[str, Any], endpoint: Endpoint) -> str:
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise bad_request("'messages' must be a list")
        add_generation_prompt = optional_bool(body, "add_generation_prompt")
        continue_final = optional_bool(body, "continue_final_message") or False
        return chat_prompt(
            messages,
            body,
            add_generation_prompt=True if add_generation_prompt is None else add_generation_prompt,
            continue_final_message=continue_final,
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return " ".join(f"<|t{t}|>" for t in prompt)
    raise bad_request("'prompt' must be a string, a list of token ids, or a list holding one of those")


def model_of(body: Mapping[str, Any], cfg: SimConfig) -> str:
    model = body.get("model", cfg.models[0])
    if model not in cfg.models:
        raise SimError(404, f"The model `{model}` does not exist.", "model_not_found", "not_found_error")
    return str(model)


def json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise bad_request(f"invalid JSON body: {exc}", "invalid_json") from exc
    if not isinstance(body, dict):
        raise bad_request("the JSON body must be an object", "invalid_json")
    return body


def context_tokens(prompt_text: str, max_tokens: int, cfg: SimConfig) -> tuple[str, ...]:
    """The prompt's tokens; 400 where they and ``max_tokens`` do not fit the model's context."""
    prompt_tokens = tuple(tokenize(prompt_text))
    if len(prompt_tokens) + max_tokens > cfg.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
            f"{len(prompt_tokens) + max_tokens} tokens ({len(prompt_tokens)} in the messages, "
            f"{max_tokens} in the completion).",
            "context_length_exceeded",
        )
    return prompt_tokens


def parse_request(raw: bytes, endpoint: Endpoint, cfg: SimConfig) -> SimRequest:
    body = json_object(raw)
    model = model_of(body, cfg)
    if (optional_int(body, "n", 1) or 1) > 1:
        raise bad_request("the simulator supports n=1 only")
    stream = optional_bool(body, "stream") or False
    options = body.get("stream_options") or {}
    if not isinstance(options, Mapping):
        raise bad_request("'stream_options' must be an object")
    include_usage = bool(stream and optional_bool(options, "include_usage"))
    prompt_text = _prompt(body, endpoint)
    max_tokens = optional_int(body, "max_completion_tokens", 1) or optional_int(body, "max_tokens", 1)
    max_tokens = max_tokens or cfg.default_max_tokens
    prompt_tokens = context_tokens(prompt_text, max_tokens, cfg)
    is_chat = endpoint is Endpoint.CHAT
    spec = OutputSpec(
        max_tokens=max_tokens,
        min_tokens=optional_int(body, "min_tokens", 0) or 0,
        ignore_eos=optional_bool(body, "ignore_eos") or False,
        thinking=is_chat and _thinking(body, cfg),
        thinking_budget=optional_int(body, "thinking_token_budget", 0),
        request_seed=optional_int(body, "seed", -(2**63)),
    )
    priority = _priority(body, cfg)
    continues = _continues(body) if is_chat else None
    return SimRequest(
        endpoint, model, prompt_text, prompt_tokens, stream, include_usage, spec, priority, continues
    )


def _continues(body: Mapping[str, Any]) -> tuple[str, tuple[str, ...]] | None:
    """For ``continue_final_message`` on an assistant message of plain text: the prompt the conversation
    before it renders to (with the generation prompt) and the message's words."""
    messages = body.get("messages")
    if not body.get("continue_final_message") or not isinstance(messages, list) or not messages:
        return None
    last = messages[-1]
    if (
        not isinstance(last, Mapping)
        or last.get("role") != "assistant"
        or not isinstance(last.get("content"), str)
    ):
        return None
    return chat_prompt(messages[:-1], body), tuple(last["content"].split())


def _priority(body: Mapping[str, Any], cfg: SimConfig) -> int:
    """The request's ``priority`` (any integer, 0 when absent); non-zero only under the priority policy."""
    priority = optional_int(body, "priority", -(2**63)) or 0
    if priority and cfg.scheduling_policy != "priority":
        raise bad_request(f"'priority' is {priority}, but this engine does not schedule by priority")
    return priority


# -- response bodies ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """Fields every body of one response repeats."""

    id: str
    created: int
    model: str
    endpoint: Endpoint

    @property
    def object(self) -> str:
        if self.endpoint is Endpoint.CHAT:
            return "chat.completion"
        return "text_completion"

    def envelope(self, *, chunk: bool = False) -> dict[str, Any]:
        obj = "chat.completion.chunk" if chunk and self.endpoint is Endpoint.CHAT else self.object
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def full_response(
    head: ResponseHead, plan: OutputPlan, usage: RequestUsage, thinking: bool
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": plan.finish_reason.value}
    if head.endpoint is Endpoint.CHAT:
        message: dict[str, Any] = {"role": "assistant", "content": plan.answer_text}
        if thinking:
            message["reasoning"] = message["reasoning_content"] = plan.reasoning_text
            if not plan.answer:
                message["content"] = None
        choice["message"] = message
    else:
        choice["text"] = plan.answer_text
    return {**head.envelope(), "choices": [choice], "usage": usage.as_openai()}


def role_chunk(head: ResponseHead) -> dict[str, Any]:
    """Chat streams open with the assistant role and empty content, as OpenAI and vLLM do."""
    choice = {
        "index": 0,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return {**head.envelope(chunk=True), "choices": [choice]}


def piece_chunk(head: ResponseHead, kind: PieceKind, text: str) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": None}
    if head.endpoint is Endpoint.COMPLETION:
        choice["text"] = text
    elif kind is PieceKind.REASONING:
        choice["delta"] = {"reasoning": text, "reasoning_content": text}
    else:
        choice["delta"] = {"content": text}
    return {**head.envelope(chunk=True), "choices": [choice]}


def finish_chunk(head: ResponseHead, finish_reason: FinishReason) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason.value}
    if head.endpoint is Endpoint.CHAT:
        choice["delta"] = {}
    else:
        choice["text"] = ""
    return {**head.envelope(chunk=True), "choices": [choice]}


def usage_chunk(head: ResponseHead, usage: RequestUsage) -> dict[str, Any]:
    return {**head.envelope(chunk=True), "choices": [], "usage": usage.as_openai()}


def sse(payload: Mapping[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
