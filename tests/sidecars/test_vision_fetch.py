"""Image URLs are hostile input: the address policy holds after DNS and on every redirect; limits hold while
streaming; the connection goes to the very address that was checked."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import time
from collections.abc import Iterator
from typing import Any

import pytest
from vision_deps import require_vision

require_vision()
pytestmark = pytest.mark.needs("vision")

from image_server import ImageServer  # noqa: E402
from vision_images import png_bytes  # noqa: E402

from sidecars.vision import addresses  # noqa: E402
from sidecars.vision.errors import (  # noqa: E402
    FetchFailed,
    FetchTimeout,
    ForbiddenAddress,
    InvalidImageURL,
    TooLarge,
    UnsupportedScheme,
)
from sidecars.vision.fetch import ImageFetcher, Resolver  # noqa: E402
from sidecars.vision.settings import VisionSettings  # noqa: E402

from upstreams import serve  # noqa: E402

PNG = png_bytes(32, 32)


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ImageServer]]:
    images = ImageServer(PNG)
    with serve(images.app()) as (url, _server):
        yield url, images


def fetch(url: str, resolver: Resolver | None = None, **overrides: Any) -> Any:
    settings = VisionSettings(checkpoint="/nonexistent", **overrides)

    async def run() -> Any:
        fetcher = ImageFetcher(settings, resolver) if resolver else ImageFetcher(settings)
        try:
            return await fetcher.fetch(url)
        finally:
            await fetcher.aclose()

    return asyncio.run(run())


def resolver_to(address: str, calls: list[str]) -> Resolver:
    async def resolve(host: str, port: int) -> list[str]:
        calls.append(host)
        return [address]

    return resolve


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("127.8.9.10", "loopback"),
        ("::1", "loopback"),
        ("::ffff:127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("fd12:3456::1", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("fd00:ec2::254", "metadata"),
        ("100.100.100.200", "metadata"),
        ("100.64.0.1", "not globally routable"),
        ("0.0.0.0", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("8.8.8.8", None),
        ("2606:4700::1111", None),
        # 6to4 is judged by the IPv4 address it embeds; site-local (deprecated) is not public either
        ("2002:7f00:1::", "6to4 loopback"),
        ("2002:a9fe:a9fe::", "6to4 link-local"),
        ("2002:a00:1::1", "6to4 private"),
        ("2002:6464:64c8::", "6to4 metadata"),
        ("2002::", "6to4 unspecified"),
        ("2002:808:808::1", None),
        ("fec0::1", "site-local"),
    ],
)
def test_address_classes(address: str, reason: str | None) -> None:
    assert addresses.classify(ipaddress.ip_address(address)) == reason


def test_a_loopback_literal_is_refused_without_connecting(server: tuple[str, ImageServer]) -> None:
    url, images = server
    before = len(images.paths)
    with pytest.raises(ForbiddenAddress, match=r"image URL host 127\.0\.0\.1 is a loopback address; refused"):
        fetch(f"{url}/img.png")
    assert len(images.paths) == before


@pytest.mark.parametrize(
    "url", ["http://10.0.0.7/x.png", "http://[::1]:9/x.png", "http://169.254.169.254/latest"]
)
def test_private_link_local_and_metadata_literals_are_refused(url: str) -> None:
    with pytest.raises(ForbiddenAddress, match=r"is a (private|loopback|link-local) address; refused"):
        fetch(url)


def test_a_name_resolving_to_loopback_is_refused_and_the_message_names_both() -> None:
    calls: list[str] = []
    with pytest.raises(ForbiddenAddress, match=r"images\.example \(127\.0\.0\.1\) is a loopback address"):
        fetch("http://images.example/cat.png", resolver_to("127.0.0.1", calls))
    assert calls == ["images.example"]


def test_the_name_is_resolved_once_and_the_checked_address_is_dialled(
    server: tuple[str, ImageServer],
) -> None:
    """DNS rebinding has no second lookup to poison: one resolution per connection, that address dialled."""
    url, images = server
    port = url.rsplit(":", 1)[1]
    answers = iter([["127.0.0.1"], ["10.0.0.1"]])  # a rebinding resolver: the second answer is private
    calls: list[str] = []

    async def rebinding(host: str, _port: int) -> list[str]:
        calls.append(host)
        return next(answers)

    got = fetch(f"http://images.example:{port}/img.png", rebinding, allow_networks=["127.0.0.1/32"])
    assert got.data == PNG and got.content_type == "image/png"
    assert calls == ["images.example"] and images.hosts[-1] == f"images.example:{port}"


def test_a_redirect_to_a_private_address_is_refused(server: tuple[str, ImageServer]) -> None:
    url, images = server
    with pytest.raises(ForbiddenAddress, match=r"10\.0\.0\.1 is a private address"):
        fetch(f"{url}/redirect?to=http://10.0.0.1/img.png", allow_networks=["127.0.0.1/32"])
    assert images.paths[-1] == "/redirect"


def test_a_redirect_to_a_name_resolving_to_loopback_is_refused(server: tuple[str, ImageServer]) -> None:
    url, _images = server
    calls: list[str] = []
    resolver = resolver_to("127.0.0.2", calls)  # loopback, but outside the allowed 127.0.0.1/32
    with pytest.raises(ForbiddenAddress, match=r"evil\.example \(127\.0\.0\.2\) is a loopback address"):
        fetch(f"{url}/redirect?to=http://evil.example/img.png", resolver, allow_networks=["127.0.0.1/32"])
    assert calls == ["evil.example"]


def test_a_redirect_to_file_is_refused(server: tuple[str, ImageServer]) -> None:
    url, _images = server
    with pytest.raises(UnsupportedScheme, match=r"scheme 'file' is not allowed"):
        fetch(f"{url}/redirect?to=file:///etc/passwd", allow_networks=["127.0.0.1/32"])


def test_redirects_are_bounded(server: tuple[str, ImageServer]) -> None:
    url, _images = server
    loop = f"{url}/redirect?to={url}/redirect?to={url}/img.png"
    with pytest.raises(FetchFailed, match=r"more than 1 redirects"):
        fetch(loop, allow_networks=["127.0.0.1/32"], max_redirects=1)
    assert fetch(loop, allow_networks=["127.0.0.1/32"], max_redirects=2).data == PNG


@pytest.mark.parametrize(
    "url", ["file:///etc/passwd", "ftp://example.com/a.png", "gopher://x/", "/relative.png"]
)
def test_other_schemes_are_refused(url: str) -> None:
    with pytest.raises(UnsupportedScheme, match=r"is not allowed; use http\(s\) or a data: URI"):
        fetch(url)


def test_an_oversize_download_stops_while_streaming(server: tuple[str, ImageServer]) -> None:
    url, _images = server
    with pytest.raises(TooLarge, match=r"larger than the 1000000-byte limit"):
        fetch(f"{url}/big.png", allow_networks=["127.0.0.1/32"], max_download_bytes=1_000_000)


def test_a_declared_oversize_download_is_refused_before_the_body(server: tuple[str, ImageServer]) -> None:
    url, _images = server
    with pytest.raises(TooLarge, match=rf"image is {len(PNG)} bytes; the limit is 100"):
        fetch(f"{url}/img.png", allow_networks=["127.0.0.1/32"], max_download_bytes=100)


def test_a_slow_download_times_out(server: tuple[str, ImageServer]) -> None:
    url, _images = server
    started = time.monotonic()
    with pytest.raises(FetchTimeout, match=r"did not finish within 0\.5 s"):
        fetch(f"{url}/slow.png", allow_networks=["127.0.0.1/32"], fetch_timeout_s=0.5)
    assert time.monotonic() - started < 5  # the whole download takes 12 s; 4.5 s allows a loaded machine


def test_an_error_status_is_a_fetch_failure(server: tuple[str, ImageServer]) -> None:
    url, _images = server
    with pytest.raises(FetchFailed, match=r"image server answered HTTP 404"):
        fetch(f"{url}/missing.png", allow_networks=["127.0.0.1/32"])


def test_environment_proxies_are_ignored(
    server: tuple[str, ImageServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, _images = server
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY"):
        monkeypatch.setenv(name, "http://127.0.0.1:9")  # a proxy would resolve names out of our reach
    assert fetch(f"{url}/img.png", allow_networks=["127.0.0.1/32"]).data == PNG


def test_data_uris_decode_within_the_size_limit() -> None:
    uri = "data:image/png;base64," + base64.b64encode(PNG).decode()
    got = fetch(uri)
    assert got.data == PNG and got.content_type == "image/png"
    with pytest.raises(TooLarge, match=r"100-byte limit"):
        fetch(uri, max_download_bytes=100)
    with pytest.raises(UnsupportedScheme, match=r"not valid base64"):
        fetch("data:image/png;base64,%%%")


def test_a_redirect_to_a_url_that_is_no_url_is_a_400(server: tuple[str, ImageServer]) -> None:
    url, _images = server
    with pytest.raises(InvalidImageURL, match=r"host 'a\.\.b\.test' is not a DNS name: it has an empty"):
        fetch(f"{url}/redirect?to=http://a..b.test/x.png", allow_networks=["127.0.0.1/32"])


def test_a_percent_encoded_data_uri_is_refused() -> None:
    with pytest.raises(UnsupportedScheme, match=r"data: URI images must be base64"):
        fetch("data:image/png,%89PNG")
