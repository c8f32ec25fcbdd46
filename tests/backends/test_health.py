"""backends.health: probe semantics through respx (no sockets), and one real-socket test of the deadline.

The checker writes no state; it reports each probe to a sink. The sink here applies those reports to the
real lifecycle (``backends.lifecycle.transition``, a canary that always passes) and mirrors the state into
the registry, so the tests assert both the events sent and the states they lead to.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Callable, Iterator

import httpx
import pytest
import respx

from backends.events import CanaryPassed, Event, ProbeFailed, ProbeOk
from backends.health import HealthChecker
from backends.lifecycle import Lifecycle, LifecyclePolicy, transition
from backends.registry import Backend, Registry
from config.settings import BackendConfig, HealthConfig
from routing.types import BackendState

pytestmark = pytest.mark.anyio


def backend_config(name: str, url: str | None = None) -> BackendConfig:
    return BackendConfig(id=name, url=url or f"http://{name}.test", models=("m",))


class LifecycleSink:
    """Probe results -> events -> the pure lifecycle (the canary passes at once) -> ``Backend.state``."""

    def __init__(self, registry: Registry, fail_threshold: int) -> None:
        self.backends = dict(registry.backends)
        self.policy = LifecyclePolicy(fail_threshold=fail_threshold)
        self.lifecycles: dict[str, Lifecycle] = {}
        self.events: list[tuple[str, Event]] = []

    def probed(self, backend_id: str, error: str | None) -> None:
        event: Event = ProbeOk() if error is None else ProbeFailed(error)
        self.events.append((backend_id, event))
        lc, _ = transition(self.lifecycle(backend_id), event, 0.0, self.policy)
        if lc.state is BackendState.CANARY:
            lc, _ = transition(lc, CanaryPassed(lc.canary_seq), 0.0, self.policy)
        self.set(backend_id, lc)

    def lifecycle(self, backend_id: str) -> Lifecycle:
        return self.lifecycles.get(backend_id, Lifecycle())

    def set(self, backend_id: str, lc: Lifecycle) -> None:
        self.lifecycles[backend_id] = lc
        self.backends[backend_id].state = lc.state

    def failures(self, backend_id: str) -> int:
        return self.lifecycle(backend_id).probe_failures


@contextlib.asynccontextmanager
async def checker(*backends: BackendConfig, **cfg: object) -> AsyncIterator[HealthChecker]:
    async with httpx.AsyncClient() as client:
        registry = Registry(backends)
        config = HealthConfig(**cfg)  # type: ignore[arg-type]
        health = HealthChecker(registry, client, config, LifecycleSink(registry, config.fail_threshold))
        try:
            yield health
        finally:
            await health.aclose()


def sink(health: HealthChecker) -> LifecycleSink:
    assert isinstance(health.sink, LifecycleSink)
    return health.sink


@pytest.fixture
def mock() -> Iterator[respx.MockRouter]:
    with respx.mock(assert_all_called=False) as router:  # an unrouted request fails the probe loudly
        yield router


async def until(predicate: Callable[[], bool], within: float) -> None:
    """Poll state the checker's own tasks change; fails the test if it does not happen ``within`` s."""
    async with asyncio.timeout(within):
        while not predicate():  # noqa: ASYNC110 - the checker offers no event to wait on
            await asyncio.sleep(0.005)


def ready(health: HealthChecker, name: str) -> Backend:
    sink(health).set(name, Lifecycle(state=BackendState.READY))
    return health.registry.backends[name]


# -- one probe ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("models_status", "state", "error"),
    [(200, BackendState.READY, None), (503, BackendState.DOWN, "health probe answered HTTP 503")],
)
async def test_404_on_health_falls_back_to_v1_models(
    mock: respx.MockRouter, models_status: int, state: BackendState, error: str | None
) -> None:
    health_route = mock.get("http://a.test/health").mock(return_value=httpx.Response(404))
    models_route = mock.get("http://a.test/v1/models").mock(return_value=httpx.Response(models_status))
    async with checker(backend_config("a"), fail_threshold=1) as health:
        b = health.registry.backends["a"]
        await health.check(b)
        assert (b.state, b.last_error) == (state, error)
        assert b.last_checked is not None
        assert sink(health).events == [("a", ProbeOk() if error is None else ProbeFailed(error))]
    assert (health_route.call_count, models_route.call_count) == (1, 1)


async def test_other_errors_on_health_do_not_fall_back(mock: respx.MockRouter) -> None:
    mock.get("http://a.test/health").mock(return_value=httpx.Response(503))
    models_route = mock.get("http://a.test/v1/models").mock(return_value=httpx.Response(200))
    async with checker(backend_config("a"), fail_threshold=1) as health:
        b = health.registry.backends["a"]
        await health.check(b)
        assert (b.state, b.last_error) == (BackendState.DOWN, "health probe answered HTTP 503")
    assert models_route.call_count == 0


