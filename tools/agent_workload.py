"""Coding-agent sessions, deterministic from a seed: the bodies Claude Code and Codex send, turn by turn.

Every session of one workload shares the agent's head: one long system prompt (instructions) and the same
tools, as many sessions of one agent do. Turn 1 adds the session's task (or, with ``shared_task``, the same
task for all: identical heads through the first user message, told apart only by their session ids); every
later turn carries the result of the tool the model called, after the model's reply, so the history grows.

- Claude Code on ``/v1/messages``: ``system`` as text blocks (with ``billing``, first a
  ``x-anthropic-billing-header: cc_version=…; cc_entrypoint=cli; cch=<nonce>;`` block, a new nonce on every
  request), ``metadata.user_id`` with the session part, the ``x-claude-code-session-id`` header; tool use as
  ``tool_use`` / ``tool_result`` blocks.
- Codex on ``/v1/responses``: the full ``input`` every turn, ``store: false``, ``prompt_cache_key`` and a
  ``session_id`` header; tool use as ``function_call`` / ``function_call_output`` items.
- An SDK-style chain on ``/v1/responses``: only the new input, ``previous_response_id``, ``store: true``.

Text is plain words, one simulator token each.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass
from typing import Any

VOCAB = (
    "the", "file", "function", "returns", "value", "error", "test", "module", "import", "class",
    "method", "call", "list", "string", "number", "path", "config", "request", "response", "server",
    "client", "cache", "token", "line", "change", "build", "run", "check", "fix", "update",
    "read", "write", "open", "close", "start", "stop", "wait", "send", "parse", "format",
)  # fmt: skip
TOOL_NAMES = ("Bash", "Read", "Edit", "Write", "Grep", "Glob", "TodoWrite", "WebFetch")
CC_VERSION = "2.1.37.a1b"
CLAUDE_SESSION_HEADER = "x-claude-code-session-id"
CODEX_SESSION_HEADER = "session_id"


@dataclass(frozen=True, slots=True)
class AgentSpec:
    sessions: int = 8
    turns: int = 5
    system_tokens: int = 2600
    tool_tokens: int = 50  # description words per tool
    task_tokens: int = 300
    result_tokens: int = 400  # each tool result, +-50 %
    max_tokens: int = 32
    pause_s: float = 1.0  # mean pause between turns (the agent runs a tool), uniform 0.5..1.5x
    shared_task: bool = False
    billing: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.sessions, self.turns, self.max_tokens) < 1:
            raise ValueError("sessions, turns and max_tokens must be >= 1")
        if min(self.system_tokens, self.task_tokens, self.result_tokens, self.tool_tokens) < 4:
            raise ValueError("system, tool, task and result tokens must be >= 4")
        if self.pause_s < 0:
            raise ValueError("pause_s must be >= 0")


@dataclass(frozen=True, slots=True)
class Head:
    """What every session of the workload shares."""

    system: str
    tools: tuple[tuple[str, str], ...]  # (name, description)


@dataclass(frozen=True, slots=True)
class AgentSession:
    index: int
    session_id: str
    task: str
    results: tuple[str, ...]  # results[k]: the tool output sent at turn k + 2
    pauses_s: tuple[float, ...]  # before each turn (0 before the first)
    nonces: tuple[str, ...]  # billing-block nonce per turn


def _words(rng: random.Random, tag: str, count: int) -> str:
    return " ".join([tag, *rng.choices(VOCAB, k=count - 1)])


def build(spec: AgentSpec, salt: str = "") -> tuple[Head, list[AgentSession]]:
    text = random.Random(f"agent-text:{spec.seed}:{salt}")
    shape = random.Random(f"agent-shape:{spec.seed}")
    head = Head(
        _words(text, f"[agent-system{salt}]", spec.system_tokens),
        tuple((name, _words(text, f"[{name}]", spec.tool_tokens)) for name in TOOL_NAMES),
    )
    shared = _words(text, f"[task{salt}]", spec.task_tokens)
    sessions = []
    for i in range(spec.sessions):
        task = shared if spec.shared_task else _words(text, f"[task-{i}{salt}]", spec.task_tokens)
        sizes = [max(4, round(spec.result_tokens * shape.uniform(0.5, 1.5))) for _ in range(spec.turns - 1)]
        results = tuple(_words(text, f"[result-{i}-{k}{salt}]", n) for k, n in enumerate(sizes))
        pauses = (0.0, *(spec.pause_s * shape.uniform(0.5, 1.5) for _ in range(spec.turns - 1)))
        nonces = tuple(f"{text.getrandbits(20):05x}" for _ in range(spec.turns))
        session_id = str(uuid.UUID(int=text.getrandbits(128), version=4))
        sessions.append(AgentSession(i, session_id, task, results, pauses, nonces))
    return head, sessions


def _call(session: AgentSession, turn: int) -> tuple[str, str, str]:
    """(call id, tool name, JSON arguments) of the tool call the agent made after ``turn`` (0-based)."""
    name = TOOL_NAMES[(session.index + turn) % len(TOOL_NAMES)]
    return f"call_{session.index}_{turn}", name, json.dumps({"command": f"step {turn}"})


# -- Claude Code on /v1/messages ----------------------------------------------------------------------------


def messages_request(
    spec: AgentSpec, head: Head, session: AgentSession, turn: int, replies: list[str], model: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """Turn ``turn`` (0-based) of a Claude Code session: (body, headers)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": session.task}]}]
    for k in range(turn):
        call_id, name, arguments = _call(session, k)
        messages.append({"role": "assistant", "content": [
            {"type": "text", "text": replies[k]},
            {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(arguments)},
        ]})  # fmt: skip
        result = {"type": "tool_result", "tool_use_id": call_id, "content": session.results[k]}
        messages.append({"role": "user", "content": [result]})
    system = [{"type": "text", "text": head.system}]
    if spec.billing:
        nonce = session.nonces[turn]
        block = f"x-anthropic-billing-header: cc_version={CC_VERSION}; cc_entrypoint=cli; cch={nonce};"
        system.insert(0, {"type": "text", "text": block})
    tools = [{"name": n, "description": d, "input_schema": {"type": "object", "properties": {}}}
             for n, d in head.tools]  # fmt: skip
    user_id = f"user_{spec.seed:064x}_account__session_{session.session_id}"
    body = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "system": system,
        "tools": tools,
        "messages": messages,
        "metadata": {"user_id": user_id},
    }
    return body, {CLAUDE_SESSION_HEADER: session.session_id, "anthropic-version": "2023-06-01"}


