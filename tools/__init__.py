"""Tooling around the gateway, not part of the request path: the demo (``warmroute demo``), the routing
benchmark (``warmroute bench``) and the micro-benchmarks (``python -m tools.bench_proxy`` and friends),
launchers for simulated engines, gateways and redis-server as child processes, and the timed streaming client
and multi-turn workloads they drive. Tools may import anything; nothing in ``gateway``, ``routing``,
``backends`` or ``config`` imports them (``tests/test_layout.py`` checks), so the product never depends on its
own test bench. The one link the other way is by name: ``gateway/cli.py`` imports ``tools.demo`` and
``tools.bench`` from a string, only when those subcommands run.
"""
