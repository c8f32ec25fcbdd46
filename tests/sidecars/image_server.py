"""A local image server for the fetch tests (127.0.0.1, so tests must allow it explicitly)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass
class ImageServer:
    png: bytes
    hosts: list[str] = field(default_factory=list)  # Host header of every request, in order
    paths: list[str] = field(default_factory=list)

    def app(self) -> Starlette:
        async def record(request: Request) -> None:
            self.hosts.append(request.headers.get("host", ""))
            self.paths.append(request.url.path)

        async def image(request: Request) -> Response:
            await record(request)
            return Response(self.png, media_type="image/png")

        async def html(request: Request) -> Response:
            await record(request)
            return Response(self.png, media_type="text/html")

        async def redirect(request: Request) -> Response:
            await record(request)
            return RedirectResponse(request.query_params["to"], status_code=302)

        async def big(request: Request) -> Response:
            await record(request)

            async def chunks() -> AsyncIterator[bytes]:
                for _ in range(64):
                    yield b"\0" * 65536

            return StreamingResponse(chunks(), media_type="image/png")  # chunked: no content-length

        async def slow(request: Request) -> Response:
            await record(request)

            async def trickle() -> AsyncIterator[bytes]:
                yield self.png[:16]
                for byte in self.png[16:40]:
                    await asyncio.sleep(0.5)  # 12 s in all: far past any fetch deadline a test sets
                    yield bytes([byte])

            return StreamingResponse(trickle(), media_type="image/png")

        async def missing(request: Request) -> Response:
            await record(request)
            return Response("no", status_code=404)

        return Starlette(
            routes=[
                Route("/img.png", image),
                Route("/page.html", html),
                Route("/redirect", redirect),
                Route("/big.png", big),
                Route("/slow.png", slow),
                Route("/missing.png", missing),
            ]
        )
