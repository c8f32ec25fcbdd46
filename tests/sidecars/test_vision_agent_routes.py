"""Images on /v1/messages and /v1/responses through the real vision sidecar (the tiny checkpoint) to a
``vision: embeds`` engine: the simulator as a process of its own, dialect vLLM (it serves both routes
natively, so a chat request there is the images' doing), the official SDKs as callers."""

from __future__ import annotations

import base64
import contextlib
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from vision_deps import require_vision

require_vision()
pytestmark = pytest.mark.needs("vision")

import anthropic  # noqa: E402
import openai  # noqa: E402
from test_vision_app import wait_ready  # noqa: E402
from vision_images import png_bytes  # noqa: E402

from config.settings import load_settings  # noqa: E402
from gateway.app import create_app  # noqa: E402
from sidecars.vision.app import create_app as sidecar_app  # noqa: E402
from sidecars.vision.settings import VisionSettings  # noqa: E402
from tools import procs  # noqa: E402

from upstreams import serve  # noqa: E402

START_S = 60.0  # a Python process importing Starlette on a busy 2-core machine


@dataclass
class Stack:
    url: str
    sim: str
    sidecar: str

    def sim_paths(self) -> dict[str, int]:
        paths: dict[str, int] = httpx.get(self.sim + "/sim/stats").json()["paths"]
        return paths

    def encodes(self) -> float:
        text = httpx.get(self.sidecar + "/metrics").text
        found = re.search(r"^warmroute_vision_cache_misses_total (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0


@pytest.fixture
def stack(tiny_checkpoint: Path, encoder: Any) -> Iterator[Stack]:
    with contextlib.ExitStack() as stack:
        app = sidecar_app(VisionSettings(checkpoint=tiny_checkpoint), load=lambda _s: encoder)
        sidecar_url, _ = stack.enter_context(serve(app))
        wait_ready(sidecar_url)
        port = procs.free_port()
        argv = [
            sys.executable,
            "-m",
            "backends.sim",
            "--port",
            str(port),
            "--time-scale",
            "0",
            "--model",
            "m",
        ]
        sim = procs.spawn(argv, die_with_parent=True)
        stack.callback(procs.stop, sim)
        sim_url = f"http://127.0.0.1:{port}"
        procs.wait_http(sim_url + "/health", procs.ok, timeout_s=START_S, process=sim)
        backends = [{"id": "e", "url": sim_url, "models": ["m"], "dialect": "vllm", "vision": "embeds"}]
        settings = load_settings(
            None, backends=backends, sidecar={"url": sidecar_url}, canary={"enabled": False}
        )
        url, _ = stack.enter_context(serve(create_app(settings)))
        yield Stack(url, sim_url, sidecar_url)


def test_messages_and_responses_images_reach_the_embeds_engine_as_chat_through_the_sidecar(
    stack: Stack,
) -> None:
    png = png_bytes(64, 48, seed=3)
    data = base64.b64encode(png).decode()
    block: Any = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}
    claude = anthropic.Anthropic(base_url=stack.url, api_key="k", max_retries=0, timeout=60)
    message = claude.messages.create(
        model="m",
        max_tokens=8,
        messages=[{"role": "user", "content": [block, {"type": "text", "text": "what?"}]}],
    )
    assert message.content and message.content[0].type == "text"
    with claude.messages.stream(
        model="m",
        max_tokens=8,
        messages=[{"role": "user", "content": [block, {"type": "text", "text": "and?"}]}],
    ) as s:
        assert s.get_final_message().stop_reason in ("end_turn", "max_tokens")
    codex = openai.OpenAI(base_url=stack.url + "/v1", api_key="k", max_retries=0, timeout=60)
    parts: Any = [
        {"type": "input_text", "text": "what?"},
        {"type": "input_image", "image_url": f"data:image/png;base64,{data}", "detail": "auto"},
    ]
    reply = codex.responses.create(model="m", input=[{"role": "user", "content": parts}], store=False)
    assert reply.status in ("completed", "incomplete") and reply.output_text  # the sim picks its length
    paths = stack.sim_paths()
    assert paths.get("/v1/chat/completions") == 3, paths
    assert not paths.get("/v1/messages") and not paths.get("/v1/responses"), paths
    assert stack.encodes() == 1.0  # one image, encoded once: the later requests hit the sidecar's cache
