"""One image → the engine's ``image_embeds`` payload, with the processor and tower the checkpoint names.

Synchronous and CPU-bound: the service runs it on one worker thread (torch's intra-op threads do the
parallel work). The math is exactly transformers' ``get_image_features``: pixel values cast to the tower's
dtype, ``visual(pixel_values, grid_thw=...)``, the merger's output (``pooler_output``).
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from . import loader
from .cache import Encoded
from .errors import CheckpointError
from .settings import VisionSettings

PREPROCESSOR = "preprocessor_config.json"


def b64_tensor(tensor: torch.Tensor) -> bytes:
    """base64 of ``torch.save``; the tensor is cloned first, since saving a view saves its whole storage."""
    buffer = io.BytesIO()
    torch.save(tensor.detach().contiguous().clone(), buffer)
    return base64.b64encode(buffer.getvalue())


@dataclass(frozen=True, slots=True)
class Pixels:
    values: torch.Tensor  # [patches, channels * temporal * patch * patch]
    grid_thw: torch.Tensor  # [1, 3] as the processor returns it


def load_processor(folder: Path, settings: VisionSettings) -> Any:
    from transformers import Qwen2VLImageProcessorPil

    if not (folder / PREPROCESSOR).is_file():
        raise CheckpointError(f"{PREPROCESSOR} not found in {folder} (the image processor's settings)")
    declared = loader.read_json(folder / PREPROCESSOR)
    size = dict(declared.get("size") or {})
    longest = int(size.get("longest_edge") or declared.get("max_pixels") or settings.max_pixels)
    shortest = int(size.get("shortest_edge") or declared.get("min_pixels") or 56 * 56)
    size = {
        "longest_edge": min(longest, settings.max_pixels),
        "shortest_edge": settings.min_pixels or shortest,
    }
    return Qwen2VLImageProcessorPil.from_pretrained(str(folder), size=size)


class Encoder:
    def __init__(self, settings: VisionSettings, opener: loader.Opener = loader.open_safetensors) -> None:
        started = time.perf_counter()
        folder = settings.checkpoint
        self.plan = loader.plan(folder)
        self.processor = load_processor(folder, settings)
        self.dtype = loader.resolve_dtype(self.plan.config, settings.dtype)
        self.model, self.report = loader.build(self.plan, self.dtype, settings.attn_implementation, opener)
        if settings.compile:
            for block in getattr(self.model, "blocks", ()):
                block.compile(dynamic=False)
        self.load_seconds = time.perf_counter() - started
        self.fingerprint = self._fingerprint(folder, settings)

    def _fingerprint(self, folder: Path, settings: VisionSettings) -> str:
        """Everything besides the image bytes that changes the output: weights, processor, dtype."""
        index = folder / loader.INDEX
        weights = index.read_bytes() if index.is_file() else b""
        shards = sorted(
            (s, (folder / s).stat().st_size, (folder / s).stat().st_mtime_ns) for s in self.plan.by_shard
        )
        described = {
            "config": (folder / "config.json").read_text(),
            "index": hashlib.sha256(weights).hexdigest(),
            "shards": shards,
            "processor": self.processor.to_dict(),
            "dtype": str(self.dtype),
            "attn": self.plan.config.vision_config._attn_implementation,
            "compile": settings.compile,
        }
        return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()

    def preprocess(self, image: Image.Image) -> Pixels:
        batch = self.processor(images=[image], return_tensors="pt")
        return Pixels(batch["pixel_values"], batch["image_grid_thw"])

    def forward(self, pixels: Pixels) -> torch.Tensor:
        with torch.inference_mode():
            output = self.model(pixels.values.type(self.dtype), grid_thw=pixels.grid_thw)
        embeds: torch.Tensor = output.pooler_output
        return embeds

    def encode(self, image: Image.Image) -> tuple[Encoded, dict[str, float]]:
        t0 = time.perf_counter()
        pixels = self.preprocess(image)
        t1 = time.perf_counter()
        embeds = self.forward(pixels)
        t2 = time.perf_counter()
        grid = pixels.grid_thw[0]
        encoded = Encoded(
            image_embeds=b64_tensor(embeds.to(self.dtype)),
            image_grid_thw=b64_tensor(grid),  # shape [3]: vLLM refuses [1, 3] with a bare 400
            tokens=int(embeds.shape[0]),
            hidden=int(embeds.shape[1]),
            dtype=str(self.dtype).removeprefix("torch."),
            grid_thw=(int(grid[0]), int(grid[1]), int(grid[2])),
            megapixels=int(grid[1]) * int(grid[2]) * int(self.processor.patch_size) ** 2 / 1e6,
        )
        timings = {"preprocess_ms": (t1 - t0) * 1e3, "encode_ms": (t2 - t1) * 1e3}
        return encoded, timings
