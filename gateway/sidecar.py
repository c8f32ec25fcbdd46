"""The vision sidecar as the gateway sees it: its lifecycle (``SidecarHost``) and its encode call
(``SidecarClient``).

The sidecar (sidecars/vision/) is a separate service: ``POST /v1/encode {"image": url}`` answers base64
``torch.save`` tensors ``image_embeds`` ``[n, hidden]`` and ``image_grid_thw`` ``[3]``. The gateway either
points at one (``sidecar.url``) or starts it (``sidecar.managed``); either way one ``BackendController`` — the
managed engines' lifecycle — owns its state, fed by health probes on ``/health``, so a managed sidecar is
restarted with the same grace, backoff and cap, its exits are kept with their cause and last lines, and it is
stopped on shutdown. It has no canary (nothing to ask it but an image).

What an answer means to the client (every refusal names the sidecar):
- the sidecar is not up, refuses connections, or does not answer within ``timeout_s``: 503;
- it refuses the image (4xx): the same status with its message (a bad image is the client's);
- it is busy (429/503, its queue is full): 503;
- anything else (5xx, malformed answer, ``image_grid_thw`` not of shape ``[3]``): 502. vLLM answers a
  ``[1, 3]`` grid with a bare 400 that names neither the sidecar nor the image, so that never goes upstream.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
from dataclasses import dataclass
from typing import Any

import httpx

from backends.canary import CanaryResult
from backends.changes import ChangeKind, Changes
from backends.events import ProbeFailed, ProbeOk
from backends.health import HealthChecker
from backends.managed import BackendController, policy_for
from backends.registry import Backend, Registry
from config.settings import BackendConfig, Settings, SidecarConfig
from gateway.errors import BadRequest, UpstreamError
from gateway.torchfile import NotATensor, read_header
from routing.types import BackendState

SIDECAR_ID = "vision-sidecar"
ENCODE_PATH = "/v1/encode"


class VisionUnavailable(UpstreamError):
    """The sidecar cannot encode now (down, starting, unreachable, too slow, its queue full)."""

    status = 503
    code = "vision_unavailable"


class VisionSidecarError(UpstreamError):
    """The sidecar answered something an engine must not see."""

    status = 502
    code = "vision_sidecar_error"


class ImageRejected(BadRequest):
    """The sidecar refused the image (not an image, too large, a forbidden URL...): its 4xx, as it said."""

    code = "invalid_image"

    def __init__(self, message: str, status: int, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        if code:
            self.code = code


@dataclass(frozen=True, slots=True)
class Encoding:
    """One image as an ``image_embeds`` content part needs it: raw base64, no ``data:`` prefix."""

    image_embeds: str
    image_grid_thw: str
    tokens: int
    cached: bool


async def _no_canary() -> CanaryResult:
    return CanaryResult(True, None, None, "the vision sidecar has no canary: a healthy probe admits it")


class SidecarHost:
    """The sidecar's lifecycle: ``start()`` and ``aclose()`` in the app's lifespan."""

    def __init__(self, cfg: SidecarConfig, settings: Settings, client: httpx.AsyncClient) -> None:
        self.cfg = cfg
        # The lifecycle reads a backend's config; the sidecar's is only its URL and managed block.
        backend_cfg = BackendConfig(id=SIDECAR_ID, url=cfg.url, models=(SIDECAR_ID,), managed=cfg.managed)
        #: Announced on every change of its state or availability (the exit of a managed sidecar included:
        #: it is an outage): ``changes.wait(predicate, within)`` re-checks what it reads after each one.
        self.changes = Changes()
        self.controller = BackendController(
            SIDECAR_ID,
            policy_for(backend_cfg, settings.health, settings.canary),
            _no_canary,
            managed=cfg.managed,
            on_change=lambda lc: self.changes.notify(ChangeKind.STATE, SIDECAR_ID, lc.state.value),
        )
        self._backend = Backend(backend_cfg)
        health = settings.health.model_copy(update={"path": "/health"})
        self._health = HealthChecker(Registry(()), client, health, self)

    def start(self) -> None:
        self.controller.start()
        self._health.watch(self._backend)

    async def check(self, timeout_s: float = 5.0) -> None:
        """One probe now (start-up), so an external sidecar that is up serves the first image request: its
        (empty) canary runs as a task, which this waits for."""
        await self._health.check(self._backend)
        with contextlib.suppress(TimeoutError):
            await self.changes.wait(
                lambda: self.controller.lifecycle.state is not BackendState.CANARY, timeout_s
            )

    def probed(self, backend_id: str, error: str | None) -> None:
        self.controller.send(ProbeOk() if error is None else ProbeFailed(error))

    @property
    def available(self) -> bool:
        return self.controller.lifecycle.routable

    @property
    def state(self) -> str:
        return self.controller.lifecycle.state.value

    def describe(self) -> str:
        """``ready``, or the state and why (``down (connect failed: ...)``, ``starting (...)``)."""
        lc = self.controller.lifecycle
        if lc.routable:
            return lc.state.value
        return lc.state.value + (f" ({lc.reason})" if lc.reason else "")

    def unreachable(self, error: str) -> None:
        """A refused connection on a real encode: conclusive, as for engines (``Fleet.unreachable``)."""
        for _ in range(self.controller.policy.fail_threshold):
            self.controller.send(ProbeFailed(error))

    def status(self) -> dict[str, Any]:
        return {"url": self.cfg.url, **self.controller.status()}

    async def aclose(self) -> None:
        await self._health.aclose()
        await self.controller.aclose()  # a managed sidecar: stop command or SIGTERM, then SIGKILL


class SidecarClient:
    """``encode(image)``: at most ``max_parallel`` at once from this process, each within ``timeout_s``."""

    def __init__(self, cfg: SidecarConfig, client: httpx.AsyncClient, host: SidecarHost) -> None:
        self.cfg = cfg
        self.client = client
        self.host = host
        self.calls = 0  # encodes sent (tests and status read it)
        self._slots = asyncio.Semaphore(cfg.max_parallel)
        self._timeout = httpx.Timeout(cfg.timeout_s, connect=cfg.connect_timeout_s)

    async def encode(self, image: str) -> Encoding:
        url = self.cfg.url
        if not self.host.available:
            raise VisionUnavailable(f"vision sidecar {url} is not available: {self.host.describe()}")
        try:
            async with asyncio.timeout(self.cfg.timeout_s):  # waiting for a slot included
                async with self._slots:
                    self.calls += 1
                    resp = await self.client.post(
                        url + ENCODE_PATH, content=_encode_body(image), headers=_JSON, timeout=self._timeout
                    )
        except TimeoutError:
            raise VisionUnavailable(
                f"vision sidecar {url} did not encode the image within {self.cfg.timeout_s:g}s"
            ) from None
        except httpx.TimeoutException:
            raise VisionUnavailable(f"vision sidecar {url} timed out") from None
        except httpx.ConnectError as exc:
            self.host.unreachable(f"connect failed: {exc}")
            raise VisionUnavailable(f"vision sidecar {url} is unreachable") from None
        except httpx.HTTPError as exc:
            raise VisionSidecarError(f"vision sidecar {url} failed: {type(exc).__name__}: {exc}") from None
        return _answer(url, resp)


_JSON = {"content-type": "application/json"}


def _encode_body(image: str) -> bytes:
    """ASCII JSON (httpx's ``json=`` is UTF-8, which a lone surrogate in the URL cannot be encoded in)."""
    return json.dumps({"image": image}).encode("ascii")


def _answer(url: str, resp: httpx.Response) -> Encoding:
    status = resp.status_code
    if status == 200:
        return _encoding(url, resp)
    message, code = _error_of(resp)
    if status in (429, 503):
        raise VisionUnavailable(f"vision sidecar {url} is busy: {message}")
    if 400 <= status < 500:
        raise ImageRejected(message, status, code)
    raise VisionSidecarError(f"vision sidecar {url} answered HTTP {status}: {message}")


def _error_of(resp: httpx.Response) -> tuple[str, str | None]:
    try:
        error = resp.json()["error"]
        message, code = error["message"], error.get("code")
        if isinstance(message, str):
            return message, code if isinstance(code, str) else None
    except (ValueError, KeyError, TypeError):
        pass
    return resp.text[:300] or f"HTTP {resp.status_code}", None


def _encoding(url: str, resp: httpx.Response) -> Encoding:
    try:
        data = resp.json()
        embeds, grid = data["image_embeds"], data["image_grid_thw"]
        tokens = data.get("tokens")
        if not isinstance(embeds, str) or not isinstance(grid, str):
            raise TypeError("image_embeds and image_grid_thw must be base64 strings")
        embeds_shape = _shape(embeds, "image_embeds")
        grid_shape = _shape(grid, "image_grid_thw")
    except (ValueError, KeyError, TypeError) as exc:
        raise VisionSidecarError(f"vision sidecar {url} answered a malformed encoding: {exc}") from None
    if grid_shape != (3,):
        raise VisionSidecarError(
            f"vision sidecar {url} answered image_grid_thw of shape {list(grid_shape)}; "
            "engines need shape [3]"
        )
    if len(embeds_shape) != 2 or (isinstance(tokens, int) and tokens != embeds_shape[0]):
        raise VisionSidecarError(
            f"vision sidecar {url} answered image_embeds of shape {list(embeds_shape)} for {tokens} tokens; "
            f"engines need [tokens, hidden]"
        )
    return Encoding(embeds, grid, embeds_shape[0], bool(data.get("cached")))


def _shape(b64: str, field: str) -> tuple[int, ...]:
    try:
        return read_header(base64.b64decode(b64, validate=True)).shape
    except binascii.Error as exc:
        raise ValueError(f"{field} is not raw base64 ({exc})") from None
    except NotATensor as exc:
        raise ValueError(f"{field}: {exc}") from None
