"""Engine dialects: everything the gateway knows per engine kind, one ``EngineDialect`` entry per ``Dialect``.

A new dialect is its ``Dialect`` value in config/settings.py plus one entry in ``DIALECTS`` below. The
consumers read the entry of the backend an attempt goes to: thinking-budget spelling (gateway/budgets.py),
continuation arguments (gateway/continuation.py), embeds part format (gateway/vision.py), ``/metrics`` names
(backends/engine_metrics.py), reasoning output fields (gateway/reasoning.py). This module imports only config
and the standard library, so backends/ and gateway/ both read it without a circle.

Facts, read from each engine's own source unless marked:
- vLLM: budget ``thinking_token_budget`` (top level; its Messages route maps ``thinking.budget_tokens`` to
  it); ``chat_template_kwargs.enable_thinking: false`` turns thinking off; ``reasoning_effort``
  none|minimal|low|medium|high|xhigh|max. Reasoning output in ``reasoning`` (older releases
  ``reasoning_content``). Continuation: ``continue_final_message: true``, ``add_generation_prompt: false``.
  Accepts ``image_embeds`` parts (``--enable-mm-embeds``). Serves chat, completions, ``/v1/messages`` and
  ``/v1/responses`` (measured on vLLM 0.32).
- SGLang: budget ``custom_params: {"thinking_budget": N}`` (its ThinkingBudgetLogitProcessor, with
  ``--enable-custom-logit-processor`` or ``--enable-strict-thinking``); ``reasoning_effort`` none|low|medium|
  high. Output ``reasoning_content`` (its ChatMessage/DeltaMessage). Continuation:
  ``continue_final_message`` (a ChatCompletionRequest field; it has no ``add_generation_prompt`` field). No
  ``image_embeds``. Serves chat, completions and ``/v1/messages`` (entrypoints/anthropic); its
  ``/v1/responses`` is left out here (see below). Its Messages route accepts ``thinking.budget_tokens`` but
  does not enforce it (it logs so; request_conversion.py): only thinking on/off reaches the engine there.
- llama.cpp server: budget ``thinking_budget_tokens`` in newer builds, ``reasoning_budget_tokens`` in others:
  both are sent, each build reads its own; ``reasoning_effort: "none"`` disables thinking. Output
  ``reasoning_content``. Continuation: none needed: a trailing assistant message is continued as a prefill
  by default (``--no-prefill-assistant`` turns that off); it does not read ``continue_final_message``. No
  ``image_embeds``. Serves chat, completions, ``/v1/messages`` (``thinking.budget_tokens`` there becomes
  ``thinking_budget_tokens``; ``disabled`` and ``adaptive`` are ignored: server-common.cpp
  ``convert_anthropic_to_oai``); ``/v1/responses`` only in newer builds, so it is not counted as native.
- openai (a generic OpenAI-compatible server, or OpenAI): no native budget cap (the gateway enforces it) and
  OpenAI's efforts. What the server is remains unknown, so it is read the widest way: every engine's
  ``/metrics`` names and reasoning fields. It keeps vLLM's continuation arguments and embeds format (the
  common server behind this dialect, and what ``vision: embeds`` asserts). Serves chat, completions,
  responses (documented: OpenAI's API).

Native shapes are what every build one meets serves: translating a shape to chat works everywhere, while
sending it to a build that lacks it is a 404.

Claude Code's billing block (``x-anthropic-billing-header: …`` as the first system block, a new nonce each
request): vLLM 0.32 drops it before templating, on ``/v1/messages`` (entrypoints/anthropic/serving.py:
top-level ``system`` blocks and inline system messages) and on chat (renderers/chat_utils.py: the first line
of a ``system`` message's text parts; not of ``developer`` messages). SGLang's Anthropic request conversion
keeps every system text block; llama.cpp keeps it (its issue #20623). So the gateway strips it for every
dialect but vLLM (``drops_billing_block``), unless a backend says otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from enum import StrEnum
from types import MappingProxyType
from typing import Any, Protocol

from config.settings import Dialect

_GATEWAY_FIELDS = ("thinking_budget",)


class ShapeName(StrEnum):
    """The client API shapes; an engine serves some natively, the others are translated to chat."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    MESSAGES = "messages"
    RESPONSES = "responses"