async def test_v1_models_as_the_health_path_is_probed_once(mock: respx.MockRouter) -> None:
    route = mock.get("http://a.test/v1/models").mock(return_value=httpx.Response(404))
    async with checker(backend_config("a"), path="/v1/models", fail_threshold=1) as health:
        await health.check(health.registry.backends["a"])
        assert health.registry.backends["a"].state is BackendState.DOWN
    assert route.call_count == 1


async def test_the_api_key_is_sent(mock: respx.MockRouter) -> None:
    route = mock.get("http://a.test/health").mock(return_value=httpx.Response(200))
    cfg = BackendConfig(id="a", url="http://a.test", models=("m",), api_key="sk-1")
    async with checker(cfg) as health:
        await health.check(health.registry.backends["a"])
    assert route.calls.last.request.headers["authorization"] == "Bearer sk-1"


@pytest.mark.parametrize("state", [BackendState.DRAINING, BackendState.CORDONED])
@pytest.mark.parametrize(("status", "after", "failures"), [(200, None, 0), (503, BackendState.DOWN, 2)])
async def test_operator_states_are_kept_by_healthy_probes_and_lost_to_an_outage(
    mock: respx.MockRouter, state: BackendState, status: int, after: BackendState | None, failures: int
) -> None:
    # The lifecycle's rule: a dead engine goes DOWN even when drained or cordoned (its pins must move);
    # the operator flag survives and applies again after its canary.
    mock.get("http://a.test/health").mock(return_value=httpx.Response(status))
    async with checker(backend_config("a"), fail_threshold=1) as health:
        b = health.registry.backends["a"]
        flags = {"drained": state is BackendState.DRAINING, "cordoned": state is BackendState.CORDONED}
        sink(health).set("a", Lifecycle(state=state, probe_failures=1, **flags))
        await health.check(b)
        assert (b.state, sink(health).failures("a")) == (after or state, failures)
        if after is not None:
            mock.get("http://a.test/health").mock(return_value=httpx.Response(200))
            await health.check(b)
            assert b.state is state


async def test_fail_threshold_counts_consecutive_failures(mock: respx.MockRouter) -> None:
    statuses = [503, 503, 200, 503, 503, 503, 200]
    mock.get("http://a.test/health").mock(side_effect=[httpx.Response(s) for s in statuses])
    async with checker(backend_config("a"), fail_threshold=3) as health:
        b = ready(health, "a")
        seen = []
        for _ in statuses:
            await health.check(b)
            seen.append((b.state, sink(health).failures("a")))
    R, D = BackendState.READY, BackendState.DOWN
    assert seen == [(R, 1), (R, 2), (R, 0), (R, 1), (R, 2), (D, 3), (R, 0)]


async def test_a_probe_that_raises_is_a_failure_logged_in_one_line(
    mock: respx.MockRouter, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="warmroute.health")
    mock.get("http://a.test/health").mock(side_effect=[RuntimeError("boom")] * 2 + [httpx.Response(200)])
    async with checker(backend_config("a"), fail_threshold=2) as health:
        b = ready(health, "a")
        await health.check(b)
        assert (b.state, sink(health).failures("a")) == (BackendState.READY, 1)
        assert b.last_error == "health probe raised RuntimeError: boom"
        await health.check(b)
        assert b.state is BackendState.DOWN
        await health.check(b)
        assert b.state is BackendState.READY
    lines = [(r.levelno, r.getMessage(), r.exc_info) for r in caplog.records if r.name == "warmroute.health"]
    assert lines == [
        (logging.WARNING, "backend a: health probe raised RuntimeError: boom", None),  # once, not per round
    ]  # the state changes are the lifecycle's to log
    error = ProbeFailed("health probe raised RuntimeError: boom")
    assert sink(health).events == [("a", error), ("a", error), ("a", ProbeOk())]


# -- the background loop ------------------------------------------------------------------------------


async def test_the_loop_survives_a_probe_that_raises(mock: respx.MockRouter) -> None:
    seen: list[int] = []  # the backend's failure count as each probe starts

    def answer(_request: httpx.Request) -> httpx.Response:
        seen.append(sink(health).failures("a"))
        if len(seen) <= 2:
            raise RuntimeError("a bug in the probe")
        return httpx.Response(200)

    mock.get("http://a.test/health").mock(side_effect=answer)
    async with checker(backend_config("a"), interval_s=0.01, fail_threshold=5) as health:
        health.start()
        await until(lambda: len(seen) >= 4, within=5)
        assert seen[:4] == [0, 1, 2, 0]  # each raise counted as a failure, and probing went on
        assert health.registry.backends["a"].state is BackendState.READY


