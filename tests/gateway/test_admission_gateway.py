"""Admission per backend through the proxy, on the in-memory transport: the ORDER the engine received the
requests in, exact counters, every slot given back. Engine replies are held open by ``asyncio.Event``s, and
the tests wait on admission's own announcements (``AdmissionControl.until``), never on time passing."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from backends.registry import Registry
from config.settings import load_settings
from gateway.admission import AdmissionControl
from gateway.context import RequestContext
from gateway.inbound import first_values
from gateway.metrics import AdmissionMetrics, Metrics
from gateway.shapes.table import CHAT
from gateway.state import MemoryAffinityStore
from routing.load import key_seed, rendezvous
from routing.policies.least_loaded import LeastLoadedPolicy
from routing.policies.round_robin import RoundRobinPolicy
from routing.types import BackendState

from proxy_rig import OneBackend, ProxyClient
from transports import Reply

pytestmark = pytest.mark.anyio
JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream")]
CLASSES = {
    "interactive": {"max_queued": 8, "timeout_s": 30},
    "batch": {"max_queued": 8, "timeout_s": 30, "retry_after_s": 7},
}


class Rig(OneBackend):
    """One backend ``a`` behind a proxy with admission (capacity 1 unless told)."""

    def __init__(self, **admission: Any) -> None:
        cfg = {"enabled": True, "max_in_flight": 1, "classes": CLASSES, "default_class": "batch", **admission}
        super().__init__(admission=cfg)
        classes = list(self.settings.admission.classes)
        self.admission = AdmissionControl(
            self.settings.admission, AdmissionMetrics(self.metrics.registry, classes)
        )
        self.proxy = self.build_proxy(self.admission)

    def hold(self, n: int = 1) -> list[asyncio.Event]:
        """Script ``n`` replies that stay open until their event is set."""
        gates = [asyncio.Event() for _ in range(n)]
        for gate in gates:
            self.fake.script("http://a", Reply(200, JSON, [gate, b'{"ok": true}']))
        return gates

    def received(self) -> list[str]:
        """Who sent each request the engine received, in order."""
        return [json.loads(r.body)["messages"][0]["content"] for r in self.fake.requests]

    async def queued(self, n: int, klass: str = "batch") -> None:
        await self.admission.until(lambda: self.admission.scheduler.depth(klass) == n)

    async def idle(self) -> None:
        await self.admission.until(lambda: self.admission.scheduler.running("a") == 0)
        assert self.registry.total_in_flight() == 0 and self.fake.unclosed() == []
        assert all(self.admission.scheduler.depth(c) == 0 for c in self.admission.scheduler.classes())

    def counter(self, client: str, outcome: str) -> float:
        return self.sample("warmroute_admission_requests_total", client=client, outcome=outcome)


def context(client: str | None, label: str, *, stream: bool = False, headers: Any = ()) -> RequestContext:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": label}],
        "max_tokens": 16,
        "stream": stream,
    }
    raw = json.dumps(body).encode()
    ctx = RequestContext(
        "POST",
        "/v1/chat/completions",
        raw,
        body,
        "m",
        label,
        RoundRobinPolicy(),
        list(headers),
        first_values(headers),
        CHAT,
    )
    ctx.client = client
    return ctx


def waiting_comment(body: bytes) -> bool:
    """The comment a streamed request is sent while it waits for admission."""
    return body.startswith(b": waiting")


async def test_an_interactive_turn_goes_before_a_queued_batch_flood() -> None:
    rig = Rig(clients={"alice": "interactive", "docs": "batch"})
    gates = rig.hold(7)
    flood = [ProxyClient(rig, context("docs", f"docs-{i}")) for i in range(6)]
    await rig.queued(5)
    turn = ProxyClient(rig, context("alice", "alice"))
    await rig.queued(1, "interactive")
    for gate in gates:
        gate.set()
    for c in (*flood, turn):
        assert (await c.answer())[0] == 200
    assert rig.received() == ["docs-0", "alice", "docs-1", "docs-2", "docs-3", "docs-4", "docs-5"]
    await rig.idle()
    assert (rig.counter("docs", "admitted"), rig.counter("alice", "admitted")) == (6, 1)


async def test_in_one_class_a_flood_does_not_delay_another_client_beyond_one_turnover() -> None:
    rig = Rig(default_class="batch")
    gates = rig.hold(9)
    flood = [ProxyClient(rig, context("docs", f"docs-{i}")) for i in range(6)]
    await rig.queued(5)
    turns = [ProxyClient(rig, context("bob", f"bob-{i}")) for i in range(2)]
    await rig.queued(7)
    for gate in gates:
        gate.set()
    await asyncio.gather(*(c.answer() for c in (*flood, *turns)))
    # bob's first goes at the first slot turnover; then the two alternate by tokens used
    assert rig.received()[:5] == ["docs-0", "bob-0", "docs-1", "bob-1", "docs-2"]
    await rig.idle()


async def test_a_wait_past_the_class_timeout_is_a_503_with_retry_after() -> None:
    rig = Rig(classes={"batch": {"timeout_s": 0.05, "retry_after_s": 7}}, default_class="batch")
    (gate,) = rig.hold(1)
    running = ProxyClient(rig, context("docs", "docs-0"))
    await rig.admission.until(lambda: rig.admission.scheduler.running("a") == 1)
    status, headers, body = await ProxyClient(rig, context("docs", "docs-1")).answer()
    assert (status, dict(headers)[b"retry-after"]) == (503, b"7")
    assert json.loads(body)["error"]["code"] == "admission_timeout"
    gate.set()
    assert (await running.answer())[0] == 200
    assert rig.received() == ["docs-0"]
    await rig.idle()
    assert (rig.counter("docs", "admitted"), rig.counter("docs", "timeout")) == (1, 1)


async def test_a_full_class_queue_refuses_at_once() -> None:
    rig = Rig(classes={"batch": {"max_queued": 1, "retry_after_s": 3}}, default_class="batch")
    first, second = rig.hold(2)
    running, waiting = ProxyClient(rig, context("x", "x-0")), ProxyClient(rig, context("x", "x-1"))
    await rig.queued(1)
    status, headers, body = await ProxyClient(rig, context("x", "x-2")).answer()
    assert (status, dict(headers)[b"retry-after"], json.loads(body)["error"]["code"]) == (
        503,
        b"3",
        "admission_queue_full",
    )
    first.set()
    second.set()
    assert [(await c.answer())[0] for c in (running, waiting)] == [200, 200]
    await rig.idle()


async def test_a_client_that_leaves_the_queue_is_never_sent() -> None:
    rig = Rig()
    (gate, second) = rig.hold(2)
    running = ProxyClient(rig, context("a", "a-0"))
    gone = ProxyClient(rig, context("b", "b-0"))
    stays = ProxyClient(rig, context("c", "c-0"))
    await rig.queued(2)
    gone.leave.set()
    await gone.task
    assert rig.admission.scheduler.depth("batch") == 1  # at once: nothing else had to happen
    gate.set()
    second.set()
    assert [(await c.answer())[0] for c in (running, stays)] == [200, 200]
    assert rig.received() == ["a-0", "c-0"]
    await rig.idle()
    assert rig.counter("b", "left") == 1


async def test_a_request_waiting_for_admission_counts_in_the_load_routing_sees() -> None:
    """Routing reads a backend's in-flight count: the requests waiting for admission there are in it, as
    requests waiting in an engine's own queue are when admission is off; one that leaves is out at once."""
    rig = Rig()
    (gate,) = rig.hold(1)
    running = ProxyClient(rig, context("a", "a-0"))
    waiting = [ProxyClient(rig, context("b", f"b-{i}")) for i in range(2)]
    await rig.queued(2)

    def in_flight() -> int:
        (candidate,) = rig.registry.candidates("m", {}, None, 0.0)
        return candidate.in_flight

    assert in_flight() == 3
    waiting[0].leave.set()
    await waiting[0].task
    assert in_flight() == 2
    gate.set()
    rig.fake.script("http://a", Reply.json({"ok": True}))
    assert [(await c.answer())[0] for c in (running, waiting[1])] == [200, 200]
    await rig.idle()
    assert rig.sample("warmroute_requests_total", backend="", outcome="client_disconnect") == 1


