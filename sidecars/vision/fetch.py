"""Fetching an image from a client-supplied URL, which is hostile input.

DNS rebinding cannot slip between the check and the connect because there is no gap: httpx never resolves
a name itself. Its connection pool's network backend is ``GuardedBackend``, whose ``connect_tcp`` resolves
the host once, checks every address it got against the ``AddressPolicy`` and dials the checked IP literal
(TLS still verifies the original host name: httpcore passes it as the SNI/server name). Every connection,
including each redirect hop's, goes through it. Environment proxies are ignored (``trust_env=False``): a
proxy would resolve the name on our behalf, out of reach of the policy.
"""

from __future__ import annotations

import asyncio
import binascii
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import anyio
import httpcore
import httpx

from .addresses import AddressPolicy
from .errors import FetchFailed, FetchTimeout, InvalidImageURL, TooLarge, UnsupportedScheme
from .settings import VisionSettings

Resolver = Callable[[str, int], Awaitable[list[str]]]
REDIRECTS = frozenset({301, 302, 303, 307, 308})
INLINE_DECODE = 256 * 1024  # a data: URI longer than this is decoded on a worker thread, off the event loop


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True, slots=True)
class Fetched:
    data: bytes
    content_type: str | None  # None for a data: URI without a media type


class GuardedBackend(httpcore.AsyncNetworkBackend):
    """Resolve once, check every address, dial the checked literal: the only way out of this process."""

    def __init__(self, policy: AddressPolicy, resolver: Resolver) -> None:
        self.policy = policy
        self.resolver = resolver
        self.inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore names it)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        addresses = await self._resolve(host, port)
        for address in addresses:
            self.policy.check(host, address)
        last: Exception | None = None
        for address in addresses:
            try:
                return await self.inner.connect_tcp(address, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None
        raise last

    async def _resolve(self, host: str, port: int) -> list[str]:
        try:
            ipaddress.ip_address(host)
            return [host]
        except ValueError:
            pass
        try:
            addresses = await self.resolver(host, port)
        except (OSError, UnicodeError) as exc:  # the IDNA codec's UnicodeError: a name no DNS can carry
            raise FetchFailed(f"image URL host {host} does not resolve: {exc}") from None
        if not addresses:
            raise FetchFailed(f"image URL host {host} does not resolve")
        return addresses

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise FetchFailed("unix sockets are never dialled for images")

    async def sleep(self, seconds: float) -> None:
        await self.inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's own transport (its exception mapping too) over a pool that dials through GuardedBackend."""

    def __init__(self, backend: GuardedBackend) -> None:
        super().__init__(retries=0)
        # httpx 0.28 has no network_backend argument; the pool is rebuilt with ours (pinned <0.29).
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl.create_default_context(),
            network_backend=backend,
            max_connections=32,
            max_keepalive_connections=8,
        )


