"""Who may call /admin and /v1: admin token, loopback-only without one, the admin port, client keys."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import httpx
import pytest
from starlette.types import Message, Receive, Scope, Send

from config.settings import ConfigError, load_settings
from gateway.app import create_app
from gateway.auth import AccessGuard, AdminAccess, ClientKeys
from tools.procs import child, free_port, ok, python, wait_http

from admin_helpers import chat, metric_lines, two_listeners
from clusters import ClusterFactory
from upstreams import FakeEngine, serve

TOKEN = "s3cret-admin-token"
ROOT = Path(__file__).resolve().parents[2]


def test_admin_needs_the_bearer_token(cluster: ClusterFactory) -> None:
    c = cluster(["a"], admin={"token": TOKEN})
    for path in ("/admin/backends", "/admin/openapi.json", "/admin", "/admin/anything/mounted/later"):
        r = httpx.get(c.url + path)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {
            "error": {
                "message": "admin endpoints need Authorization: Bearer <admin token>",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    wrong = httpx.get(c.url + "/admin/backends", headers={"authorization": "Bearer nope"})
    assert (wrong.status_code, wrong.json()["error"]["message"]) == (401, "the admin token is not valid")
    basic = httpx.get(c.url + "/admin/backends", headers={"authorization": f"Basic {TOKEN}"})
    assert basic.status_code == 401
    ok = httpx.get(c.url + "/admin/backends", headers={"authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200 and ok.json()["backends"][0]["id"] == "a"
    drained = httpx.post(c.url + "/admin/backends/a/drain", headers={"authorization": "Bearer nope"})
    assert drained.status_code == 401 and c.gateway.registry.backends["a"].state.value == "ready"
    assert chat(c.url, "x").status_code == 200  # /v1 needs no admin token


def test_no_token_off_loopback_is_refused_and_logged(
    cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="warmroute.auth"):
        c = cluster(["a"], server={"host": "0.0.0.0"})
    r = httpx.get(c.url + "/admin/backends")
    assert r.status_code == 403
    assert r.json()["error"]["code"] == "admin_disabled"
    assert "no admin token is configured" in r.json()["error"]["message"]
    assert "bound to 0.0.0.0, which is not loopback" in r.json()["error"]["message"]
    warned = [rec for rec in caplog.records if rec.name == "warmroute.auth"]
    assert [rec.levelno for rec in warned] == [logging.WARNING]
    assert warned[0].getMessage().startswith("admin API DISABLED: no admin token configured")


def test_no_token_on_loopback_is_served_and_says_why(
    cluster: ClusterFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="warmroute.auth"):
        c = cluster(["a"])
    assert httpx.get(c.url + "/admin/backends").status_code == 200
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "warmroute.auth"]
    assert lines == [
        "admin API on 127.0.0.1 (the API port): no admin token configured; "
        "served because the listener is loopback"
    ]


def test_no_token_on_loopback_is_refused_through_a_proxy(cluster: ClusterFactory) -> None:
    # A reverse proxy on the same host is a loopback peer: without this, /admin would be open to everyone
    # the proxy serves.
    c = cluster(["a"])
    for name, value in [
        ("x-forwarded-for", "203.0.113.7"),
        ("forwarded", "for=203.0.113.7"),
        ("x-real-ip", "203.0.113.7"),
    ]:
        r = httpx.get(c.url + "/admin/backends", headers={name: value})
        assert r.status_code == 403, name
        assert r.json() == {
            "error": {
                "message": "the admin API is served without a token only to callers on this host, and this "
                "request came through a proxy (it carries forwarding headers); set admin.token "
                "(WARMROUTE_ADMIN__TOKEN)",
                "type": "invalid_request_error",
                "param": None,
                "code": "admin_disabled",
            }
        }
    assert httpx.get(c.url + "/admin/backends").status_code == 200
    token = cluster(["a"], admin={"token": TOKEN})  # with a token, the token decides
    auth = {"authorization": f"Bearer {TOKEN}", "x-forwarded-for": "203.0.113.7"}
    assert httpx.get(token.url + "/admin/backends", headers=auth).status_code == 200


def test_secrets_load_from_the_environment_and_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("WARMROUTE_ADMIN__TOKEN", "from-env")
    monkeypatch.setenv("WARMROUTE_AUTH__CLIENT_KEYS", '[{"name": "ci", "key": "k-env"}]')
    settings = load_settings(None)
    assert settings.admin.secret() == "from-env" and settings.auth.keys() == {"k-env": "ci"}
    assert "from-env" not in repr(settings) and "k-env" not in repr(settings)
    token, keys = tmp_path / "token", tmp_path / "keys"
    token.write_text("from-file\n")
    keys.write_text("# name key\nalice k-alice\nbob k-bob  # the intern\n\n")
    monkeypatch.delenv("WARMROUTE_AUTH__CLIENT_KEYS")
    settings = load_settings(None, admin={"token_file": str(token)}, auth={"client_keys_file": str(keys)})
    assert settings.admin.secret() == "from-file"
    assert settings.auth.keys() == {"k-alice": "alice", "k-bob": "bob"}
    keys.write_text("alice k1\nalice k2\n")
    with pytest.raises(ConfigError, match="unique"):
        settings.auth.keys()


def test_client_keys_gate_v1_name_the_client_and_stay_home(cluster: ClusterFactory) -> None:
    engines = [FakeEngine("a"), FakeEngine("b", models=("fwd",))]
    keys = [{"name": "alice", "key": "k-alice"}, {"name": "bob", "key": "k-bob"}]
    c = cluster(engines=engines, auth={"client_keys": keys})
    for headers, message in [
        ({}, "missing API key: send Authorization: Bearer <key> (or x-api-key: <key>)"),
        ({"authorization": "Bearer k-mallory"}, "incorrect API key provided"),
    ]:
        r = chat(c.url, "x", headers=headers)
        assert r.status_code == 401
        assert r.json() == {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
        assert httpx.get(c.url + "/v1/models", headers=headers).status_code == 401
    assert engines[0].requests == []
    r = chat(c.url, "x", headers={"authorization": "Bearer k-alice"})
    assert r.status_code == 200
    assert "authorization" not in engines[0].headers[-1]  # a gateway key is not the engine's business
    assert httpx.get(c.url + "/v1/models", headers={"authorization": "Bearer k-bob"}).status_code == 200
    assert httpx.get(c.url + "/healthz").status_code == 200  # outside /v1: no key needed
    lines = metric_lines(c.url, "warmroute_client_requests_total")
    assert sorted(lines) == [
        'warmroute_client_requests_total{client="alice"} 1.0',
        'warmroute_client_requests_total{client="bob"} 1.0',
    ]


def test_forward_client_key_when_the_backend_asks() -> None:
    engine = FakeEngine("a")
    with serve(engine.app()) as (url, _server):
        backends = [{"id": "a", "url": url, "models": ["m"], "forward_client_key": True}]
        settings = load_settings(
            None, backends=backends, auth={"client_keys": [{"name": "ci", "key": "k-ci"}]}
        )
        with serve(create_app(settings)) as (gw_url, _gw):
            assert chat(gw_url, "x", headers={"authorization": "Bearer k-ci"}).status_code == 200
    assert engine.headers[-1]["authorization"] == "Bearer k-ci"


def test_admin_port_serves_admin_only_and_only_there() -> None:
    engine = FakeEngine("a")
    with serve(engine.app()) as (url, _server):
        settings = load_settings(
            None,
            backends=[{"id": "a", "url": url, "models": ["m"]}],
            admin={"port": free_port(), "token": TOKEN},
        )
        auth = {"authorization": f"Bearer {TOKEN}"}
        with two_listeners(settings) as (api, admin):
            assert httpx.get(admin + "/admin/backends", headers=auth).status_code == 200
            on_api = httpx.get(api + "/admin/backends", headers=auth)
            assert on_api.status_code == 404
            assert "it is served on port" in on_api.json()["error"]["message"]
            assert httpx.get(admin + "/v1/models").status_code == 404
            assert httpx.get(admin + "/admin/backends").status_code == 401
            assert chat(api, "x").status_code == 200


def test_warmroute_serve_opens_the_admin_port(tmp_path: Path) -> None:
    engine = FakeEngine("a")
    with serve(engine.app()) as (url, _server):
        api_port, admin_port = free_port(), free_port()
        config = tmp_path / "warmroute.yaml"
        config.write_text(
            json.dumps(
                {
                    "server": {"log_level": "warning"},
                    "backends": [{"id": "a", "url": url, "models": ["m"]}],
                    "admin": {"port": admin_port},  # no token: served because both listeners are loopback
                }
            )
        )
        args = python("-m", "gateway.cli", "serve", "--config", str(config), "--port", str(api_port))
        with child(args, stdout=None, stderr=None, cwd=ROOT, group=True) as proc:
            api, admin = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{admin_port}"
            wait_http(api + "/readyz", ok, timeout_s=30, process=proc)
            assert httpx.get(admin + "/admin/backends").json()["backends"][0]["state"] == "ready"
            assert httpx.get(api + "/admin/backends").status_code == 404
            assert chat(api, "x").status_code == 200


def test_protected_metrics_need_the_admin_token(cluster: ClusterFactory) -> None:
    keys = [{"name": "alice", "key": "k-alice"}]
    c = cluster(["a"], admin={"token": TOKEN, "protect_metrics": True}, auth={"client_keys": keys})
    for path in ("/metrics", "/metrics/"):
        r = httpx.get(c.url + path)
        assert (r.status_code, r.headers["www-authenticate"]) == (401, "Bearer"), path
        assert r.json() == {
            "error": {
                "message": "/metrics needs Authorization: Bearer <admin token>",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
        assert "alice" not in r.text
    wrong = httpx.get(
        c.url + "/metrics", headers={"authorization": "Bearer k-alice"}
    )  # a client key is not it
    assert (wrong.status_code, wrong.json()["error"]["message"]) == (401, "the admin token is not valid")
    ok = httpx.get(c.url + "/metrics", headers={"authorization": f"Bearer {TOKEN}"})
    assert ok.status_code == 200
    assert 'warmroute_client_requests_total{client="alice"} 0.0' in ok.text.splitlines()
    assert (
        httpx.get(c.url + "/healthz").status_code == 200 and httpx.get(c.url + "/readyz").status_code == 200
    )


def test_metrics_stay_open_by_default(cluster: ClusterFactory, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="warmroute.auth"):
        c = cluster(["a"], admin={"token": TOKEN})
        protected = cluster(
            ["a"], admin={"token": TOKEN, "protect_metrics": True, "protect_readyz_detail": True}
        )
    assert httpx.get(c.url + "/metrics").status_code == 200
    assert httpx.get(protected.url + "/metrics").status_code == 401
    assert [rec.getMessage() for rec in caplog.records if rec.name == "warmroute.auth"] == [
        "admin API on 127.0.0.1 (the API port): bearer token required",
        "admin API on 127.0.0.1 (the API port): bearer token required; also for /metrics and /readyz detail",
    ]


def test_an_empty_token_file_with_a_protect_option_cannot_start(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("\n")
    settings = load_settings(None, admin={"token_file": str(token), "protect_metrics": True})
    with pytest.raises(ConfigError, match="need an admin token; none is set"):
        create_app(settings)


class _Inner:
    """The app behind the guard: records whether anything reached it."""

    def __init__(self) -> None:
        self.scopes: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scopes.append(scope["type"])


def _guard(inner: _Inner) -> AccessGuard:
    access = AdminAccess.from_settings(load_settings(None, admin={"token": TOKEN}))
    return AccessGuard(inner, access, ClientKeys({}), {})


@pytest.mark.anyio
async def test_a_websocket_is_closed_before_the_app_sees_it(caplog: pytest.LogCaptureFixture) -> None:
    inner, sent = _Inner(), []

    async def receive() -> Message:
        return {"type": "websocket.connect"}

    async def send(message: Message) -> None:
        sent.append(message)

    with caplog.at_level(logging.INFO, logger="warmroute.auth"):
        for path in ("/admin/backends", "/v1/chat/completions"):
            await _guard(inner)({"type": "websocket", "path": path, "headers": []}, receive, send)
    assert sent == [{"type": "websocket.close", "code": 1008, "reason": ""}] * 2  # the server answers 403
    assert inner.scopes == []
    assert [rec.getMessage() for rec in caplog.records if rec.name == "warmroute.auth"] == [
        "websocket '/admin/backends' refused: this gateway serves no websockets",
        "websocket '/v1/chat/completions' refused: this gateway serves no websockets",
    ]


@pytest.mark.anyio
async def test_lifespan_passes_and_an_unknown_scope_type_is_an_error() -> None:
    inner = _Inner()

    async def receive() -> Message:
        raise AssertionError("not read")

    async def send(message: Message) -> None:
        raise AssertionError(f"nothing is sent: {message}")

    await _guard(inner)({"type": "lifespan"}, receive, send)
    assert inner.scopes == ["lifespan"]
    with pytest.raises(RuntimeError, match="unsupported ASGI scope type 'webtransport'"):
        await _guard(inner)({"type": "webtransport", "path": "/admin"}, receive, send)
    assert inner.scopes == ["lifespan"]