async def test_a_hung_probe_fails_within_timeout_and_does_not_delay_the_others(
    mock: respx.MockRouter,
) -> None:
    never = asyncio.Event()
    cancelled = asyncio.Event()

    async def hang(_request: httpx.Request) -> httpx.Response:
        try:
            await never.wait()
        finally:
            cancelled.set()
        raise AssertionError("unreachable")

    mock.get("http://a.test/health").mock(side_effect=hang)
    b_route = mock.get("http://b.test/health").mock(return_value=httpx.Response(200))
    async with checker(
        backend_config("a"), backend_config("b"), interval_s=0.05, timeout_s=1.0, fail_threshold=1
    ) as health:
        loop = asyncio.get_running_loop()
        started = loop.time()
        health.start()
        await until(lambda: health.registry.backends["a"].state is BackendState.DOWN, within=10)
        took = loop.time() - started
        assert 1.0 <= took < 4.0  # interval + the probe's deadline, plus a loaded machine's slack
        assert cancelled.is_set()  # the hung request was cancelled, not left behind
        assert b_route.call_count >= 4  # ~20 expected: b kept its own schedule meanwhile
        assert health.registry.backends["b"].state is BackendState.READY
        assert health.registry.backends["a"].last_error == "health probe got no complete answer within 1.0s"


async def test_check_all_is_bounded_by_the_probe_deadline(mock: respx.MockRouter) -> None:
    async def hang(_request: httpx.Request) -> httpx.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    mock.get("http://a.test/health").mock(side_effect=hang)
    mock.get("http://b.test/health").mock(return_value=httpx.Response(200))
    async with checker(backend_config("a"), backend_config("b"), timeout_s=0.2, fail_threshold=1) as health:
        async with asyncio.timeout(10):  # a give-up bound: check_all ends with the 0.2 s probe deadline
            await health.check_all()
        assert health.registry.backends["a"].state is BackendState.DOWN
        assert health.registry.backends["b"].state is BackendState.READY


async def test_watch_unwatch_and_aclose(mock: respx.MockRouter) -> None:
    a_route = mock.get("http://a.test/health").mock(return_value=httpx.Response(200))
    b_route = mock.get("http://b.test/health").mock(return_value=httpx.Response(200))
    c_route = mock.get("http://c.test/health").mock(return_value=httpx.Response(200))
    async with checker(backend_config("a"), backend_config("b"), interval_s=0.01) as health:
        health.start()
        tasks = dict(health._tasks)
        health.start()  # idempotent
        assert health._tasks == tasks and len(tasks) == 2
        added = Backend(backend_config("c"))  # as if added at runtime
        sink(health).backends["c"] = added
        health.watch(added)
        await until(lambda: b_route.call_count >= 1 and c_route.call_count >= 1, within=5)
        await health.unwatch("b")
        assert tasks["b"].done()
        b_calls, a_calls = b_route.call_count, a_route.call_count
        await until(lambda: a_route.call_count >= a_calls + 3, within=5)  # three of a's intervals passed
        assert b_route.call_count == b_calls
        assert added.state is BackendState.READY
        await health.aclose()
        assert all(t.done() for t in tasks.values()) and not health._tasks


async def test_run_owns_the_tasks_until_cancelled(mock: respx.MockRouter) -> None:
    route = mock.get("http://a.test/health").mock(return_value=httpx.Response(200))
    async with checker(backend_config("a"), interval_s=0.01) as health:
        runner = asyncio.create_task(health.run())
        await until(lambda: route.call_count >= 2, within=5)
        probe = health._tasks["a"]
        runner.cancel()
        with pytest.raises(asyncio.CancelledError):
            await runner
        assert probe.done() and not health._tasks


# -- a real socket: httpx's per-read timeout never fires on a trickle ---------------------------------------


@contextlib.asynccontextmanager
async def raw_server(reply: bytes, byte_delay_s: float, hits: list[float]) -> AsyncIterator[str]:
    """Answer every request with ``reply``, one byte per ``byte_delay_s`` (0: all at once)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                hits.append(asyncio.get_running_loop().time())
                if not byte_delay_s:
                    writer.write(reply)
                    continue
                for i in range(len(reply)):
                    writer.write(reply[i : i + 1])
                    await writer.drain()
                    await asyncio.sleep(byte_delay_s)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the prober hung up
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


async def test_a_trickling_engine_fails_within_timeout_while_another_is_probed_on_schedule() -> None:
    reply = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    slow_hits: list[float] = []
    fast_hits: list[float] = []
    async with (
        raw_server(reply, 0.3, slow_hits) as slow_url,
        raw_server(reply, 0.0, fast_hits) as fast_url,
        checker(
            backend_config("slow", slow_url),
            backend_config("fast", fast_url),
            interval_s=0.1,
            timeout_s=3.0,
            fail_threshold=1,
        ) as health,
    ):
        slow = health.registry.backends["slow"]
        loop = asyncio.get_running_loop()
        started = loop.time()
        health.start()
        await until(lambda: slow.state is BackendState.DOWN, within=10)
        took = loop.time() - started
        assert 3.0 <= took < 3.0 + 0.1 + 3.0  # its deadline (+ interval, + load), not 11 s of trickle
        assert slow.last_error == "health probe got no complete answer within 3.0s"
        assert len(slow_hits) == 1
        # ~30 probes expected meanwhile; gaps stay near the interval, far from the slow probe's 3 s (half of
        # it allows a loaded machine's stalls; a 1 s probe and a 0.6 s bound did not).
        assert len(fast_hits) >= 5
        assert max(b - a for a, b in itertools.pairwise(fast_hits)) < 1.5
        assert health.registry.backends["fast"].state is BackendState.READY
