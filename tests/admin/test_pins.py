"""gateway.admin.pins over the in-memory store, on an injected clock: exact seconds left, never the TTL
plus a generation for a pin just made."""

from __future__ import annotations

import pytest

from config.settings import RoutingConfig
from gateway.admin import pins
from gateway.state import MemoryAffinityStore
from routing.types import Decision, PinAction, Reason

pytestmark = pytest.mark.anyio

TTL = 3600.0
CLAIM = Decision("a", Reason.NEW_LEAST_LOADED, PinAction.CLAIM)
TOUCH = Decision("a", Reason.AFFINITY_HIT, PinAction.TOUCH)


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def test_a_fresh_pin_expires_in_exactly_the_ttl() -> None:
    clock = Clock(1000.0)
    store = MemoryAffinityStore(RoutingConfig(affinity_ttl_s=TTL), clock)
    await store.commit("first", CLAIM)
    assert await pins.lookup(store, "first") == pins.Pin("a", TTL)
    clock.now += 57.0  # same generation (TTL / 8 = 450 s wide), the case that used to say 3993
    await store.commit("second", CLAIM)
    assert await pins.lookup(store, "second") == pins.Pin("a", TTL)
    # The first pin's generation now ends with the second's use: it lives until then (at least its TTL).
    assert await pins.lookup(store, "first") == pins.Pin("a", TTL)
    clock.now += 600.0  # a later generation: nothing used since, the clock runs down exactly
    assert await pins.lookup(store, "first") == pins.Pin("a", TTL - 600.0)
    await store.commit("first", TOUCH)  # a turn of the conversation: a full TTL again
    assert await pins.lookup(store, "first") == pins.Pin("a", TTL)
    clock.now += TTL
    assert await pins.lookup(store, "first") is None
    assert await pins.lookup(store, "second") is None
