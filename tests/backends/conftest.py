"""Fixtures for the backends tests (helpers live in simprocs.py: import those from there)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from simprocs import SimFactory, simulators


@pytest.fixture
def sims() -> Iterator[SimFactory]:
    yield from simulators()
