"""The images one request holds, found once by gateway/vision.py and kept on its context across attempts."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from gateway.sidecar import Encoding


def content_parts(items: Any, field: str = "content") -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(item index, part index, part) for each object part of each item's list ``field`` (``content``, or a
    Responses tool output's ``output``), in order: the walk every shape's image finder makes over chat
    ``messages``, Messages ``messages`` and Responses ``input``; anything else in the body is skipped."""
    if not isinstance(items, list):
        return
    for i, item in enumerate(items):
        content = item.get(field) if isinstance(item, dict) else None
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict):
                    yield i, j, part


@dataclass(frozen=True, slots=True)
class ImagePart:
    message: int  # index in ``messages`` (Responses: in ``input``)
    part: int  # index in that message's ``content`` list
    url: str  # http(s) URL or data: URI, as the client sent it
    #: The field the client must fix when the sidecar refuses the image (None: chat's ``image_url``).
    at: str | None = None

    @property
    def param(self) -> str:
        if self.at is not None:
            return self.at
        return f"messages[{self.message}].content[{self.part}].image_url"


@dataclass(slots=True)
class VisionMemo:
    """What one request holds (found once) and what the sidecar made of it (kept across attempts)."""

    images: tuple[ImagePart, ...]
    encodings: dict[str, Encoding] = field(default_factory=dict)
