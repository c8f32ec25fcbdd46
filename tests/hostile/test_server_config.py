"""``uvicorn_config``: what ``warmroute serve`` runs with."""

from __future__ import annotations

import pickle
import resource

from config.settings import load_settings
from gateway.app import ServingApp
from gateway.server import FD_RESERVE, GatewayConfig, ensure_fd_limit, uvicorn_config
from gateway.server_protocol import GatewayHttpProtocol, InboundLimits

BACKENDS = [{"id": i, "url": f"http://127.0.0.1:{9000 + n}", "models": ["m"]} for n, i in enumerate("ab")]


def test_settings_reach_the_protocol_and_survive_the_trip_to_a_worker() -> None:
    settings = load_settings(
        None,
        backends=BACKENDS,
        server={"header_timeout_s": 3, "max_header_bytes": 8192, "max_headers": 20, "max_connections": 50},
        limits={
            "body_read_timeout_s": 7,
            "body_deadline_s": 9,
            "body_min_bytes_per_s": 100,
            "max_connections": 10,
        },
    )
    config = uvicorn_config(ServingApp(settings), settings, factory=True, port=0)
    assert config.http is GatewayHttpProtocol
    want = InboundLimits(
        header_timeout_s=3,
        max_header_bytes=8192,
        max_headers=20,
        max_connections=50,
        body_read_timeout_s=7,
        body_deadline_s=9,
        body_min_bytes_per_s=100,
    )
    assert config.inbound_limits == want
    assert config.needed_fds == 50 + 10 * 2 + FD_RESERVE
    assert (config.server_header, config.access_log, config.proxy_headers) == (False, False, False)
    copy = pickle.loads(pickle.dumps(config))  # uvicorn spawns workers with a pickled Config
    assert isinstance(copy, GatewayConfig)
    assert copy.inbound_limits == want
    assert copy.app == ServingApp(settings)  # the worker gets the validated settings, not a path to reread


def test_defaults_are_the_documented_ones() -> None:
    assert InboundLimits.from_settings(load_settings(None)) == InboundLimits(
        10.0, 65536, 100, 2048, 30.0, 30.0, 16384
    )


def test_the_open_file_limit_is_raised_towards_what_the_caps_need() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = min(soft, 4096) - 100  # still far above what this process has open
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
        ensure_fd_limit(low + 50)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == low + 50
        ensure_fd_limit(low)  # never lowers it
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == low + 50
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