def decode_data_uri(uri: str, max_bytes: int) -> Fetched:
    """``data:[<media type>];base64,<payload>``, its decoded size bounded before decoding (strict base64 has
    exactly 3 bytes per 4 characters). A percent-encoded payload is refused: an image is binary, and 9.3 M
    ``%41`` (28 MB, inside the body limit) took 2 s of the event loop and 2.1 GB to decode."""
    comma = uri.find(",", 5)
    if comma < 0:
        raise UnsupportedScheme("malformed data: URI (no comma)")
    params = uri[5:comma].split(";")
    media_type = params[0].strip().lower() or None
    if "base64" not in (p.strip().lower() for p in params[1:]):
        raise UnsupportedScheme("data: URI images must be base64 (data:<type>;base64,<data>)")
    payload = uri[comma + 1 :]
    if len(payload) * 3 // 4 > max_bytes + 3:
        raise TooLarge(f"image is larger than the {max_bytes}-byte limit")
    try:
        data = binascii.a2b_base64(payload, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        raise UnsupportedScheme(f"data: URI is not valid base64: {exc}") from exc
    if len(data) > max_bytes:
        raise TooLarge(f"image is larger than the {max_bytes}-byte limit")
    return Fetched(data, media_type)


def check_unicode(url: str) -> None:
    """InvalidImageURL for a lone surrogate: JSON can carry one, no URL or base64 text does."""
    if url.isascii():  # O(1)
        return
    try:
        url.encode()
    except UnicodeEncodeError as exc:
        char = f"\\u{ord(url[exc.start]):04x}"
        raise InvalidImageURL(f"image URL holds a lone surrogate ({char} at position {exc.start})") from None


class ImageFetcher:
    def __init__(self, settings: VisionSettings, resolver: Resolver = system_resolver) -> None:
        self.settings = settings
        backend = GuardedBackend(AddressPolicy(settings.allow_networks), resolver)
        timeout = httpx.Timeout(settings.fetch_timeout_s, connect=settings.connect_timeout_s)
        self.client = httpx.AsyncClient(
            transport=GuardedTransport(backend),
            trust_env=False,
            follow_redirects=False,  # each hop is checked here, then dialled through the guarded backend
            timeout=timeout,
            # identity: the body is read raw, so a gzip bomb is never inflated (it fails the magic check).
            headers={"user-agent": "warmroute-vision/1", "accept": "image/*", "accept-encoding": "identity"},
        )

    async def aclose(self) -> None:
        await self.client.aclose()

    async def fetch(self, url: str) -> Fetched:
        check_unicode(url)
        if url[:5].lower() == "data:":
            if len(url) <= INLINE_DECODE:
                return decode_data_uri(url, self.settings.max_download_bytes)
            return await anyio.to_thread.run_sync(decode_data_uri, url, self.settings.max_download_bytes)
        try:
            async with asyncio.timeout(self.settings.fetch_timeout_s):
                return await self._fetch_http(url)
        except TimeoutError as exc:
            raise FetchTimeout(
                f"image download did not finish within {self.settings.fetch_timeout_s:g} s"
            ) from exc
        except httpx.TimeoutException as exc:
            raise FetchTimeout(f"image download timed out: {type(exc).__name__}") from exc
        except httpx.HTTPError as exc:
            raise FetchFailed(f"image download failed: {type(exc).__name__}: {exc}") from exc

    async def _fetch_http(self, url_text: str) -> Fetched:
        url = checked_url(url_text)
        for _hop in range(self.settings.max_redirects + 1):
            async with self.client.stream("GET", url) as response:
                if response.status_code in REDIRECTS and "location" in response.headers:
                    url = checked_url(response.headers["location"], base=url)
                    continue
                if response.status_code != 200:
                    raise FetchFailed(f"image server answered HTTP {response.status_code} for {url}")
                return Fetched(await self._body(response), response.headers.get("content-type"))
        raise FetchFailed(f"more than {self.settings.max_redirects} redirects fetching the image")

    async def _body(self, response: httpx.Response) -> bytes:
        limit = self.settings.max_download_bytes
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise TooLarge(f"image is {declared} bytes; the limit is {limit}")
        chunks, size = [], 0
        async for chunk in response.aiter_raw():
            size += len(chunk)
            if size > limit:
                raise TooLarge(f"image is larger than the {limit}-byte limit")
            chunks.append(chunk)
        return b"".join(chunks)


def checked_url(text: str, base: httpx.URL | None = None) -> httpx.URL:
    """``text`` (a redirect's Location: against ``base``) as an http(s) URL whose host can be looked up."""
    check_unicode(text)
    try:
        url = base.join(text) if base is not None else httpx.URL(text)
    except (httpx.InvalidURL, UnicodeError) as exc:  # idna's errors are UnicodeErrors
        raise InvalidImageURL(f"invalid image URL: {exc}") from None
    if url.scheme not in ("http", "https"):
        shown = url.scheme or "(none)"
        raise UnsupportedScheme(f"image URL scheme {shown!r} is not allowed; use http(s) or a data: URI")
    if not url.host:
        raise UnsupportedScheme("image URL has no host")
    _check_name(url)
    return url


def _check_name(url: httpx.URL) -> None:
    """RFC 1035 limits on a host name, which the resolver's IDNA codec raises UnicodeError for otherwise."""
    try:
        ipaddress.ip_address(url.host)
        return
    except ValueError:
        pass
    name = url.raw_host.decode("ascii", "replace").removesuffix(".")  # IDNA: the bytes DNS would carry
    labels = name.split(".")
    if any(not label for label in labels):
        raise InvalidImageURL(f"image URL host {name!r} is not a DNS name: it has an empty label")
    if any(len(label) > 63 for label in labels) or len(name) > 253:
        raise InvalidImageURL(
            f"image URL host {name[:80]!r} is not a DNS name: a label over 63 bytes or 253 in all"
        )
