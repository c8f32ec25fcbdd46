"""Hostile image references at the sidecar's HTTP edge, without a model: each is a clear 4xx (or a 503 for a
full queue) in the error shape, one log line and no traceback, and nothing is fetched or decoded first."""

from __future__ import annotations

import base64
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpcore
import httpx
import pytest
from vision_deps import require_vision

require_vision()
pytestmark = pytest.mark.needs("vision")

from image_server import ImageServer  # noqa: E402
from vision_images import png_bytes  # noqa: E402

from sidecars.vision.app import create_app  # noqa: E402
from sidecars.vision.errors import BadImage  # noqa: E402
from sidecars.vision.fetch import Resolver, system_resolver  # noqa: E402
from sidecars.vision.settings import VisionSettings  # noqa: E402

from upstreams import serve  # noqa: E402

PNG = png_bytes(8, 8)


@dataclass
class StubEncoder:
    """Stands in for the tower: the first encode waits for ``release``, then every encode refuses (422)."""

    fingerprint: str = "stub"
    report: Any = field(default_factory=lambda: SimpleNamespace(bytes_read=0, checkpoint_bytes=0))
    entered: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def encode(self, image: Any) -> Any:
        self.entered.set()
        assert self.release.wait(30)
        raise BadImage("the stub tower encodes nothing")


Start = Callable[..., str]


@pytest.fixture
def sidecar(monkeypatch: pytest.MonkeyPatch) -> Iterator[Start]:
    """``sidecar(resolver=..., encoder=..., **settings)`` → the URL of a served app, ready at once. Should a
    check regress, its fetcher still dials nothing but 127.0.0.1."""
    dial = httpcore.AnyIOBackend.connect_tcp

    async def loopback_only(self: Any, host: str, port: int, *args: Any, **kwargs: Any) -> Any:
        if host != "127.0.0.1":
            raise httpcore.ConnectError(f"the test refuses to dial {host}")
        return await dial(self, host, port, *args, **kwargs)

    monkeypatch.setattr(httpcore.AnyIOBackend, "connect_tcp", loopback_only)
    with contextlib.ExitStack() as stack:

        def start(resolver: Resolver = system_resolver, encoder: Any = None, **overrides: Any) -> str:
            stub = encoder or StubEncoder()
            settings = VisionSettings(checkpoint="/nonexistent", **overrides)
            app = create_app(settings, resolver, lambda _s: stub)
            app.state.service.ready(stub)  # no load to wait for (the lifespan's load hands over the same)
            url, _server = stack.enter_context(serve(app))
            return url

        yield start


@pytest.fixture
def log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger="warmroute.vision")
    return caplog


def post(url: str, image_json: str) -> httpx.Response:
    """``image_json``: the JSON text of the ``image`` field, so that escapes (a lone surrogate) go as sent."""
    body = '{"image": ' + image_json + "}"
    return httpx.post(f"{url}/v1/encode", content=body.encode(), timeout=30)


def refused(resp: httpx.Response, status: int, code: str, log: pytest.LogCaptureFixture) -> str:
    """The refusal's message, after checking its shape, its metric and its one log line."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "code"} and error["code"] == code, error
    assert not [r for r in log.records if r.exc_info]
    assert logged(log) == [f"refused an encode: {status} {code}: {error['message']}"]
    message: str = error["message"]
    return message


def logged(log: pytest.LogCaptureFixture) -> list[str]:
    """The sidecar's log lines, less the load report (logged once the stub is handed over)."""
    lines = [r.getMessage() for r in log.records if r.name.startswith("warmroute.vision")]
    return [line for line in lines if not line.startswith("vision tower ready")]


def rejections(url: str, code: str) -> str:
    line = f'warmroute_vision_rejections_total{{reason="{code}"}}'
    return next((ln for ln in httpx.get(f"{url}/metrics").text.splitlines() if ln.startswith(line)), "")


def test_a_percent_encoded_data_uri_is_refused_before_decoding(sidecar: Start, log: Any) -> None:
    """9.3 M ``%41`` (28 MB, inside both body limits) decoded on the event loop: 2 s blocked, +2.1 GB, and the
    gateway's health probe marked the sidecar down meanwhile."""
    url = sidecar()
    resp = post(url, '"data:image/png,' + "%41" * 9_300_000 + '"')
    message = refused(resp, 400, "image_url_scheme", log)
    assert message == "data: URI images must be base64 (data:<type>;base64,<data>)"
    assert rejections(url, "image_url_scheme").endswith(" 1.0")


