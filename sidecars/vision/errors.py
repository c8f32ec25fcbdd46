"""The sidecar's one error hierarchy: each error has an HTTP status and a stable ``code``.

Rendered as ``{"error": {"message", "type", "code"}}`` (OpenAI's shape, as the gateway's). Foreign errors
(httpx, PIL, safetensors) are translated into these at the module that calls them, never further out.
"""

from __future__ import annotations


class VisionError(Exception):
    status = 500
    code = "internal_error"
    type = "server_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> dict[str, dict[str, str]]:
        return {"error": {"message": self.message, "type": self.type, "code": self.code}}


class BadRequest(VisionError):
    status = 400
    code = "invalid_request"
    type = "invalid_request_error"


class UnsupportedScheme(BadRequest):
    code = "image_url_scheme"


class InvalidImageURL(BadRequest):
    """Not a URL that can be fetched: a lone surrogate, an empty or over-long DNS label, unparseable."""

    code = "image_url_invalid"


class FetchFailed(BadRequest):
    """The image server answered badly: refused connection, non-2xx, too many redirects."""

    code = "image_fetch_failed"


class ForbiddenAddress(BadRequest):
    status = 403
    code = "image_url_forbidden"


class FetchTimeout(BadRequest):
    status = 408
    code = "image_fetch_timeout"


class TooLarge(BadRequest):
    status = 413
    code = "image_too_large"


class ImageBomb(TooLarge):
    """More pixels than the decode limit, seen in the header before decoding."""

    code = "image_too_many_pixels"


class NotAnImage(BadRequest):
    status = 415
    code = "image_unsupported_type"


class BadImage(BadRequest):
    """Bytes that claim to be an image but do not decode (truncated, corrupt)."""

    status = 422
    code = "image_invalid"


class Unavailable(VisionError):
    status = 503
    type = "service_unavailable"


class NotReady(Unavailable):
    code = "not_ready"


class QueueFull(Unavailable):
    code = "queue_full"


class CheckpointError(Exception):
    """The checkpoint folder has no usable vision tower; the message names the file, key or architecture."""
