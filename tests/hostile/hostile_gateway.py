"""The gateway served exactly as ``warmroute serve`` serves it, and its log, for the hostile tests (a module
of its own name: ``from conftest import`` reads whichever conftest.py pytest loaded last when several test
folders are in one run)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn
from starlette.types import ASGIApp

from config.settings import load_settings
from gateway.app import Gateway, create_app
from gateway.server import uvicorn_config

from clusters import loop_of, wait_on_loop
from upstreams import FAST_HEALTH, FakeEngine, serve, served

#: Small enough that a test waiting for a deadline takes a second, not ten.
FAST = {"header_timeout_s": 0.5}
FAST_LIMITS = {"body_read_timeout_s": 0.5}
#: How long a test waits for an answer before it gives up: costs nothing when the answer comes.
WAIT_S = 10.0
#: How late a short deadline here may fire on a loaded machine (a stall), well short of any other timeout
#: that could end the wait instead (uvicorn's keep-alive is 5 s).
LATE_S = 4.0


@dataclass
class HostileGateway:
    port: int
    url: str
    engines: dict[str, FakeEngine]
    gateway: Gateway
    server: uvicorn.Server

    def open_connections(self) -> int:
        return len(self.server.server_state.connections)

    def wait_for(self, predicate: Callable[[], object], what: str, within: float = 10.0) -> None:
        """Wait for a state the gateway announces (``Gateway.changes``), re-checked on its own loop."""
        wait_on_loop(self.gateway, loop_of(self.server), predicate, what, within)


HostileGatewayFactory = Callable[..., HostileGateway]


def start_gateway(
    stack: contextlib.ExitStack,
    engines: list[FakeEngine] | None = None,
    raw_engines: dict[str, str] | None = None,
    wrap: Callable[[ASGIApp], ASGIApp] | None = None,
    backend: dict[str, Any] | None = None,
    **overrides: Any,
) -> HostileGateway:
    """Fake engine "a" (or ``engines``) and a gateway served through ``gateway.server.uvicorn_config`` (the
    real protocol class), with short deadlines unless overridden; all stopped when ``stack`` closes.
    ``raw_engines``: backend id -> URL of an engine served elsewhere (a HostileEngine), model "m".
    ``wrap``: ASGI middleware around the app, outermost (e.g. to record what the app was asked).
    ``backend``: settings every fake engine's backend gets (e.g. its ``native_shapes``)."""
    fakes = engines if engines is not None else [FakeEngine("a")]
    urls = {f.name: stack.enter_context(serve(f.app()))[0] for f in fakes}
    backends = [
        {"id": f.name, "url": urls[f.name], "models": list(f.models), **(backend or {})} for f in fakes
    ]
    backends += [{"id": name, "url": url, "models": ["m"]} for name, url in (raw_engines or {}).items()]
    overrides.setdefault("health", FAST_HEALTH)
    # Hostile engines script one answer per path, not a model: a canary is beside the point here.
    overrides.setdefault("canary", {"enabled": False})
    overrides["server"] = {**FAST, **overrides.get("server", {})}
    overrides["limits"] = {**FAST_LIMITS, **overrides.get("limits", {})}
    settings = load_settings(None, backends=backends, **overrides)
    app = create_app(settings)
    config = uvicorn_config(
        wrap(app) if wrap else app,
        settings,
        host="127.0.0.1",
        port=0,
        lifespan="on",
        log_config=None,
        log_level="warning",
    )
    port, server = stack.enter_context(served(config))
    uvicorn_to_caplog()
    gw = app.state.gateway
    return HostileGateway(port, f"http://127.0.0.1:{port}", {f.name: f for f in fakes}, gw, server)


def uvicorn_to_caplog() -> None:
    # Every uvicorn dictConfig (engines' servers run one) stops "uvicorn" propagating to the root logger,
    # where caplog listens; the gateway's own tracebacks would go unseen.
    logging.getLogger("uvicorn").propagate = True


def lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """Records from the gateway and uvicorn at INFO and above (background health probes left out)."""
    return [
        r
        for r in caplog.records
        if r.name.startswith(("warmroute", "uvicorn"))
        and not r.name.startswith("warmroute.health")
        and r.levelno >= logging.INFO
    ]


def assert_one_line(caplog: pytest.LogCaptureFixture, says: str) -> None:
    """The handled error logged exactly one line saying ``says``, and nothing logged a traceback."""
    got = lines(caplog)
    assert not [r for r in got if r.exc_info], [r.getMessage() for r in got]
    assert [says in r.getMessage() for r in got] == [True], [r.getMessage() for r in got]