async def test_a_new_request_is_routed_away_from_a_backend_whose_admission_queue_is_longer() -> None:
    """Two backends, one slot each, least-loaded routing: a third request queues on the one its tie-break
    prefers; a fourth whose tie-break prefers that backend too goes to the other (it sees the queue)."""
    rig = TwoBackends()
    for origin in ("http://a", "http://b"):
        rig.fake.script(origin, *(Reply(200, JSON, [rig.gate, b'{"ok": true}']) for _ in range(3)))
    first = [ProxyClient(rig, least_loaded("x", f"x-{i}")) for i in range(2)]
    await rig.admission.until(lambda: all(rig.admission.scheduler.running(b) == 1 for b in "ab"))
    busy = "a" if _tie_break("x-2", "a", "b") else "b"
    other = "b" if busy == "a" else "a"
    third = ProxyClient(rig, least_loaded("x", "x-2"))
    await rig.queued(1)
    label = next(f"y-{i}" for i in range(100) if _tie_break(f"y-{i}", busy, other))
    fourth = ProxyClient(rig, least_loaded("y", label))
    await rig.queued(2)  # both backends are full: it waits on the one it was routed to
    rig.gate.set()
    assert [(await c.answer())[0] for c in (*first, third, fourth)] == [200] * 4
    served = {json.loads(r.body)["messages"][0]["content"]: r.origin for r in rig.fake.requests}
    assert (served["x-2"], served[label]) == (f"http://{busy}", f"http://{other}")
    await rig.idle()


