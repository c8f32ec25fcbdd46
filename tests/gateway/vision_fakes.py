"""A fake vision sidecar speaking sidecars/vision's contract, for the gateway's vision tests.

Runs in a test thread (``FakeSidecar(...).app()`` under ``upstreams.serve``) or as a process of its own
(``python vision_fakes.py --port P``: the managed-sidecar tests). The tensors are real ``torch.save`` output
(torch 2.13), base64, made once with torch and kept here: the gateway has no torch.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

#: torch.tensor([1, 4, 6]) (int64, shape [3])
GRID_3 = (
    "UEsDBAAACAgAAAAAAAAAAAAAAAAAAAAAAAAQABIAYXJjaGl2ZS9kYXRhLnBrbEZCDgBaWlpaWlpaWlpaWlpaWoACY3RvcmNoLl91"
    "dGlscwpfcmVidWlsZF90ZW5zb3JfdjIKcQAoKFgHAAAAc3RvcmFnZXEBY3RvcmNoCkxvbmdTdG9yYWdlCnECWAEAAAAwcQNYAwAA"
    "AGNwdXEESwN0cQVRSwBLA4VxBksBhXEHiWNjb2xsZWN0aW9ucwpPcmRlcmVkRGljdApxCClScQl0cQpScQsuUEsHCJchZIGVAAAA"
    "lQAAAFBLAwQAAAgIAAAAAAAAAAAAAAAAAAAAAAAAFwAmAGFyY2hpdmUvLmZvcm1hdF92ZXJzaW9uRkIiAFpaWlpaWlpaWlpaWlpa"
    "WlpaWlpaWlpaWlpaWlpaWlpaWloxUEsHCLfv3IMBAAAAAQAAAFBLAwQAAAgIAAAAAAAAAAAAAAAAAAAAAAAAGgA3AGFyY2hpdmUv"
    "LnN0b3JhZ2VfYWxpZ25tZW50RkIzAFpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWjY0"
    "UEsHCD93cekCAAAAAgAAAFBLAwQAAAgIAAAAAAAAAAAAAAAAAAAAAAAAEQA/AGFyY2hpdmUvYnl0ZW9yZGVyRkI7AFpaWlpaWlpa"
    "WlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpabGl0dGxlUEsHCIU94xkGAAAABgAAAFBL"
    "AwQAAAgIAAAAAAAAAAAAAAAAAAAAAAAADgA+AGFyY2hpdmUvZGF0YS8wRkI6AFpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpa"
    "WlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWloBAAAAAAAAAAQAAAAAAAAABgAAAAAAAABQSwcIB+q6MBgAAAAYAAAAUEsDBAAA"
    "CAgAAAAAAAAAAAAAAAAAAAAAAAAPACsAYXJjaGl2ZS92ZXJzaW9uRkInAFpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpa"
    "WlpaWlpaWjMKUEsHCNGeZ1UCAAAAAgAAAFBLAwQAAAgIAAAAAAAAAAAAAAAAAAAAAAAAHgAyAGFyY2hpdmUvLmRhdGEvc2VyaWFs"
    "aXphdGlvbl9pZEZCLgBaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaMTU3MjgxOTk1MTE4NTQ2"
    "NDMwMjYwNTQ1Njk5NTQ2ODI4MzYyNjg2N1BLBwicZ8h2KAAAACgAAABQSwECAAAAAAgIAAAAAAAAlyFkgZUAAACVAAAAEAAAAAAA"
    "AAAAAAAAAAAAAAAAYXJjaGl2ZS9kYXRhLnBrbFBLAQIAAAAACAgAAAAAAAC379yDAQAAAAEAAAAXAAAAAAAAAAAAAAAAAOUAAABh"
    "cmNoaXZlLy5mb3JtYXRfdmVyc2lvblBLAQIAAAAACAgAAAAAAAA/d3HpAgAAAAIAAAAaAAAAAAAAAAAAAAAAAFEBAABhcmNoaXZl"
    "Ly5zdG9yYWdlX2FsaWdubWVudFBLAQIAAAAACAgAAAAAAACFPeMZBgAAAAYAAAARAAAAAAAAAAAAAAAAANIBAABhcmNoaXZlL2J5"
    "dGVvcmRlclBLAQIAAAAACAgAAAAAAAAH6rowGAAAABgAAAAOAAAAAAAAAAAAAAAAAFYCAABhcmNoaXZlL2RhdGEvMFBLAQIAAAAA"
    "CAgAAAAAAADRnmdVAgAAAAIAAAAPAAAAAAAAAAAAAAAAAOgCAABhcmNoaXZlL3ZlcnNpb25QSwECAAAAAAgIAAAAAAAAnGfIdigA"
    "AAAoAAAAHgAAAAAAAAAAAAAAAABSAwAAYXJjaGl2ZS8uZGF0YS9zZXJpYWxpemF0aW9uX2lkUEsGBiwAAAAAAAAAHgMtAAAAAAAA"
    "AAAABwAAAAAAAAAHAAAAAAAAAM8BAAAAAAAA+AMAAAAAAABQSwYHAAAAAMcFAAAAAAAAAQAAAFBLBQYAAAAABwAHAM8BAAD4AwAA"
    "AAA="
)
#: torch.tensor([[1, 4, 6]]) (shape [1, 3]: what vLLM refuses)
GRID_1X3 = (
    "UEsDBAAACAgAAAAAAAAAAAAAAAAAAAAAAAAQABIAYXJjaGl2ZS9kYXRhLnBrbEZCDgBaWlpaWlpaWlpaWlpaWoACY3RvcmNoLl91"
    "dGlscwpfcmVidWlsZF90ZW5zb3JfdjIKcQAoKFgHAAAAc3RvcmFnZXEBY3RvcmNoCkxvbmdTdG9yYWdlCnECWAEAAAAwcQNYAwAA"
    "AGNwdXEESwN0cQVRSwBLAUsDhnEGSwNLAYZxB4ljY29sbGVjdGlvbnMKT3JkZXJlZERpY3QKcQgpUnEJdHEKUnELLlBLBwiAZgrM"
    "mQAAAJkAAABQSwMEAAAICAAAAAAAAAAAAAAAAAAAAAAAABcAIgBhcmNoaXZlLy5mb3JtYXRfdmVyc2lvbkZCHgBaWlpaWlpaWlpa"
    "WlpaWlpaWlpaWlpaWlpaWlpaWloxUEsHCLfv3IMBAAAAAQAAAFBLAwQAAAgIAAAAAAAAAAAAAAAAAAAAAAAAGgA3AGFyY2hpdmUv"
    "LnN0b3JhZ2VfYWxpZ25tZW50RkIzAFpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWjY0"
    "UEsHCD93cekCAAAAAgAAAFBLAwQAAAgIAAAAAAAAAAAAAAAAAAAAAAAAEQA/AGFyY2hpdmUvYnl0ZW9yZGVyRkI7AFpaWlpaWlpa"
    "WlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpabGl0dGxlUEsHCIU94xkGAAAABgAAAFBL"
    "AwQAAAgIAAAAAAAAAAAAAAAAAAAAAAAADgA+AGFyY2hpdmUvZGF0YS8wRkI6AFpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpa"
    "WlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWloBAAAAAAAAAAQAAAAAAAAABgAAAAAAAABQSwcIB+q6MBgAAAAYAAAAUEsDBAAA"
    "CAgAAAAAAAAAAAAAAAAAAAAAAAAPACsAYXJjaGl2ZS92ZXJzaW9uRkInAFpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpa"
    "WlpaWlpaWjMKUEsHCNGeZ1UCAAAAAgAAAFBLAwQAAAgIAAAAAAAAAAAAAAAAAAAAAAAAHgAyAGFyY2hpdmUvLmRhdGEvc2VyaWFs"
    "aXphdGlvbl9pZEZCLgBaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaMTU3MjgxOTk1MTE4NTQ2"
    "NDMwMjYwNjg3NjYzNzY4ODQ4ODg1NjIzNlBLBwg5wCW7KAAAACgAAABQSwECAAAAAAgIAAAAAAAAgGYKzJkAAACZAAAAEAAAAAAA"
    "AAAAAAAAAAAAAAAAYXJjaGl2ZS9kYXRhLnBrbFBLAQIAAAAACAgAAAAAAAC379yDAQAAAAEAAAAXAAAAAAAAAAAAAAAAAOkAAABh"
    "cmNoaXZlLy5mb3JtYXRfdmVyc2lvblBLAQIAAAAACAgAAAAAAAA/d3HpAgAAAAIAAAAaAAAAAAAAAAAAAAAAAFEBAABhcmNoaXZl"
    "Ly5zdG9yYWdlX2FsaWdubWVudFBLAQIAAAAACAgAAAAAAACFPeMZBgAAAAYAAAARAAAAAAAAAAAAAAAAANIBAABhcmNoaXZlL2J5"
    "dGVvcmRlclBLAQIAAAAACAgAAAAAAAAH6rowGAAAABgAAAAOAAAAAAAAAAAAAAAAAFYCAABhcmNoaXZlL2RhdGEvMFBLAQIAAAAA"
    "CAgAAAAAAADRnmdVAgAAAAIAAAAPAAAAAAAAAAAAAAAAAOgCAABhcmNoaXZlL3ZlcnNpb25QSwECAAAAAAgIAAAAAAAAOcAluygA"
    "AAAoAAAAHgAAAAAAAAAAAAAAAABSAwAAYXJjaGl2ZS8uZGF0YS9zZXJpYWxpemF0aW9uX2lkUEsGBiwAAAAAAAAAHgMtAAAAAAAA"
    "AAAABwAAAAAAAAAHAAAAAAAAAM8BAAAAAAAA+AMAAAAAAABQSwYHAAAAAMcFAAAAAAAAAQAAAFBLBQYAAAAABwAHAM8BAAD4AwAA"
    "AAA="
)
#: torch.arange(48).reshape(6, 8) in bfloat16 (6 tokens, hidden 8)
EMBEDS_6X8 = (
    "UEsDBAAACAgAAAAAAAAAAAAAAAAAAAAAAAAQABIAYXJjaGl2ZS9kYXRhLnBrbEZCDgBaWlpaWlpaWlpaWlpaWoACY3RvcmNoLl91"
    "dGlscwpfcmVidWlsZF90ZW5zb3JfdjIKcQAoKFgHAAAAc3RvcmFnZXEBY3RvcmNoCkJGbG9hdDE2U3RvcmFnZQpxAlgBAAAAMHED"
    "WAMAAABjcHVxBEswdHEFUUsASwZLCIZxBksISwGGcQeJY2NvbGxlY3Rpb25zCk9yZGVyZWREaWN0CnEIKVJxCXRxClJxCy5QSwcI"
    "SmZVGp0AAACdAAAAUEsDBAAACAgAAAAAAAAAAAAAAAAAAAAAAAAXAB4AYXJjaGl2ZS8uZm9ybWF0X3ZlcnNpb25GQhoAWlpaWlpa"
    "WlpaWlpaWlpaWlpaWlpaWlpaWloxUEsHCLfv3IMBAAAAAQAAAFBLAwQAAAgIAAAAAAAAAAAAAAAAAAAAAAAAGgA3AGFyY2hpdmUv"
    "LnN0b3JhZ2VfYWxpZ25tZW50RkIzAFpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWjY0"
    "UEsHCD93cekCAAAAAgAAAFBLAwQAAAgIAAAAAAAAAAAAAAAAAAAAAAAAEQA/AGFyY2hpdmUvYnl0ZW9yZGVyRkI7AFpaWlpaWlpa"
    "WlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpabGl0dGxlUEsHCIU94xkGAAAABgAAAFBL"
    "AwQAAAgIAAAAAAAAAAAAAAAAAAAAAAAADgA+AGFyY2hpdmUvZGF0YS8wRkI6AFpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpa"
    "WlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWloAAIA/AEBAQIBAoEDAQOBAAEEQQSBBMEFAQVBBYEFwQYBBiEGQQZhBoEGoQbBB"
    "uEHAQchB0EHYQeBB6EHwQfhBAEIEQghCDEIQQhRCGEIcQiBCJEIoQixCMEI0QjhCPEJQSwcIqUKtXGAAAABgAAAAUEsDBAAACAgA"
    "AAAAAAAAAAAAAAAAAAAAAAAPACMAYXJjaGl2ZS92ZXJzaW9uRkIfAFpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlozClBL"
    "BwjRnmdVAgAAAAIAAABQSwMEAAAICAAAAAAAAAAAAAAAAAAAAAAAAB4AMgBhcmNoaXZlLy5kYXRhL3NlcmlhbGl6YXRpb25faWRG"
    "Qi4AWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWlpaWjE1NzI4MTk5NTExODU0NjQzMDI2MDM0NjMx"
    "OTMxODIzODYxMjQ1MTFQSwcI7lb5LCgAAAAoAAAAUEsBAgAAAAAICAAAAAAAAEpmVRqdAAAAnQAAABAAAAAAAAAAAAAAAAAAAAAA"
    "AGFyY2hpdmUvZGF0YS5wa2xQSwECAAAAAAgIAAAAAAAAt+/cgwEAAAABAAAAFwAAAAAAAAAAAAAAAADtAAAAYXJjaGl2ZS8uZm9y"
    "bWF0X3ZlcnNpb25QSwECAAAAAAgIAAAAAAAAP3dx6QIAAAACAAAAGgAAAAAAAAAAAAAAAABRAQAAYXJjaGl2ZS8uc3RvcmFnZV9h"
    "bGlnbm1lbnRQSwECAAAAAAgIAAAAAAAAhT3jGQYAAAAGAAAAEQAAAAAAAAAAAAAAAADSAQAAYXJjaGl2ZS9ieXRlb3JkZXJQSwEC"
    "AAAAAAgIAAAAAAAAqUKtXGAAAABgAAAADgAAAAAAAAAAAAAAAABWAgAAYXJjaGl2ZS9kYXRhLzBQSwECAAAAAAgIAAAAAAAA0Z5n"
    "VQIAAAACAAAADwAAAAAAAAAAAAAAAAAwAwAAYXJjaGl2ZS92ZXJzaW9uUEsBAgAAAAAICAAAAAAAAO5W+SwoAAAAKAAAAB4AAAAA"
    "AAAAAAAAAAAAkgMAAGFyY2hpdmUvLmRhdGEvc2VyaWFsaXphdGlvbl9pZFBLBgYsAAAAAAAAAB4DLQAAAAAAAAAAAAcAAAAAAAAA"
    "BwAAAAAAAADPAQAAAAAAADgEAAAAAAAAUEsGBwAAAAAHBgAAAAAAAAEAAABQSwUGAAAAAAcABwDPAQAAOAQAAAAA"
)

OK_IMAGE = "data:image/png;base64,iVBORw0KGgo="  # what the fake makes of any image is the same encoding


@dataclass
class FakeSidecar:
    """Scriptable: ``answers[image] = (status, json)`` overrides the encoding for that image; ``together``
    makes each encode wait until that many are in flight at once (else it answers 500 after 5 s), which
    only parallel callers can satisfy; ``gate``, if set, holds every encode until it is set."""

    answers: dict[str, tuple[int, dict[str, Any]]] = field(default_factory=dict)
    together: int = 1
    gate: threading.Event | None = None
    healthy: bool = True
    calls: list[str] = field(default_factory=list)
    active: int = 0
    max_active: int = 0
    _crowd: asyncio.Event | None = None

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/health", self._health),
                Route("/v1/encode", self._encode, methods=["POST"]),
            ]
        )

    async def _health(self, _request: Request) -> Response:
        return JSONResponse({"status": "ok"}, 200 if self.healthy else 503)

    async def _encode(self, request: Request) -> Response:
        image = (await request.json())["image"]
        cached = image in self.calls
        self.calls.append(image)
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            if not await self._wait_for_company():
                return JSONResponse({"error": {"message": "encodes came one at a time"}}, 500)
            while self.gate is not None and not self.gate.is_set():  # noqa: ASYNC110 - set by the test thread
                await asyncio.sleep(0.01)
        finally:
            self.active -= 1
        if image in self.answers:
            status, body = self.answers[image]
            return JSONResponse(body, status)
        encoding = {"image_embeds": EMBEDS_6X8, "image_grid_thw": GRID_3, "tokens": 6, "cached": cached}
        return JSONResponse(encoding)

    async def _wait_for_company(self) -> bool:
        if self.together <= 1:
            return True
        if self._crowd is None:
            self._crowd = asyncio.Event()
        if self.active >= self.together:
            self._crowd.set()
        try:
            await asyncio.wait_for(self._crowd.wait(), 5)
        except TimeoutError:
            return False
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description="fake vision sidecar")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    print(f"fake sidecar listening on {args.port}", flush=True)
    uvicorn.run(FakeSidecar().app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
