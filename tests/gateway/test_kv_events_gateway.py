"""Engine KV cache events end to end on the simulator: its events build the gateway's index, the index's
estimate of a conversation's cached prompt is compared with what the engine reports, and an evicted
conversation's next turn is estimated cold (reported cold too)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from backends.sim import SimConfig, SimServer
from config.settings import load_settings
from gateway.app import Gateway, create_app
from gateway.metrics import KvEventsMetrics

from upstreams import PROBE_TIMEOUT_S, serve

BLOCK = 16
WITHIN_S = 10.0


class Applied:
    """Announces every batch the gateway's subscribers apply (their ``on_batch`` hook, wrapped)."""

    def __init__(self, gw: Gateway) -> None:
        self.cond = threading.Condition()
        for sub in gw.kv_subscribers:
            inner = sub.on_batch
            sub.on_batch = self._wrap(inner)

    def _wrap(self, inner: Callable[[], None] | None) -> Callable[[], None]:
        def on_batch() -> None:
            if inner is not None:
                inner()
            with self.cond:
                self.cond.notify_all()

        return on_batch

    def wait(self, predicate: Callable[[], bool]) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, WITHIN_S)


Stack = tuple[str, Gateway, SimServer, Applied]


@pytest.fixture
def stack() -> Iterator[Stack]:
    with contextlib.ExitStack() as es:
        cfg = SimConfig(
            name="a", time_scale=0.0, cache_tokens=64 * BLOCK, block_size=BLOCK, answer_tokens=(8, 8),
            kv_events_endpoint="tcp://127.0.0.1:*",
        )  # fmt: skip
        sim = es.enter_context(SimServer(cfg))
        assert sim.engine.kv_publisher is not None
        backends = [
            {
                "id": "a",
                "url": sim.base_url,
                "models": list(cfg.models),
                "kv_events": {"endpoint": sim.engine.kv_publisher.endpoint, "topic": "kv"},
            }
        ]
        settings = load_settings(
            None, backends=backends, routing={"policy": "ttft"}, canary={"enabled": False},
            health={"interval_s": 0.2, "timeout_s": PROBE_TIMEOUT_S},
        )  # fmt: skip
        app = create_app(settings)
        gw: Gateway = app.state.gateway
        applied = Applied(gw)
        url, _ = es.enter_context(serve(app))
        assert sim.engine.kv_publisher.wait_subscriber()  # nothing is published before this: no race
        yield url, gw, sim, applied


def words(tag: str, n: int) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def synced(s: Stack) -> None:
    """Wait until the gateway applied every batch the simulator sent."""
    _, gw, sim, applied = s
    assert sim.engine.kv_publisher is not None and gw.kv is not None
    index = gw.kv.engine("a")
    applied.wait(lambda: index.expected_seq == sim.engine.kv_publisher.sent)  # type: ignore[union-attr]


def chat(url: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = httpx.post(
        url + "/v1/chat/completions", json={"model": "sim-model", "messages": messages}, timeout=10
    )
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def kv_metrics(gw: Gateway) -> KvEventsMetrics:
    assert gw.metrics.kv is not None
    return gw.metrics.kv


def test_a_warm_turn_is_estimated_from_the_events_and_an_evicted_one_cold(stack: Stack) -> None:
    url, gw, sim, _ = stack
    m = kv_metrics(gw)
    history: list[dict[str, Any]] = [
        {"role": "system", "content": words("sys", 100)},
        {"role": "user", "content": words("task", 100)},
    ]
    first = chat(url, history)
    prompt1 = first["usage"]["prompt_tokens"]
    synced(stack)
    assert m.compared == {}  # turn 1: the index had no answer
    assert gw.kv is not None and len(gw.kv.engine("a")) > 0
    assert m.events[("a", "BlockStored")] >= 1

    history += [first["choices"][0]["message"], {"role": "user", "content": words("more", 20)}]
    second = chat(url, history)
    reported2 = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Estimated: turn 1's prompt up to its last full block. Reported: that plus the reply's blocks.
    assert m.estimated[("a",)] == prompt1 // BLOCK * BLOCK
    assert m.reported[("a",)] == reported2 >= m.estimated[("a",)] > 0
    synced(stack)

    # Other work fills the engine's cache (straight to the engine): the conversation's blocks are evicted.
    for tag in ("x", "y"):
        body = {"model": "sim-model", "messages": [{"role": "user", "content": words(tag, 600)}]}
        r = httpx.post(sim.base_url + "/v1/chat/completions", json=body, timeout=10)
        assert r.status_code == 200
    synced(stack)
    assert m.events[("a", "BlockRemoved")] >= 1

    history += [second["choices"][0]["message"], {"role": "user", "content": words("again", 20)}]
    third = chat(url, history)
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the engine says cold...
    assert m.compared[("a",)] == 2
    assert m.estimated[("a",)] == prompt1 // BLOCK * BLOCK  # ...and so did the index: it added 0
    assert m.reported[("a",)] == reported2

    scraped = httpx.get(url + "/metrics", timeout=5).text
    assert 'warmroute_kv_index_blocks{backend="a"}' in scraped
    assert (
        f'warmroute_kv_estimated_cached_tokens_total{{backend="a"}} {float(prompt1 // BLOCK * BLOCK)}'
        in scraped
    )


def _settings(policy: str) -> Any:
    backend = {
        "id": "a",
        "url": "http://127.0.0.1:9",
        "models": ["m"],
        "kv_events": {"endpoint": "tcp://127.0.0.1:9"},
    }
    return load_settings(None, backends=[backend], routing={"policy": policy}, canary={"enabled": False})


def test_without_the_kv_extra_the_configuration_is_refused_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    import backends.kv_events as kv_events

    real = kv_events.importlib.import_module

    def no_zmq(name: str) -> Any:
        if name.split(".")[0] == "zmq":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return real(name)

    monkeypatch.setattr(kv_events.importlib, "import_module", no_zmq)
    with pytest.raises(ValueError, match=r"backends\[\]\.kv_events needs zmq: install the kv extra"):
        create_app(_settings("ttft"))


def test_a_policy_that_does_not_read_events_subscribes_to_nothing(caplog: pytest.LogCaptureFixture) -> None:
    gw: Gateway = create_app(_settings("affinity")).state.gateway
    assert gw.kv is None and gw.kv_subscribers == [] and gw.metrics.kv is None
    assert [r.getMessage() for r in caplog.records if "kv_events" in r.getMessage()] == [
        "backends[].kv_events is ignored: routing.policy affinity does not read it"
    ]
