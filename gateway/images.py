"""The images one request holds, found once by gateway/vision.py and kept on its context across attempts."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.sidecar import Encoding


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
