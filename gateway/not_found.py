"""An engine's 404 on a forwarded /v1 route, answered in OpenAI's error shape.

Routes the gateway does not own are forwarded on purpose: an engine may serve /v1/embeddings,
/v1/responses, /v1/messages, /v1/audio/..., and the gateway cannot know which. So an unknown path reaches
the engine, whose web framework answers ``Not Found`` as plain text or ``{"detail": "Not Found"}``, while
a client of an OpenAI API parses ``{"error": {...}}``. Such a 404 is rewritten into that shape (code
``not_found``); a 404 already in it (an engine's own "model not found") goes through byte for byte.
"""

from __future__ import annotations

import asyncio
import json

from starlette.types import Send

from gateway.context import RequestContext
from gateway.errors import NotFound
from gateway.relay import body
from gateway.transport import TransportResponse, UpstreamTransportError

#: A 404 body longer than this is not an OpenAI error: it is not read further.
MAX_BODY = 16 * 1024


async def relay_404(ctx: RequestContext, upstream: TransportResponse, send: Send, read_s: float) -> None:
    """Send the client the engine's 404: as it is if OpenAI-shaped, else rewritten. Reads at most
    ``MAX_BODY`` bytes for at most ``read_s``; a body that is longer or slower is rewritten."""
    assert ctx.lease is not None
    backend = ctx.lease.backend.id
    raw = await _read(upstream, read_s)
    if raw is not None and _is_openai_error(raw):
        payload, content_type = raw, upstream.header(b"content-type") or b"application/json"
    else:
        route = ctx.path.split("?", 1)[0]
        err = NotFound(f"{ctx.method} {route}: backend {backend!r} has no such route", param="path")
        payload, content_type = ctx.shape.errors.body(err), ctx.shape.errors.content_type
    headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(payload)).encode()),
        (b"x-warmroute-backend", backend.encode()),
        (b"x-warmroute-route", ctx.reason.value.encode()),
    ]
    ctx.responded = ctx.finishing = True
    await send({"type": "http.response.start", "status": 404, "headers": headers})
    await send(body(payload, more=False))


async def _read(upstream: TransportResponse, read_s: float) -> bytes | None:
    """The whole body, or None if it is longer than ``MAX_BODY``, slower than ``read_s`` or breaks."""
    data = bytearray()
    try:
        async with asyncio.timeout(read_s):
            async for chunk in upstream.aiter_raw():
                data += chunk
                if len(data) > MAX_BODY:
                    return None
    except (TimeoutError, UpstreamTransportError):  # a slow or broken 404 body is rewritten like any other
        return None
    return bytes(data)


def _is_openai_error(raw: bytes) -> bool:
    try:
        parsed = json.loads(raw)
    except ValueError:
        return False
    return isinstance(parsed, dict) and isinstance(parsed.get("error"), dict)