def least_loaded(client: str, label: str) -> RequestContext:
    ctx = context(client, label)
    ctx.policy = LeastLoadedPolicy()
    return ctx


def _tie_break(key: str, preferred: str, other: str) -> bool:
    """At equal load, least-loaded routing would send ``key`` to ``preferred``."""
    seed = key_seed(key)
    return rendezvous(seed, preferred) < rendezvous(seed, other)


class TwoBackends(Rig):
    """Backends ``a`` and ``b``, one slot each, least-loaded routing."""

    def __init__(self) -> None:
        super().__init__()
        backends = [{"id": b, "url": f"http://{b}", "models": ["m"]} for b in "ab"]
        self.settings = load_settings(None, backends=backends, admission=self.settings.admission.model_dump())
        self.affinity = MemoryAffinityStore(self.settings.routing)
        self.registry = Registry(self.settings.backends, listener=self.affinity)
        for b in "ab":
            self.registry.backends[b].state = BackendState.READY
        self.metrics = Metrics(self.registry)
        classes = list(self.settings.admission.classes)
        self.admission = AdmissionControl(
            self.settings.admission, AdmissionMetrics(self.metrics.registry, classes)
        )
        self.proxy = self.build_proxy(self.admission)
        self.gate = asyncio.Event()

    def idle_backends(self) -> bool:
        return all(self.admission.scheduler.running(b) == 0 for b in "ab")

    async def idle(self) -> None:
        await self.admission.until(self.idle_backends)
        assert self.registry.total_in_flight() == 0 and self.fake.unclosed() == []


