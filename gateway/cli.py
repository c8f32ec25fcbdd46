"""``warmroute`` command line: serve | sim | demo | bench.

``demo`` and ``bench`` live in the ``tools`` package, which the product never imports: they are named here
as strings and imported only when that subcommand runs (tests/test_layout.py holds both ends of that).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version

from config.settings import ConfigError, load_settings
from gateway.server import run, uvicorn_config

#: Subcommands implemented elsewhere, imported by name only when used: name -> (module, help).
_DELEGATES: dict[str, tuple[str, str]] = {
    "sim": ("backends.sim.cli", "run a simulated OpenAI-compatible engine (no GPU needed)"),
    "demo": ("tools.demo", "3 simulated engines + the gateway + a short multi-turn workload"),
    "bench": ("tools.bench", "replay a multi-turn agent workload and compare routing policies"),
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in _DELEGATES:
        module = importlib.import_module(_DELEGATES[args[0]][0])
        entry: Callable[[list[str]], int] = module.main
        return entry(args[1:])
    parser = argparse.ArgumentParser(prog="warmroute", description="Conversation-affinity LLM gateway")
    parser.add_argument("--version", action="version", version=f"warmroute {installed_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", "-c", help="YAML settings file (env WARMROUTE_* overrides it)")
    serve.add_argument("--host", help="overrides server.host")
    serve.add_argument("--port", type=int, help="overrides server.port")
    serve.add_argument("--workers", type=int, help="overrides server.workers (several need redis.url)")
    for name, (_module, help_text) in _DELEGATES.items():
        sub.add_parser(name, help=help_text, add_help=False)
    ns = parser.parse_args(args)
    return _serve(ns)


def installed_version() -> str:
    """The installed distribution's version (pyproject.toml's), or a marker when run from a bare checkout."""
    try:
        return version("warmroute")
    except PackageNotFoundError:
        return "unknown (not installed: pip install .)"


def _serve(ns: argparse.Namespace) -> int:
    try:
        settings = load_settings(ns.config)
    except ConfigError as exc:
        print(f"warmroute: {exc}", file=sys.stderr)
        return 2
    server = settings.server
    host = ns.host or server.host
    port = ns.port if ns.port is not None else server.port
    workers = ns.workers or server.workers
    if not settings.backends:
        print("warmroute: no backends configured (add a 'backends:' list to the config)", file=sys.stderr)
        return 2
    if port == settings.admin.port:
        print(
            f"warmroute: --port {port} is admin.port: the admin listener needs a port of its own",
            file=sys.stderr,
        )
        return 2
    if workers > 1 and settings.redis.url is None:
        print(
            "warmroute: --workers > 1 needs redis.url, or each worker keeps its own affinity table "
            "and one conversation's turns scatter across engines",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every request at INFO: the health probes and canaries would fill the log each interval.
    # Their failures reach our own log through the lifecycle; httpx's own warnings still show.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    # The flags become settings: the admin access rules are about the listener actually bound, and workers
    # are handed these settings (``ServingApp``), never reading the file or the environment again.
    server = server.model_copy(update={"host": host, "port": port, "workers": workers})
    settings = settings.model_copy(update={"server": server})
    # Imported here: the app pulls in the whole gateway, which --version and the delegates never need.
    from gateway.app import ServingApp

    # Our Config subclass carries the inbound limits (header/body deadlines, head size, connection cap).
    return run(uvicorn_config(ServingApp(settings), settings, factory=True))


if __name__ == "__main__":
    raise SystemExit(main())
