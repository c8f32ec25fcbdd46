"""The sidecar's HTTP surface: ``POST /v1/encode``, ``GET /health``, ``GET /metrics``.

The tower loads on a worker thread after the server starts, so ``/health`` can say "loading" (503) before it
says "ready" (200); a load failure stays visible there (503, "failed", with the loader's message).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .encoder import Encoder
from .errors import BadRequest, CheckpointError, TooLarge, VisionError
from .fetch import INLINE_DECODE, ImageFetcher, Resolver, system_resolver
from .metrics import VisionMetrics
from .service import Result, VisionService
from .settings import VisionSettings

log = logging.getLogger("warmroute.vision")
BODY_SLACK = 64 * 1024  # room for JSON around a data: URI of max_download_bytes


def render(result: Result) -> bytes:
    """The response body. The base64 payloads are ASCII and JSON-safe, so they are spliced in as stored:
    the same image gives the same bytes, and a cached answer costs a join, not a JSON encode of megabytes."""
    e = result.encoded
    tail = {
        "tokens": e.tokens,
        "hidden": e.hidden,
        "dtype": e.dtype,
        "grid_thw": list(e.grid_thw),
        "cached": result.cached,
        "timings": {k: round(v, 3) for k, v in result.timings.items()},
    }
    return b"".join(
        (
            b'{"image_embeds":"',
            e.image_embeds,
            b'","image_grid_thw":"',
            e.image_grid_thw,
            b'",',
            json.dumps(tail)[1:].encode(),
        )
    )


def error_response(exc: VisionError) -> JSONResponse:
    """The refusal, and one log line for it (no traceback: it is handled)."""
    log.info("refused an encode: %d %s: %s", exc.status, exc.code, exc.message)
    return JSONResponse(exc.body(), status_code=exc.status)


async def read_image_ref(request: Request, limit: int) -> str:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise TooLarge(f"request body is larger than {limit} bytes")
    try:  # a body of megabytes (a data: URI) is parsed off the event loop, as it is decoded and hashed
        parsed: Any = (
            json.loads(body)
            if len(body) <= INLINE_DECODE
            else await anyio.to_thread.run_sync(json.loads, body)
        )
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting past the parser's depth
        raise BadRequest(f"request body is not JSON: {exc}") from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("image"), str) or not parsed["image"]:
        raise BadRequest('request body must be a JSON object with a string field "image" (URL or data: URI)')
    image: str = parsed["image"]
    return image


def create_app(
    settings: VisionSettings,
    resolver: Resolver = system_resolver,
    load: Callable[[VisionSettings], Encoder] = Encoder,
) -> Starlette:
    metrics = VisionMetrics()
    fetcher = ImageFetcher(settings, resolver)
    service = VisionService(settings, fetcher, metrics)
    body_limit = settings.max_download_bytes * 4 // 3 + BODY_SLACK

    async def encode(request: Request) -> Response:
        try:
            url = await read_image_ref(request, body_limit)
        except VisionError as exc:
            metrics.rejections.labels(exc.code).inc()
            return error_response(exc)
        try:
            result = await service.encode(url)  # counts its own rejections
        except VisionError as exc:
            return error_response(exc)
        return Response(render(result), media_type="application/json")

    async def health(request: Request) -> Response:
        if service.encoder is not None:
            return JSONResponse({"status": "ready", **health_details(service.encoder)})
        status = "failed" if service.load_error else "loading"
        return JSONResponse({"status": status, "error": service.load_error}, status_code=503)

    async def metrics_page(request: Request) -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def load_tower() -> None:
        try:
            service.ready(await anyio.to_thread.run_sync(load, settings))
            log.info("vision tower ready: %s", service.encoder and service.encoder.report)
        except CheckpointError as exc:
            service.load_error = f"checkpoint error: {exc}"
            log.error("vision tower failed to load: %s", exc)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(load_tower)
            try:
                yield
            finally:
                tasks.cancel_scope.cancel()
                await fetcher.aclose()

    routes = [
        Route("/v1/encode", encode, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics_page, methods=["GET"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.service = service
    return app


def health_details(encoder: Encoder) -> dict[str, Any]:
    report = asdict(encoder.report)
    report["load_seconds"] = round(encoder.load_seconds, 3)
    report["max_pixels"] = encoder.processor.size["longest_edge"]
    return report
