"""Which listener serves /admin: told by the address a connection arrived on, never by the port alone, and
the start-up line says the truth. Configurations that would serve /admin somewhere else than they say are
refused when the settings load (and ``warmroute serve`` exits 2 saying why)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest

from config.settings import ConfigError, load_settings
from gateway.app import create_app
from gateway.auth import Listener
from gateway.cli import main
from tools.procs import free_port

from admin_helpers import two_listeners
from upstreams import FakeEngine, serve

BACKENDS = [{"id": "a", "url": "http://127.0.0.1:9", "models": ["m"]}]
HOST_WITHOUT_PORT = (
    "invalid configuration:\n  admin: Value error, host is set without port: without a port of its own "
    "/admin is served by the API listener (server.host), not on admin.host; set admin.port too, or drop "
    "admin.host"
)
SAME_PORT = (
    "invalid configuration:\n  (top level): Value error, admin.port 8080 is also server.port: the admin "
    "listener needs a port of its own (a connection is told apart by the address it arrived on)"
)


def test_admin_host_without_admin_port_is_refused() -> None:
    # Was: server.host 0.0.0.0 + admin.host 127.0.0.1 served /admin without a token on 0.0.0.0, and the log
    # said "served because the listener is loopback".
    with pytest.raises(ConfigError) as err:
        load_settings(None, server={"host": "0.0.0.0"}, admin={"host": "127.0.0.1"})
    assert str(err.value) == HOST_WITHOUT_PORT


def test_admin_port_equal_to_server_port_is_refused() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(
            None, server={"host": "10.0.0.5", "port": 8080}, admin={"host": "127.0.0.1", "port": 8080}
        )
    assert str(err.value) == SAME_PORT


def test_warmroute_serve_exits_2_with_the_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "warmroute.yaml"
    config.write_text(json.dumps({"backends": BACKENDS, "admin": {"host": "127.0.0.1"}}))
    assert main(["serve", "--config", str(config)]) == 2
    assert capsys.readouterr().err == f"warmroute: {HOST_WITHOUT_PORT.replace(':', f' in {config}:', 1)}\n"
    config.write_text(json.dumps({"backends": BACKENDS, "admin": {"port": 9091}}))
    assert main(["serve", "--config", str(config), "--port", "9091"]) == 2
    assert capsys.readouterr().err == (
        "warmroute: --port 9091 is admin.port: the admin listener needs a port of its own\n"
    )


def test_api_listener_on_every_address_does_not_serve_admin(caplog: pytest.LogCaptureFixture) -> None:
    # The API listener bound to 0.0.0.0, the admin one to 127.0.0.1, no token. Both are reached through
    # 127.0.0.1: what decides is the listener a connection arrived on, not the client's address.
    engine = FakeEngine("a")
    with serve(engine.app()) as (url, _server):
        admin_port = free_port()
        settings = load_settings(
            None,
            server={"host": "0.0.0.0"},
            backends=[{"id": "a", "url": url, "models": ["m"]}],
            admin={"host": "127.0.0.1", "port": admin_port},
        )
        with caplog.at_level(logging.INFO, logger="warmroute.auth"), two_listeners(settings) as (api, admin):
            on_api = httpx.get(api + "/admin/backends")
            assert on_api.status_code == 404
            assert on_api.json()["error"] == {
                "message": "no route for GET /admin/backends on this port "
                f"(it is served on port {admin_port})",
                "type": "invalid_request_error",
                "param": None,
                "code": "not_found",
            }
            assert httpx.get(admin + "/admin/backends").json()["backends"][0]["id"] == "a"
            assert httpx.get(admin + "/v1/models").status_code == 404
            assert httpx.get(api + "/v1/models").status_code == 200
    said = [r.getMessage() for r in caplog.records if r.name == "warmroute.auth"]
    assert said == [
        f"admin API on 127.0.0.1:{admin_port}: no admin token configured; "
        "served because the listener is loopback"
    ]


def test_without_admin_port_the_api_listener_decides_and_the_log_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="warmroute.auth"):
        create_app(load_settings(None, backends=BACKENDS, server={"host": "0.0.0.0"}))
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "warmroute.auth"]
    assert said == [
        (
            logging.WARNING,
            "admin API DISABLED: no admin token configured and the admin listener 0.0.0.0 (the API port) is "
            "not loopback; /admin answers 403 until admin.token (WARMROUTE_ADMIN__TOKEN) is set",
        )
    ]


@pytest.mark.anyio
async def test_the_port_alone_does_not_make_the_admin_listener() -> None:
    # Another address on the admin port (another listener there: ours when it shared the port, someone's
    # when the admin listener is bound to one address) is not the admin listener.
    port = free_port()
    app = create_app(load_settings(None, backends=BACKENDS, admin={"host": "127.0.0.1", "port": port}))
    transport = httpx.ASGITransport(app=app)  # the scope's "server" is the URL's host and port
    async with httpx.AsyncClient(transport=transport) as http:
        assert (await http.get(f"http://127.0.0.2:{port}/admin/backends")).status_code == 404
        assert (await http.get(f"http://127.0.0.1:{port}/admin/backends")).status_code == 200
        assert (await http.get(f"http://127.0.0.1:{port}/v1/models")).status_code == 404


@pytest.mark.parametrize(
    ("bound", "arrived", "accepted"),
    [
        ("127.0.0.1", ("127.0.0.1", 9000), True),
        ("127.0.0.1", ("127.0.0.1", 9001), False),  # same address, another port
        ("127.0.0.1", ("10.1.2.3", 9000), False),  # same port, another address
        ("127.0.0.1", ("::ffff:127.0.0.1", 9000), True),  # IPv4 seen through a dual-stack socket
        ("0.0.0.0", ("10.1.2.3", 9000), True),  # a wildcard: any local address on its port
        ("::", ("::1", 9000), True),
        ("[::1]", ("::1", 9000), True),  # brackets as in a URL
        ("::1", ("[::1]", 9000), True),
        ("::1", ("127.0.0.1", 9000), False),
        ("localhost", ("127.0.0.1", 9000), True),  # a name: what it resolves to
        ("127.0.0.1", None, False),  # no address at all (a unix socket)
        ("127.0.0.1", ("not an address", 9000), False),
    ],
)
def test_a_listener_accepts_what_arrived_on_its_bound_address(
    bound: str, arrived: tuple[str, int] | None, accepted: bool
) -> None:
    assert Listener.bound(bound, 9000).accepted(arrived) is accepted
