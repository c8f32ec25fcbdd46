"""A multi-turn agent workload, deterministic from a seed, with token counts known in advance.

Shape (the defaults mimic a coding agent):

- a few long **system prompts** (tool definitions), each shared by many conversations;
- turn 1 of each conversation carries the task and its attached context (``context_tokens``);
- every later turn adds a tool result (about ``user_tokens``) after the model's previous reply, so the history
  grows and a follow-up re-reads only a few hundred new tokens *if* it lands where its prefix is cached;
- a few **hot** conversations run ``hot_turn_factor`` times as many turns with no pause between them.

Text is made of plain words separated by spaces, so the simulator counts one token per word (a real
tokenizer gives a little more). ``salt`` changes every word but no count: the same shape with different
text, for engines whose prefix cache cannot be reset between runs.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

_WORDS = (
    "the", "file", "function", "returns", "value", "error", "test", "module", "import", "class",
    "method", "call", "list", "string", "number", "path", "config", "request", "response", "server",
    "client", "cache", "token", "line", "change", "build", "run", "check", "fix", "update",
    "read", "write", "open", "close", "start", "stop", "wait", "send", "parse", "format",
    "data", "table", "index", "query", "result", "output", "input", "option", "default", "field",
    "and", "with", "from", "into", "over", "under", "after", "before", "while", "when",
    "green", "blue", "quiet", "steady", "simple", "clear", "small", "large", "quick", "slow",
    "river", "stone", "light", "node", "engine", "route", "block", "stream", "batch", "queue",
)  # fmt: skip
SYSTEM_PROMPTS = 3
HOT_TURN_FACTOR = 2


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    conversations: int = 60
    turns: int = 6
    system_tokens: int = 1500
    context_tokens: int = 2500
    user_tokens: int = 200
    max_tokens: int = 48
    hot_fraction: float = 0.1
    hot_turn_factor: int = HOT_TURN_FACTOR
    think_ms: float = 300.0
    system_prompts: int = SYSTEM_PROMPTS
    seed: int = 0
    #: > 0: identical heads. Conversation i is in group i mod ceil(conversations / group_size); a group
    #: shares its system prompt *and* its first user message (best-of-N, parallel rollouts of one task).
    group_size: int = 0

    def __post_init__(self) -> None:
        if self.conversations < 1 or self.turns < 1 or self.system_prompts < 1:
            raise ValueError("conversations, turns and system_prompts must be >= 1")
        if min(self.system_tokens, self.context_tokens, self.user_tokens) < 4 or self.max_tokens < 1:
            raise ValueError("system/context/user tokens must be >= 4 and max_tokens >= 1")
        if self.group_size < 0:
            raise ValueError("group_size must be >= 0")
        if not 0 <= self.hot_fraction <= 1 or self.hot_turn_factor < 1 or self.think_ms < 0:
            raise ValueError("hot_fraction must be in [0, 1], hot_turn_factor >= 1, think_ms >= 0")


@dataclass(frozen=True, slots=True)
class Conversation:
    index: int
    system: str
    user_turns: tuple[str, ...]  # user_turns[0] is the task with its context; later ones are tool results
    pauses_s: tuple[float, ...]  # think time before each turn (0 before the first)
    hot: bool

    def messages(self, turn: int, replies: list[str]) -> list[dict[str, Any]]:
        """The request body's messages for ``turn`` (0-based), given the replies to the earlier turns."""
        out: list[dict[str, Any]] = [{"role": "system", "content": self.system}]
        for k in range(turn + 1):
            out.append({"role": "user", "content": self.user_turns[k]})
            if k < turn:
                out.append({"role": "assistant", "content": replies[k]})
        return out


def _words(rng: random.Random, tag: str, count: int) -> str:
    """``count`` whitespace-separated words (one simulator token each), the first being ``tag``."""
    return " ".join([tag, *rng.choices(_WORDS, k=count - 1)])


def _around(rng: random.Random, mean: int) -> int:
    """A size uniformly within +-50 % of ``mean`` (at least 4)."""
    return max(4, round(mean * rng.uniform(0.5, 1.5)))


def build(spec: WorkloadSpec, salt: str = "") -> list[Conversation]:
    shape = random.Random(f"shape:{spec.seed}")  # sizes, hot picks and pauses: independent of the salt
    text = random.Random(f"text:{spec.seed}:{salt}")
    systems = [
        _words(text, f"[system-{i}{salt}]", spec.system_tokens) for i in range(min(spec.system_prompts, 64))
    ]
    hot_count = round(spec.hot_fraction * spec.conversations)
    if spec.hot_fraction > 0 and hot_count == 0:
        hot_count = 1
    hot = set(shape.sample(range(spec.conversations), hot_count))
    groups = -(-spec.conversations // spec.group_size) if spec.group_size else 0
    tasks = [_words(text, f"[g{g}-t1{salt}]", _around(shape, spec.context_tokens)) for g in range(groups)]
    conversations = []
    for i in range(spec.conversations):
        is_hot = i in hot
        turns = spec.turns * (spec.hot_turn_factor if is_hot else 1)
        sizes = [_around(shape, spec.context_tokens)] + [
            _around(shape, spec.user_tokens) for _ in range(turns - 1)
        ]
        pauses = [0.0] + [
            0.0 if is_hot else shape.uniform(0, 2 * spec.think_ms) / 1000 for _ in range(turns - 1)
        ]
        user = [_words(text, f"[c{i}-t{k + 1}{salt}]", n) for k, n in enumerate(sizes)]
        system = systems[i % len(systems)]
        if groups:
            user[0], system = tasks[i % groups], systems[(i % groups) % len(systems)]
        conversations.append(Conversation(i, system, tuple(user), tuple(pauses), is_hot))
    return conversations


def total_requests(conversations: list[Conversation]) -> int:
    return sum(len(c.user_turns) for c in conversations)