class ThinkingAsk(Protocol):
    """What a budget spelling reads from a request's resolved thinking (gateway/budgets.py ``Thinking``)."""

    @property
    def budget(self) -> int | None: ...

    @property
    def off(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class BudgetSpelling:
    """How an engine spells a thinking budget.

    ``shape`` works on the attempt's top-level copy of the body (``Draft.edit()``): it replaces values, never
    mutates nested ones (``chat_template_kwargs`` is rebuilt, not updated).
    """

    efforts: frozenset[str]  # ``reasoning_effort`` values the engine accepts; others are dropped
    budget_fields: tuple[str, ...]  # top-level fields that carry a native budget
    custom_params_budget: bool = False  # SGLang: the budget goes inside ``custom_params``
    off_by_effort: bool = False  # llama.cpp: "off" is ``reasoning_effort: "none"``

    @property
    def native(self) -> bool:
        """The engine caps thinking itself; otherwise the gateway enforces the budget (``auto``)."""
        return bool(self.budget_fields) or self.custom_params_budget

    def shape(self, body: dict[str, Any], thinking: ThinkingAsk, *, native: bool) -> None:
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


@dataclass(frozen=True, slots=True)
class SignalNames:
    """The ``/metrics`` series an engine publishes for each routing signal; per signal, first found wins."""

    waiting: tuple[str, ...] = ()
    running: tuple[str, ...] = ()
    kv_usage: tuple[str, ...] = ()  # 0..1
    prefix_queries: tuple[str, ...] = ()  # counters (tokens)
    prefix_hits: tuple[str, ...] = ()
    prefix_hit_rate: tuple[str, ...] = ()  # a ratio the engine computes itself (a gauge)
    spec_accepted: tuple[str, ...] = ()  # counters (tokens)
    spec_draft: tuple[str, ...] = ()
    spec_accept_length: tuple[str, ...] = ()  # mean accepted length (a gauge)
    #: An info gauge whose ``num_gpu_blocks`` and ``block_size`` labels give the KV cache size (tokens).
    kv_capacity: tuple[str, ...] = ()

    def all(self) -> frozenset[str]:
        return frozenset(name for f in fields(self) for name in getattr(self, f.name))

    @staticmethod
    def merged(*each: SignalNames) -> SignalNames:
        """Every name of ``each``, per signal, in order."""
        names = {f.name: sum((getattr(s, f.name) for s in each), ()) for f in fields(SignalNames)}
        return SignalNames(**names)


@dataclass(frozen=True, slots=True)
class EmbedsFormat:
    """How an ``image_embeds`` content part is spelled (base64 of ``torch.save`` tensors, no ``data:``)."""

    part_type: str = "image_embeds"
    embeds_field: str = "image_embeds"
    grid_field: str = "image_grid_thw"

    def part(self, embeds: str, grid: str) -> dict[str, Any]:
        return {"type": self.part_type, self.part_type: {self.embeds_field: embeds, self.grid_field: grid}}


@dataclass(frozen=True, slots=True)
class EngineDialect:
    budget: BudgetSpelling
    reasoning_fields: tuple[str, ...]  # where the engine writes reasoning output, in the order read
    continuation: Mapping[str, Any]  # top-level fields that make phase 2 continue the assistant turn
    metrics: SignalNames
    embeds: EmbedsFormat | None  # None: the engine takes no ``image_embeds`` parts (``vision: native``)
    native_shapes: frozenset[ShapeName]
    #: The shapes on whose endpoint the engine itself drops Claude Code's billing block (a system text block
    #: starting ``x-anthropic-billing-header``) before templating; elsewhere the gateway strips it.
    drops_billing_block: frozenset[ShapeName] = frozenset()
    #: Shapes whose own thinking field the engine caps on its native route (Anthropic's
    #: ``thinking.budget_tokens`` on ``/v1/messages``); elsewhere the gateway would have to enforce it.
    capped_shapes: frozenset[ShapeName] = frozenset()


_VLLM_SIGNALS = SignalNames(
    waiting=("vllm:num_requests_waiting",),
    running=("vllm:num_requests_running",),
    kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    prefix_queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total",
                    "vllm:gpu_prefix_cache_queries"),
    prefix_hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total",
                 "vllm:gpu_prefix_cache_hits"),
    spec_accepted=("vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens"),
    spec_draft=("vllm:spec_decode_num_draft_tokens_total", "vllm:spec_decode_num_draft_tokens"),
    kv_capacity=("vllm:cache_config_info",),
)  # fmt: skip
_SGLANG_SIGNALS = SignalNames(
    waiting=("sglang:num_queue_reqs",),
    running=("sglang:num_running_reqs",),
    kv_usage=("sglang:token_usage",),
    prefix_hit_rate=("sglang:cache_hit_rate",),
    spec_accept_length=("sglang:spec_accept_length",),
)
_LLAMACPP_SIGNALS = SignalNames(
    waiting=("llamacpp:requests_deferred",),
    running=("llamacpp:requests_processing",),
    kv_usage=("llamacpp:kv_cache_usage_ratio",),  # gone from newer builds
)

