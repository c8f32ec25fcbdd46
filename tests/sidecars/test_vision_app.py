"""The HTTP contract: /v1/encode payloads, the cache, bad images as clear 4xx, the bounded queue, /health,
/metrics, and the command-line entry."""

from __future__ import annotations

import base64
import io
import re
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vision_deps import require_vision

require_vision()
pytestmark = pytest.mark.needs("vision")

import torch  # noqa: E402
from image_server import ImageServer  # noqa: E402
from vision_images import png_bytes  # noqa: E402

from sidecars.vision.app import create_app  # noqa: E402
from sidecars.vision.settings import VisionSettings  # noqa: E402

from upstreams import serve  # noqa: E402


def data_uri(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


@pytest.fixture
def sidecar(tiny_checkpoint: Path, encoder: Any) -> Iterator[Any]:
    """``sidecar(**settings)`` → base URL of a served app whose loader hands over the session's encoder."""
    stack: list[Any] = []

    def start(load: Any = None, wait: bool = True, **overrides: Any) -> str:
        settings = VisionSettings(checkpoint=tiny_checkpoint, **overrides)
        app = create_app(settings, load=load or (lambda _s: encoder))
        context = serve(app)
        url, _server = context.__enter__()
        stack.append(context)
        if wait:
            wait_ready(url)
        return url

    yield start
    for context in reversed(stack):
        context.__exit__(None, None, None)


def wait_ready(url: str, within_s: float = 60.0) -> None:
    """Poll /health until the load has finished, ready or failed (it runs on a thread of the server's:
    nothing to await from here)."""
    deadline = time.monotonic() + within_s
    while httpx.get(f"{url}/health").json()["status"] == "loading":
        assert time.monotonic() < deadline, f"the sidecar at {url} still loading after {within_s:g} s"
        threading.Event().wait(0.02)


def encode(url: str, image: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/encode", json={"image": image}, timeout=30)


def load_b64(text: str) -> torch.Tensor:
    tensor: torch.Tensor = torch.load(io.BytesIO(base64.b64decode(text)), weights_only=True)
    return tensor


def test_encode_answers_the_engine_payload_and_repeats_it_byte_for_byte_from_cache(sidecar: Any) -> None:
    url = sidecar()
    image = data_uri(png_bytes(230, 150, seed=7))
    first, second = encode(url, image), encode(url, image)
    assert first.status_code == second.status_code == 200
    a, b = first.json(), second.json()
    assert set(a) == {
        "image_embeds",
        "image_grid_thw",
        "tokens",
        "hidden",
        "dtype",
        "grid_thw",
        "cached",
        "timings",
    }
    embeds, grid = load_b64(a["image_embeds"]), load_b64(a["image_grid_thw"])
    assert grid.shape == (3,) and grid.tolist() == a["grid_thw"] == [1, 10, 16]
    assert embeds.shape == (a["tokens"], a["hidden"]) == (40, 256) and embeds.dtype == torch.bfloat16
    assert a["dtype"] == "bfloat16" and (a["cached"], b["cached"]) == (False, True)
    assert a["image_embeds"] == b["image_embeds"] and a["image_grid_thw"] == b["image_grid_thw"]
    assert set(a["timings"]) >= {"fetch_ms", "decode_ms", "preprocess_ms", "encode_ms", "total_ms"}
    assert set(b["timings"]) == {"fetch_ms", "total_ms"}


def test_the_same_bytes_by_url_and_by_data_uri_share_one_cache_entry(sidecar: Any) -> None:
    png = png_bytes(100, 60, seed=11)
    images = ImageServer(png)
    with serve(images.app()) as (server_url, _server):
        url = sidecar(allow_networks=["127.0.0.1/32"])
        by_url = encode(url, f"{server_url}/img.png").json()
        by_uri = encode(url, data_uri(png)).json()
        again = encode(url, f"{server_url}/img.png").json()
    assert (by_url["cached"], by_uri["cached"], again["cached"]) == (False, True, True)
    assert by_url["image_embeds"] == by_uri["image_embeds"] == again["image_embeds"]
    assert images.paths == ["/img.png", "/img.png"]  # a URL is fetched each time: its content may change


def test_images_above_the_pixel_cap_are_downscaled(sidecar: Any) -> None:
    from sidecars.vision.encoder import Encoder

    url = sidecar(load=Encoder, max_pixels=100_000)  # a tower loaded with these settings
    got = encode(url, data_uri(png_bytes(1000, 600))).json()
    _t, h, w = got["grid_thw"]
    assert h * w * 14 * 14 <= 100_000 and got["tokens"] == h * w // 4 and abs(w / h - 1000 / 600) < 0.2


def crafted_png(width: int, height: int) -> bytes:
    """A valid PNG header claiming ``width`` x ``height`` and a tiny body: a bomb's header costs nothing."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 4))
        + chunk(b"IEND", b"")
    )


BAD = [
    (
        "bomb",
        data_uri(crafted_png(9000, 9000)),
        413,
        "image_too_many_pixels",
        r"9000x9000 = 81000000 pixels; the decode limit is 40000000",
    ),
    (
        "not-an-image",
        data_uri(b"<html>hello</html>"),
        415,
        "image_unsupported_type",
        r"none of PNG, JPEG, GIF",
    ),
    (
        "html-content-type",
        data_uri(png_bytes(8, 8), "text/html"),
        415,
        "image_unsupported_type",
        r"'text/html'",
    ),
    ("truncated", data_uri(png_bytes(64, 64)[:300]), 422, "image_invalid", r"PNG image could not be decoded"),
    ("file", "file:///etc/passwd", 400, "image_url_scheme", r"scheme 'file' is not allowed"),
    ("loopback", "http://127.0.0.1:1/a.png", 403, "image_url_forbidden", r"loopback address; refused"),
    ("oversize", data_uri(b"\0" * 3000), 413, "image_too_large", r"2000-byte limit"),
]


@pytest.mark.parametrize(("name", "image", "status", "code", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_images_are_clear_4xx(
    sidecar: Any, name: str, image: str, status: int, code: str, message: str
) -> None:
    url = sidecar(max_download_bytes=2000 if name == "oversize" else 20_000_000)
    got = encode(url, image)
    assert got.status_code == status
    error = got.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"
    assert re.search(message, error["message"]), error["message"]
    assert f'warmroute_vision_rejections_total{{reason="{code}"}} 1.0' in httpx.get(f"{url}/metrics").text


@pytest.mark.parametrize("body", [b"not json", b"[]", b'{"image": 3}', b"{}"])
def test_bad_request_bodies_are_400(sidecar: Any, body: bytes) -> None:
    got = httpx.post(f"{sidecar()}/v1/encode", content=body)
    assert got.status_code == 400 and got.json()["error"]["code"] == "invalid_request"


class GatedEncoder:
    """The session encoder behind a gate: the first encode blocks until ``release`` is set."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.entered, self.release = inner, threading.Event(), threading.Event()
        self.report, self.fingerprint, self.processor = inner.report, inner.fingerprint, inner.processor
        self.load_seconds = inner.load_seconds

    def encode(self, image: Any) -> Any:
        self.entered.set()
        assert self.release.wait(30)
        return self.inner.encode(image)


def test_a_full_queue_answers_503_at_once(sidecar: Any, encoder: Any) -> None:
    gated = GatedEncoder(encoder)
    url = sidecar(load=lambda _s: gated, queue_size=0)
    results: dict[str, httpx.Response] = {}
    worker = threading.Thread(
        target=lambda: results.update(first=encode(url, data_uri(png_bytes(56, 56, 1))))
    )
    worker.start()
    assert gated.entered.wait(10)
    refused = encode(url, data_uri(png_bytes(56, 56, 2)))
    gated.release.set()
    worker.join(30)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
    assert "encoder queue is full (0 waiting, limit 0); retry later" in refused.json()["error"]["message"]
    assert results["first"].status_code == 200
    metrics = httpx.get(f"{url}/metrics").text
    assert 'warmroute_vision_rejections_total{reason="queue_full"} 1.0' in metrics
    assert "warmroute_vision_queue_depth 0.0" in metrics


def test_health_is_503_while_loading_then_200_with_the_load_report(sidecar: Any, encoder: Any) -> None:
    gate = threading.Event()
    url = sidecar(load=lambda _s: gate.wait(30) and encoder, wait=False)
    loading = httpx.get(f"{url}/health")
    refused = encode(url, data_uri(png_bytes(8, 8)))
    gate.set()
    wait_ready(url)
    ready = httpx.get(f"{url}/health").json()
    assert loading.status_code == 503 and loading.json() == {"status": "loading", "error": None}
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "not_ready"
    assert ready["status"] == "ready" and ready["bytes_read"] == encoder.report.bytes_read
    assert ready["shards_read"] == list(encoder.report.shards_read) and ready["max_pixels"] == 1_003_520


def test_a_failed_load_is_visible_on_health(sidecar: Any, tmp_path: Path) -> None:
    from sidecars.vision.encoder import Encoder

    url = sidecar(load=lambda s: Encoder(s.model_copy(update={"checkpoint": tmp_path})))
    got = httpx.get(f"{url}/health")
    assert got.status_code == 503 and got.json()["status"] == "failed"
    assert got.json()["error"] == f"checkpoint error: config.json not found in {tmp_path}"


def test_metrics_count_hits_misses_tokens_and_cache_bytes(sidecar: Any) -> None:
    url = sidecar()
    image = data_uri(png_bytes(112, 112, seed=3))
    body = encode(url, image).json()
    encode(url, image)
    metrics = httpx.get(f"{url}/metrics").text
    expected_bytes = len(body["image_embeds"]) + len(body["image_grid_thw"])
    for line in (
        "warmroute_vision_cache_hits_total 1.0",
        "warmroute_vision_cache_misses_total 1.0",
        f"warmroute_vision_cache_bytes {float(expected_bytes)}",
        "warmroute_vision_tokens_count 1.0",
        f"warmroute_vision_tokens_sum {float(body['tokens'])}",
        "warmroute_vision_encode_seconds_count 1.0",
        f"warmroute_vision_megapixels_sum {112 * 112 / 1e6}",
    ):
        assert line in metrics, line


def test_the_command_line_exits_2_naming_a_missing_file(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sidecars.vision", "--checkpoint", str(tmp_path), "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 2
    assert done.stderr.strip() == f"warmroute vision sidecar: config.json not found in {tmp_path}"
