"""Test images for the sidecar tests (a module of its own name: ``from conftest import`` reads whichever
conftest.py pytest loaded last when several test folders are in one run)."""

from __future__ import annotations

import io


def png_bytes(width: int, height: int, seed: int = 0, mode: str = "RGB") -> bytes:
    import numpy as np
    from PIL import Image

    channels = {"RGB": 3, "RGBA": 4}[mode]
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, channels), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, mode).save(out, "PNG")
    return out.getvalue()