_VLLM_CONTINUATION = MappingProxyType({"continue_final_message": True, "add_generation_prompt": False})
_OPENAI_EFFORTS = frozenset({"none", "minimal", "low", "medium", "high"})
_CHAT_AND_COMPLETIONS = frozenset({ShapeName.CHAT, ShapeName.COMPLETIONS})

DIALECTS: Mapping[Dialect, EngineDialect] = MappingProxyType({
    Dialect.VLLM: EngineDialect(
        budget=BudgetSpelling(
            efforts=frozenset({"none", "minimal", "low", "medium", "high", "xhigh", "max"}),
            budget_fields=("thinking_token_budget",),
        ),
        reasoning_fields=("reasoning", "reasoning_content"),
        continuation=_VLLM_CONTINUATION,
        metrics=_VLLM_SIGNALS,
        embeds=EmbedsFormat(),
        native_shapes=_CHAT_AND_COMPLETIONS | {ShapeName.MESSAGES, ShapeName.RESPONSES},
        drops_billing_block=frozenset({ShapeName.MESSAGES, ShapeName.CHAT}),
        capped_shapes=frozenset({ShapeName.MESSAGES}),
    ),
    Dialect.SGLANG: EngineDialect(
        budget=BudgetSpelling(
            efforts=frozenset({"none", "low", "medium", "high"}), budget_fields=(), custom_params_budget=True
        ),
        reasoning_fields=("reasoning_content",),
        continuation=MappingProxyType({"continue_final_message": True}),
        metrics=_SGLANG_SIGNALS,
        embeds=None,
        native_shapes=_CHAT_AND_COMPLETIONS | {ShapeName.MESSAGES},
    ),
    Dialect.LLAMACPP: EngineDialect(
        budget=BudgetSpelling(
            efforts=frozenset({"none", "low", "medium", "high"}),
            budget_fields=("thinking_budget_tokens", "reasoning_budget_tokens"),
            off_by_effort=True,
        ),
        reasoning_fields=("reasoning_content",),
        continuation=MappingProxyType({}),
        metrics=_LLAMACPP_SIGNALS,
        embeds=None,
        native_shapes=_CHAT_AND_COMPLETIONS | {ShapeName.MESSAGES},
        capped_shapes=frozenset({ShapeName.MESSAGES}),
    ),
    Dialect.OPENAI: EngineDialect(
        budget=BudgetSpelling(efforts=_OPENAI_EFFORTS, budget_fields=()),
        reasoning_fields=("reasoning", "reasoning_content"),
        continuation=_VLLM_CONTINUATION,
        metrics=SignalNames.merged(_VLLM_SIGNALS, _SGLANG_SIGNALS, _LLAMACPP_SIGNALS),
        embeds=EmbedsFormat(),
        native_shapes=_CHAT_AND_COMPLETIONS | {ShapeName.RESPONSES},
    ),
})  # fmt: skip

# What the reasoning relay reads in any reply: every dialect's fields, in table order. It reads them all, not
# only the backend's own: a misconfigured or upgraded engine still has its reasoning found.
REASONING_FIELDS = tuple(dict.fromkeys(f for d in DIALECTS.values() for f in d.reasoning_fields))
