"""Fixtures for hostile tests (helpers live in hostile_gateway.py: import those from there)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import pytest
from hostile_gateway import HostileGateway, HostileGatewayFactory, start_gateway, uvicorn_to_caplog


@pytest.fixture
def hostile_gateway() -> Iterator[HostileGatewayFactory]:
    """``hostile_gateway(server={...}, limits={...})``: a gateway of this test's own (see start_gateway)."""
    with contextlib.ExitStack() as stack:
        yield lambda *args, **kw: start_gateway(stack, *args, **kw)


@pytest.fixture(scope="module")
def shared_gateway() -> Iterator[HostileGateway]:
    """One default gateway for a whole module, for tests that only send requests (fuzzers): clear
    ``engines[...].requests`` yourself if you assert on them."""
    with contextlib.ExitStack() as stack:
        yield start_gateway(stack)


@pytest.fixture
def gateway_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    uvicorn_to_caplog()
    caplog.set_level(logging.INFO)
    yield caplog
