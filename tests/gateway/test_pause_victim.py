"""Which seated stream admission asks to pause (gateway/admission.py): the one of the victim's class heard
from longest ago, never one not heard yet (in its prefill, or paused and not yet continued)."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from test_admission_gateway import context

from config.settings import AdmissionConfig
from gateway.admission import AdmissionControl, Seat
from gateway.metrics import AdmissionMetrics

pytestmark = pytest.mark.anyio
CFG = AdmissionConfig(
    enabled=True,
    max_in_flight=3,
    classes={"interactive": {}, "batch": {"preemptible": True}},
    clients={"flood": "batch", "person": "interactive"},
    default_class="batch",
)


async def _send(message: Any) -> None:
    raise AssertionError("nothing waits here: nothing is sent")


async def seated(n: int) -> tuple[AdmissionControl, list[Seat]]:
    control = AdmissionControl(CFG, AdmissionMetrics(CollectorRegistry(), list(CFG.classes)))
    seats = [await control.seat(context("flood", f"doc {i}", stream=True), "a", _send) for i in range(n)]
    assert all(s.ticket.resumable for s in seats)
    return control, seats


async def test_the_stream_heard_from_longest_ago_is_asked() -> None:
    control, (a, b, c) = await seated(3)
    a.heard, b.heard, c.heard = 5.0, 3.0, 4.0
    await control.seat(context("person", "question", stream=True), "a", _send)  # seated at once, over
    assert [s.asked for s in (a, b, c)] == [False, True, False]
    assert control.scheduler.running("a") == 4 and control.scheduler.pausing("a") == 1


async def test_a_stream_not_heard_yet_is_not_asked_while_another_was() -> None:
    control, (a, b, c) = await seated(3)
    a.heard, b.heard, c.heard = 5.0, 0.0, 0.0  # b and c: in their prefill (the scheduler's choice: c)
    await control.seat(context("person", "question"), "a", _send)
    assert [s.asked for s in (a, b, c)] == [True, False, False]


async def test_nothing_heard_yet_leaves_the_schedulers_choice() -> None:
    control, (a, b, c) = await seated(3)
    await control.seat(context("person", "question"), "a", _send)
    assert [s.asked for s in (a, b, c)] == [False, False, True]  # the newest admitted


async def test_a_stream_that_cannot_be_paused_hands_the_ask_on() -> None:
    control, (a, b, c) = await seated(3)
    a.heard, b.heard, c.heard = 5.0, 3.0, 4.0
    await control.seat(context("person", "question"), "a", _send)
    assert b.asked
    b.keep()  # e.g. it has sent reasoning
    assert not b.asked and [a.asked, c.asked] == [False, True]  # the next heard from longest ago
