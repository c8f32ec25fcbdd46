"""The last word on a decision's pin, after the policy chose: what the caller may write to the store.

A first turn's key is its head's (``routing.keys``): a pin found under it belongs to whoever prefilled that
head first, a twin conversation or this one's earlier attempt. Claiming it would take the head back for
this conversation, so the claim is dropped and the twin keeps its pin. Every other decision stands.
"""

from __future__ import annotations

from dataclasses import replace

from routing.types import Decision, PinAction


def settle_pin(decision: Decision, *, first_turn: bool, pinned: str | None) -> Decision:
    """``decision`` with a pin action the caller may apply (the same object when nothing changes)."""
    if first_turn and pinned is not None and decision.pin is PinAction.CLAIM:
        return replace(decision, pin=PinAction.NONE)
    return decision