# -- Codex and SDK chains on /v1/responses ------------------------------------------------------------------


def _responses_tools(head: Head) -> list[dict[str, Any]]:
    schema = {"type": "object", "properties": {}}
    return [{"type": "function", "name": n, "description": d, "parameters": schema} for n, d in head.tools]


def _user_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


def codex_request(
    spec: AgentSpec, head: Head, session: AgentSession, turn: int, replies: list[str], model: str
) -> tuple[dict[str, Any], dict[str, str]]:
    """Turn ``turn`` of a Codex session: the full input, ``store: false``, ``prompt_cache_key``."""
    items = [_user_item(session.task)]
    for k in range(turn):
        call_id, name, arguments = _call(session, k)
        items += [
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": replies[k]}],
            },
            {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments},
            {"type": "function_call_output", "call_id": call_id, "output": session.results[k]},
        ]
    body = {
        "model": model,
        "instructions": head.system,
        "tools": _responses_tools(head),
        "input": items,
        "store": False,
        "stream": True,
        "prompt_cache_key": session.session_id,
        "max_output_tokens": spec.max_tokens,
    }
    return body, {CODEX_SESSION_HEADER: session.session_id}


def chain_request(
    spec: AgentSpec, head: Head, session: AgentSession, turn: int, previous_id: str | None, model: str
) -> dict[str, Any]:
    """Turn ``turn`` of an SDK-style chain: only the new input, after ``previous_response_id``."""
    text = session.task if turn == 0 else session.results[turn - 1]
    body: dict[str, Any] = {
        "model": model,
        "instructions": head.system,
        "tools": _responses_tools(head),
        "input": [_user_item(text)],
        "store": True,
        "stream": True,
        "max_output_tokens": spec.max_tokens,
    }
    if previous_id is not None:
        body["previous_response_id"] = previous_id
    return body