async def test_a_waiting_stream_gets_keepalive_comments_then_the_engine_stream() -> None:
    rig = Rig(keepalive_s=0.01)
    (gate,) = rig.hold(1)
    rig.fake.script("http://a", Reply(200, SSE, [b"data: 1\n\n", b"data: [DONE]\n\n"]))
    running = ProxyClient(rig, context("a", "a-0"))
    stream = ProxyClient(rig, context("b", "b-0", stream=True))
    await stream.sent_body(waiting_comment)
    gate.set()
    await running.answer()
    status, headers, body = await stream.answer()
    assert (status, dict(headers)[b"content-type"]) == (200, b"text/event-stream")
    assert [m["type"] for m in stream.sent].count("http.response.start") == 1
    assert body.startswith(b": waiting for a (0 s)\n\n") and body.endswith(b"data: 1\n\ndata: [DONE]\n\n")
    await rig.idle()


async def test_a_trusted_key_picks_its_class_by_header_an_untrusted_one_cannot() -> None:
    rig = Rig(class_header_clients=["ops"])
    gates = rig.hold(4)
    header = [(b"x-warmroute-class", b"interactive")]
    first = ProxyClient(rig, context("a", "a-0"))
    queued = [ProxyClient(rig, context("a", "a-1"))]
    await rig.queued(1)
    queued.append(ProxyClient(rig, context("mallory", "mallory", headers=header)))
    await rig.queued(2)
    queued.append(ProxyClient(rig, context("ops", "ops", headers=header)))
    await rig.queued(1, "interactive")
    for gate in gates:
        gate.set()
    await asyncio.gather(*(c.answer() for c in (first, *queued)))
    assert rig.received() == ["a-0", "ops", "mallory", "a-1"]  # mallory: batch, fair share vs a
    await rig.idle()


async def test_a_failed_first_attempt_gives_its_slot_back_before_the_retry() -> None:
    rig = Rig()
    rig.fake.script("http://a", Reply.json({"error": "boom"}, status=500))
    status, _, _ = await ProxyClient(rig, context("a", "a-0")).answer()
    assert status == 500  # one backend: nobody else to ask
    await rig.idle()


async def test_an_engine_that_schedules_by_priority_is_told_the_class_rank() -> None:
    rig = Rig(clients={"alice": "interactive"}, engine_priority=["a"])
    rig.fake.script("http://a", Reply.json({"ok": True}), Reply.json({"ok": True}))
    for client in ("alice", "docs"):
        assert (await ProxyClient(rig, context(client, client)).answer())[0] == 200
    sent = [json.loads(r.body) for r in rig.fake.requests]
    assert [(b["messages"][0]["content"], b["priority"]) for b in sent] == [("alice", 0), ("docs", 1)]
    assert rig.fake.requests[0].body == (
        b'{"model":"m","messages":[{"role":"user","content":"alice"}],"max_tokens":16,"stream":false,'
        b'"priority":0}'
    )
    await rig.idle()


async def test_other_engines_get_the_clients_bytes_unchanged() -> None:
    rig = Rig(clients={"alice": "interactive"})
    rig.fake.script("http://a", Reply.json({"ok": True}))
    ctx = context("alice", "alice")
    assert (await ProxyClient(rig, ctx).answer())[0] == 200
    assert rig.fake.requests[0].body == ctx.raw
    await rig.idle()


async def test_a_keepalive_that_cannot_be_sent_leaves_the_queue() -> None:
    rig = Rig(keepalive_s=0.01)
    (gate,) = rig.hold(1)
    running = ProxyClient(rig, context("a", "a-0"))
    await rig.admission.until(lambda: rig.admission.scheduler.running("a") == 1)

    async def broken(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            raise OSError("connection reset")  # the head went, the first comment cannot

    never = asyncio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()
        return {"type": "http.disconnect"}

    with pytest.raises(OSError):
        await rig.proxy.forward(receive, broken, context("b", "b-0", stream=True))
    assert rig.admission.scheduler.depth("batch") == 0
    gate.set()
    assert (await running.answer())[0] == 200
    assert rig.received() == ["a-0"]
    await rig.idle()
