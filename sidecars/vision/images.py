"""Bytes → a decoded RGB PIL image, refusing what is not an image, what lies about its size, and bombs.

Order matters: magic bytes first (no decoder sees non-image bytes), then the header's width x height against
the decode limit (nothing is decompressed yet), then the full decode, which fails fast and cleanly on a
truncated file because the whole file is already in memory.
"""

from __future__ import annotations

import io
import warnings

from PIL import Image, UnidentifiedImageError

from .errors import BadImage, ImageBomb, NotAnImage

# PIL format name → how its files begin.
MAGIC: tuple[tuple[str, bytes], ...] = (
    ("PNG", b"\x89PNG\r\n\x1a\n"),
    ("JPEG", b"\xff\xd8\xff"),
    ("GIF", b"GIF87a"),
    ("GIF", b"GIF89a"),
    ("WEBP", b"RIFF"),  # and b"WEBP" at offset 8, checked below
)
ALLOWED_CONTENT_TYPES = ("application/octet-stream", "binary/octet-stream")


def sniff(data: bytes) -> str | None:
    for name, magic in MAGIC:
        if data.startswith(magic) and (name != "WEBP" or data[8:12] == b"WEBP"):
            return name
    return None


def check_content_type(content_type: str | None) -> None:
    """A server that says text/html is not sending an image, whatever the bytes look like."""
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media and not media.startswith("image/") and media not in ALLOWED_CONTENT_TYPES:
        raise NotAnImage(f"content-type {media!r} is not an image")


def decode(data: bytes, max_source_pixels: int) -> Image.Image:
    kind = sniff(data)
    if kind is None:
        raise NotAnImage("not an image: the bytes are none of PNG, JPEG, GIF or WEBP")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # our own limit applies below
            image = Image.open(io.BytesIO(data), formats=[kind])
            width, height = image.size
            if width * height > max_source_pixels:
                pixels = f"{width}x{height} = {width * height} pixels"
                raise ImageBomb(f"image is {pixels}; the decode limit is {max_source_pixels}")
            image.load()
            return to_rgb(image)
    except Image.DecompressionBombError as exc:
        raise ImageBomb(f"image has too many pixels: {exc}") from exc
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as exc:
        raise BadImage(f"{kind} image could not be decoded (truncated or corrupt): {exc}") from exc


def to_rgb(image: Image.Image) -> Image.Image:
    """Transparency is composited onto white, as the engines' own loaders (vLLM, transformers) do."""
    if image.mode == "RGB":
        return image
    has_alpha = image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info
    if not has_alpha:
        return image.convert("RGB")
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")
