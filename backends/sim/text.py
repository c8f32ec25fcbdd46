"""Deterministic output: what a request will generate, decided before it runs.

Everything derives from a hash of (engine seed, request ``seed``, prompt): the same prompt on the same engine
gives the same words, lengths and finish reason. Words come from a small fixed vocabulary, one token each.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import StrEnum

VOCAB = (
    "the", "cache", "prefix", "engine", "token", "route", "warm", "block", "stream", "model",
    "batch", "queue", "decode", "prefill", "answer", "state", "node", "river", "stone", "light",
    "quick", "brown", "green", "small", "large", "bright", "quiet", "steady", "simple", "clear",
    "runs", "holds", "keeps", "moves", "reads", "finds", "turns", "waits", "sends", "grows",
    "and", "with", "from", "into", "over", "under", "near", "after", "before", "while",
)  # fmt: skip
THINK_VOCAB = (
    "hmm", "first", "consider", "maybe", "so", "then", "check", "wait", "because", "therefore",
    "step", "idea", "option", "assume", "compare", "recall", "verify", "count", "list", "plan",
)  # fmt: skip
REPEAT_WORD = "duct"


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"


class PieceKind(StrEnum):
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """What the request asks for, already validated."""

    max_tokens: int
    min_tokens: int = 0
    ignore_eos: bool = False
    thinking: bool = False
    thinking_budget: int | None = None
    request_seed: int | None = None


@dataclass(frozen=True, slots=True)
class OutputPlan:
    reasoning: tuple[str, ...]
    answer: tuple[str, ...]
    finish_reason: FinishReason
    continued: bool = False  # it continues an answer already begun: its first word carries its space too

    def __len__(self) -> int:
        return len(self.reasoning) + len(self.answer)

    def pieces(self) -> Iterator[tuple[PieceKind, str]]:
        """(kind, text) per token; text carries the joining space, as real engines' deltas do."""
        for kind, words in ((PieceKind.REASONING, self.reasoning), (PieceKind.CONTENT, self.answer)):
            for index, word in enumerate(words):
                yield kind, word if index == 0 and not self.continued else f" {word}"

    @property
    def reasoning_text(self) -> str:
        return " ".join(self.reasoning)

    @property
    def answer_text(self) -> str:
        return " ".join(self.answer)


def _rng(prompt: str, seed: int, request_seed: int | None) -> random.Random:
    digest = hashlib.blake2b(f"{seed}\x00{request_seed}\x00".encode(), digest_size=16)
    digest.update(prompt.encode())
    return random.Random(int.from_bytes(digest.digest(), "big"))


def plan_output(
    prompt: str,
    spec: OutputSpec,
    *,
    seed: int,
    answer_tokens: tuple[int, int],
    reasoning_tokens: tuple[int, int],
    repeat_token: bool = False,
) -> OutputPlan:
    """Reasoning first (cut at the thinking budget), then the answer; both count against ``max_tokens``."""
    if repeat_token:
        return OutputPlan((), (REPEAT_WORD,) * spec.max_tokens, FinishReason.LENGTH)
    rng = _rng(prompt, seed, spec.request_seed)
    n_reasoning = rng.randint(*reasoning_tokens) if spec.thinking else 0
    if spec.thinking_budget is not None:
        n_reasoning = min(n_reasoning, spec.thinking_budget)
    n_answer = max(rng.randint(*answer_tokens), spec.min_tokens - n_reasoning)
    finish = FinishReason.STOP
    if spec.ignore_eos or n_reasoning + n_answer > spec.max_tokens:
        finish = FinishReason.LENGTH
        n_reasoning = min(n_reasoning, spec.max_tokens)
        n_answer = spec.max_tokens - n_reasoning
    reasoning = tuple(rng.choice(THINK_VOCAB) for _ in range(n_reasoning))
    answer = tuple(rng.choice(VOCAB) for _ in range(n_answer))
    return OutputPlan(reasoning, answer, finish)


def continue_plan(
    prompt: str,
    prefix: tuple[str, ...],
    spec: OutputSpec,
    *,
    seed: int,
    answer_tokens: tuple[int, int],
    reasoning_tokens: tuple[int, int],
) -> OutputPlan | None:
    """Greedy decoding's continuation of an assistant message: when ``prefix`` (its words) begins the answer
    ``prompt`` (the conversation before it) would get, the rest of that answer; else None. So a stream cut
    and continued gives the words one uninterrupted run would have given."""
    whole = replace(spec, max_tokens=spec.max_tokens + len(prefix))
    plan = plan_output(
        prompt, whole, seed=seed, answer_tokens=answer_tokens, reasoning_tokens=reasoning_tokens
    )
    if plan.reasoning or plan.answer[: len(prefix)] != prefix:
        return None
    return OutputPlan((), plan.answer[len(prefix) :], plan.finish_reason, continued=bool(prefix))
