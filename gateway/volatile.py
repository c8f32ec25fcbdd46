"""Volatile system text stripped from what an engine is sent, per backend (a prepare step).

An engine that keeps Claude Code's billing block in the prompt (a new nonce each request, as the first system
block) misses its prefix cache from token 0 on every turn. ``VolatileStrip`` removes the blocks
``routing.volatile_prefixes`` names from the attempt's ``Draft`` — never the inbound body, so a retry on
another engine starts from the client's bytes — where the backend wants it (``strip_volatile``; None: unless
its dialect drops the billing block itself on that shape, ``EngineDialect.drops_billing_block``; other
volatile prefixes are stripped even then). Nothing
volatile found, or nothing to strip for that backend: the client's bytes go on untouched.

It keys on the body's structure, not on a route: a top-level ``system`` (a string or blocks) is an Anthropic
Messages body, and its leading system messages are read the same way; otherwise the leading
system/developer messages of ``messages`` are a chat body's system text. So a body translated to chat before
this step runs is stripped as the chat body it has become.
"""

from __future__ import annotations

from typing import Any

from backends.dialects import DIALECTS, ShapeName
from backends.registry import Backend
from gateway.context import Draft, RequestContext
from gateway.identity import KeyingMetrics
from routing.volatile import BILLING_PREFIX, NO_RULES, SYSTEM_ROLES, VolatileRules

_ENGINE_DROPS = (BILLING_PREFIX,)


class VolatileStrip:
    """The prepare step (gateway/phases.py ``PrepareStep``)."""

    def __init__(self, rules: VolatileRules, metrics: KeyingMetrics | None = None) -> None:
        self.rules = rules
        self.metrics = metrics

    def rules_for(self, backend: Backend, shape: ShapeName) -> VolatileRules:
        """What to strip for ``backend`` from a body of ``shape``."""
        strip = backend.cfg.strip_volatile
        if strip is False:
            return NO_RULES
        if strip is None and shape in DIALECTS[backend.cfg.dialect].drops_billing_block:
            return self.rules.without(_ENGINE_DROPS)
        return self.rules

    def _may_hold(self, ctx: RequestContext) -> bool:
        checked = ctx.volatile_checked  # the endpoint asked the same rules already (its keying metric)
        if checked is not None and checked[0] is self.rules:
            return checked[1]
        return self.rules.may_hold(ctx.raw)

    async def prepare(self, ctx: RequestContext, backend: Backend, draft: Draft) -> None:
        body = draft.read()
        if body is None or not self.rules:
            return
        if ctx is not None and not self._may_hold(ctx):  # the client's bytes hold none
            return
        anthropic = "system" in body
        rules = self.rules_for(backend, ShapeName.MESSAGES if anthropic else ShapeName.CHAT)
        if not rules:
            return
        stripped = False
        if anthropic:
            system = body["system"]
            kept = rules.drop_content(system)
            if kept is not system:
                stripped = True
                shaped = draft.edit()
                if kept:
                    shaped["system"] = kept
                else:
                    del shaped["system"]  # nothing but volatile text: no system prompt at all
        messages = body.get("messages")
        if isinstance(messages, list):
            kept_messages = strip_messages(messages, rules)
            if kept_messages is not messages:
                stripped = True
                draft.edit()["messages"] = kept_messages
        if stripped and self.metrics is not None:
            self.metrics.volatile_normalised("forward")


def strip_messages(messages: list[Any], rules: VolatileRules) -> list[Any]:
    """``messages`` with volatile text gone from its leading system/developer messages (a message left
    empty is dropped); ``messages`` itself when there is none. Changed messages are new dicts."""
    head: list[Any] = []
    changed = False
    end = 0
    for msg in messages:
        if not isinstance(msg, dict) or msg.get("role") not in SYSTEM_ROLES:
            break
        end += 1
        content = msg.get("content")
        kept = rules.drop_content(content)
        if kept is content:
            head.append(msg)
            continue
        changed = True
        if kept:
            head.append({**msg, "content": kept})
    if not changed:
        return messages
    return head + messages[end:]
