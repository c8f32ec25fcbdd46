"""Registry.candidates: the one snapshot every routing policy decides on."""

from __future__ import annotations

from backends.registry import SIGNALS_MAX_AGE_S, Registry
from backends.signals import EngineSignals
from config.settings import load_settings
from routing.types import BackendState, Candidate


def registry() -> Registry:
    backends = [
        {"id": "a", "url": "http://a", "models": ["m"], "weight": 2.0},
        {"id": "b", "url": "http://b", "models": ["m", "n"]},
        {"id": "c", "url": "http://c", "models": ["n"]},
    ]
    reg = Registry(load_settings(None, backends=backends).backends)
    for b in reg.backends.values():
        b.state = BackendState.READY
    return reg


def test_every_signal_is_in_the_one_snapshot() -> None:
    reg = registry()
    a = reg.backends["a"]
    reg.lease("a")
    a.prefilling, a.prefill_tps = 1200, 3500.0
    a.signals = EngineSignals(at=50.0, waiting=3.0)
    assert reg.candidates("m", {"a": 4}, None, now=50.0 + SIGNALS_MAX_AGE_S) == (
        Candidate("a", BackendState.READY, 1, 4, 2.0, 1200, 3500.0, 3),
        Candidate("b", BackendState.READY, 0, 0, 1.0, 0, 0.0, -1),
    )


def test_shared_in_flight_counts_replace_the_local_ones() -> None:
    reg = registry()
    reg.lease("b")
    (a, b) = reg.candidates("m", {}, {"a": 5}, now=0.0)
    assert (a.in_flight, b.in_flight) == (5, 0)


def test_an_open_circuit_shows_a_ready_backend_as_down_and_a_model_narrows_the_set() -> None:
    reg = registry()
    reg.backends["b"].circuit_open = True
    assert [(c.id, c.state) for c in reg.candidates("n", {}, None, now=0.0)] == [
        ("b", BackendState.DOWN),
        ("c", BackendState.READY),
    ]
    assert [c.id for c in reg.candidates(None, {}, None, now=0.0)] == ["a", "b", "c"]
    assert reg.candidates("unknown", {}, None, now=0.0) == ()


def test_stale_or_absent_engine_queues_are_unknown() -> None:
    reg = registry()
    reg.backends["a"].signals = EngineSignals(at=0.0, waiting=3.0)
    reg.backends["b"].signals = EngineSignals(at=10.0)  # the engine does not report a queue
    a, b = reg.candidates("m", {}, None, now=SIGNALS_MAX_AGE_S + 0.5)
    assert (a.waiting, b.waiting) == (-1, -1)


def test_when_a_backend_was_last_given_a_new_conversation_is_in_its_candidate() -> None:
    reg = registry()
    a, b = reg.candidates("m", {}, None, now=0.0)
    assert (a.placed_at, b.placed_at) == (float("-inf"), float("-inf"))  # never
    reg.placed("b", 12.5)
    reg.placed("gone", 13.0)  # removed meanwhile: nothing to remember it on
    a, b = reg.candidates("m", {}, None, now=20.0)
    assert (a.placed_at, b.placed_at) == (float("-inf"), 12.5)