def test_a_request_is_admitted_before_its_image_is_fetched_or_decoded(sidecar: Start, log: Any) -> None:
    """With the tower busy and no queue, the next image is refused before any download or decode."""
    images = ImageServer(PNG)
    with serve(images.app()) as (images_url, _server):
        stub = StubEncoder()
        url = sidecar(encoder=stub, queue_size=0, allow_networks=["127.0.0.1/32"])
        first: dict[str, httpx.Response] = {}
        data_uri = "data:image/png;base64," + base64.b64encode(PNG).decode()
        worker = threading.Thread(target=lambda: first.update(r=post(url, f'"{data_uri}"')))
        worker.start()
        assert stub.entered.wait(10)
        resp = post(url, f'"{images_url}/img.png"')
        stub.release.set()
        worker.join(30)
    assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_full"
    assert images.paths == []  # never fetched
    assert first["r"].status_code == 422
    assert logged(log) == [
        "refused an encode: 503 queue_full: encoder queue is full (0 waiting, limit 0); retry later",
        "refused an encode: 422 image_invalid: the stub tower encodes nothing",
    ]
    assert "warmroute_vision_queue_depth 0.0" in httpx.get(f"{url}/metrics").text


@pytest.mark.parametrize(
    ("image", "says"),
    [
        ('"http://a..b.test/x.png"', "image URL host 'a..b.test' is not a DNS name: it has an empty label"),
        (
            '"http://' + "a" * 64 + '.test/x.png"',
            f"image URL host '{'a' * 64}.test' is not a DNS name: a label over 63 bytes or 253 in all",
        ),
        ('"http://images.test/\\udc80.png"', "image URL holds a lone surrogate (\\udc80 at position 19)"),
        ('"data:image/png;base64,iVBO\\ud800"', "image URL holds a lone surrogate (\\ud800 at position 26)"),
    ],
    ids=["empty-label", "long-label", "surrogate-in-path", "surrogate-in-data-uri"],
)
def test_a_url_that_is_no_url_is_a_400_naming_the_problem(
    sidecar: Start, log: Any, image: str, says: str
) -> None:
    """Each raised UnicodeError out of the fetcher: a 500 with a traceback."""
    resolved: list[str] = []

    async def resolver(host: str, port: int) -> list[str]:
        resolved.append(host)
        host.encode("idna")  # as getaddrinfo does first: "label empty or too long" was a UnicodeError
        return ["127.0.0.1"]  # refused by the address policy: never dialled either way

    url = sidecar(resolver)
    assert refused(post(url, image), 400, "image_url_invalid", log) == says
    assert resolved == []


@pytest.mark.parametrize(
    ("image", "answer", "says"),
    [
        ("http://[2002:7f00:1::]/a.png", None, "2002:7f00:1:: is a 6to4 loopback address"),
        (
            "http://meta.test/a.png",
            "2002:a9fe:a9fe::",
            "meta.test (2002:a9fe:a9fe::) is a 6to4 link-local address",
        ),
        ("http://[fec0::1]/a.png", None, "fec0::1 is a site-local address"),
    ],
    ids=["6to4-loopback", "6to4-metadata-by-name", "site-local"],
)
def test_6to4_and_site_local_addresses_are_refused(
    sidecar: Start, log: Any, image: str, answer: str | None, says: str
) -> None:
    async def resolver(host: str, port: int) -> list[str]:
        assert answer is not None, f"a literal is not resolved ({host})"
        return [answer]

    url = sidecar(resolver)
    message = refused(post(url, f'"{image}"'), 403, "image_url_forbidden", log)
    assert message == f"image URL host {says}; refused"


@pytest.mark.parametrize(
    "body", [b"[" * 100_000 + b"]" * 100_000, b'{"image": "' + b"A" * 300_000 + b'"'], ids=["deep", "long"]
)
def test_a_body_nesting_past_the_parser_or_cut_short_is_a_400(sidecar: Start, log: Any, body: bytes) -> None:
    """Deep nesting raised RecursionError out of json.loads (a 500); a long body is parsed off the loop."""
    url = sidecar()
    resp = httpx.post(f"{url}/v1/encode", content=body, timeout=30)
    assert refused(resp, 400, "invalid_request", log).startswith("request body is not JSON: ")
