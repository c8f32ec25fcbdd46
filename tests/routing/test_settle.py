"""routing.settle: the pin a decision may write once the policy has chosen."""

from __future__ import annotations

from routing.settle import settle_pin
from routing.types import Decision, PinAction, Reason

CLAIM = Decision("b", Reason.NEW_CHEAPEST, PinAction.CLAIM, uncached_tokens=900)


def test_a_first_turn_does_not_claim_a_head_pinned_to_its_twin() -> None:
    settled = settle_pin(CLAIM, first_turn=True, pinned="a")
    assert settled == Decision("b", Reason.NEW_CHEAPEST, PinAction.NONE, uncached_tokens=900)


def test_a_first_turn_claims_a_head_nobody_holds() -> None:
    assert settle_pin(CLAIM, first_turn=True, pinned=None) is CLAIM


def test_a_later_turn_keeps_its_claim() -> None:
    assert settle_pin(CLAIM, first_turn=False, pinned="a") is CLAIM


def test_only_a_claim_is_dropped() -> None:
    for pin in (PinAction.NONE, PinAction.TOUCH, PinAction.MOVE):
        decision = Decision("a", Reason.AFFINITY_HIT, pin)
        assert settle_pin(decision, first_turn=True, pinned="a") is decision
