"""Engine simulator: an OpenAI-compatible server that behaves like vLLM where routing cares (prefix cache,
queueing, decode slowdown under load, vLLM metric names, thinking budgets) plus fault switches for tests.

Run one with ``python -m backends.sim --port 8101 --name a`` or, in-process, ``SimServer(SimConfig(...))``.
"""

from backends.sim.app import create_sim_app, engine_of
from backends.sim.config import Faults, SimConfig
from backends.sim.engine import SimEngine, decode_step_seconds, ttft_seconds
from backends.sim.server import SimServer

__all__ = [
    "Faults",
    "SimConfig",
    "SimEngine",
    "SimServer",
    "create_sim_app",
    "decode_step_seconds",
    "engine_of",
    "ttft_seconds",
]
