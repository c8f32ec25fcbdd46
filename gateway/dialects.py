"""How each engine dialect spells a thinking budget, one small table entry per dialect.

Every ``shape`` works on the attempt's top-level copy of the body (``Draft.edit()``): it replaces values,
never mutates nested ones (``chat_template_kwargs`` is rebuilt, not updated).

Facts (read from each engine's own source; the user-facing table is docs/thinking-budgets.md):
- vLLM: ``thinking_token_budget`` (top level); ``chat_template_kwargs.enable_thinking: false`` turns thinking
  off; ``reasoning_effort`` accepts none|minimal|low|medium|high|xhigh|max.
- SGLang: ``custom_params: {"thinking_budget": N}`` (read by its ThinkingBudgetLogitProcessor; the server runs
  with ``--enable-custom-logit-processor`` or ``--enable-strict-thinking``); ``reasoning_effort`` none|low|
  medium|high (``none`` sets ``enable_thinking: false`` itself).
- llama.cpp server: ``thinking_budget_tokens`` in newer builds, ``reasoning_budget_tokens`` in others: both
  are sent, each build reads its own; ``reasoning_effort: "none"`` disables thinking.
- openai: no native cap; the gateway enforces it (gateway/continuation.py) and forwards OpenAI's efforts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from config.settings import Dialect
from gateway.thinking import Thinking

_GATEWAY_FIELDS = ("thinking_budget",)


@dataclass(frozen=True, slots=True)
class DialectSpec:
    efforts: frozenset[str]  # ``reasoning_effort`` values the engine accepts; others are dropped
    budget_fields: tuple[str, ...]  # top-level fields that carry a native budget
    custom_params_budget: bool = False  # SGLang: the budget goes inside ``custom_params``
    off_by_effort: bool = False  # llama.cpp: "off" is ``reasoning_effort: "none"``

    def shape(self, body: dict[str, Any], thinking: Thinking, *, native: bool) -> None:
        for name in _GATEWAY_FIELDS:
            body.pop(name, None)
        effort = body.get("reasoning_effort")
        if effort is not None and effort not in self.efforts:
            del body["reasoning_effort"]
        if thinking.off:
            self._off(body)
        elif native and thinking.budget is not None:
            self._cap(body, thinking.budget)

    def _off(self, body: dict[str, Any]) -> None:
        kwargs = body.get("chat_template_kwargs")
        body["chat_template_kwargs"] = {
            **(kwargs if isinstance(kwargs, dict) else {}),
            "enable_thinking": False,
        }
        if self.off_by_effort:
            body["reasoning_effort"] = "none"

    def _cap(self, body: dict[str, Any], budget: int) -> None:
        for name in self.budget_fields:
            body[name] = budget
        if self.custom_params_budget:
            params = body.get("custom_params")
            body["custom_params"] = {
                **(params if isinstance(params, dict) else {}),
                "thinking_budget": budget,
            }


_OPENAI_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high"})

DIALECTS: dict[Dialect, DialectSpec] = {
    Dialect.VLLM: DialectSpec(
        efforts=frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"}),
        budget_fields=("thinking_token_budget",),
    ),
    Dialect.SGLANG: DialectSpec(
        efforts=frozenset({"none", "low", "medium", "high"}), budget_fields=(), custom_params_budget=True
    ),
    Dialect.LLAMACPP: DialectSpec(
        efforts=frozenset({"none", "low", "medium", "high"}),
        budget_fields=("thinking_budget_tokens", "reasoning_budget_tokens"),
        off_by_effort=True,
    ),
    Dialect.OPENAI: DialectSpec(efforts=_OPENAI_EFFORTS, budget_fields=()),
}
