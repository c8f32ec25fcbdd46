"""One error hierarchy, rendered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

Foreign exceptions (httpx, json) are translated into these at the boundary where they occur.
"""

from __future__ import annotations

import json


class GatewayError(Exception):
    status: int = 500
    type: str = "server_error"
    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return error_body(self.message, self.type, self.code, self.param)

    def headers(self) -> list[tuple[bytes, bytes]]:
        """Extra response headers (``Retry-After`` on a 503 that knows when to come back)."""
        return []


class BadRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class InvalidJSON(BadRequest):
    code = "invalid_json"


class PayloadTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class RequestTimeout(GatewayError):
    """The client took too long to send its request head or went silent mid-body."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class RequestHeaderTooLarge(GatewayError):
    status = 431
    type = "invalid_request_error"
    code = "request_header_too_large"


class UnsupportedTransferCoding(GatewayError):
    """A request body in a transfer coding besides chunked (RFC 9112 §6.1): we cannot decode it."""

    status = 501
    type = "invalid_request_error"
    code = "unsupported_transfer_coding"


class HttpVersionNotSupported(GatewayError):
    status = 505
    type = "invalid_request_error"
    code = "http_version_not_supported"


class ServerBusy(GatewayError):
    """Refused at accept: the gateway holds as many client connections as it may."""

    status = 503
    code = "server_busy"


class NotFound(GatewayError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class ModelNotFound(NotFound):
    code = "model_not_found"


class ResponseNotFound(NotFound):
    """A /v1/responses id this gateway never recorded, or whose record expired."""

    code = "response_not_found"


class ResponseOwnerGone(GatewayError):
    """The engine holding a response's state is removed, down or draining: no other engine has it."""

    status = 409
    type = "invalid_request_error"
    code = "response_owner_gone"


class ResponseOwnerStarting(GatewayError):
    """The engine holding a response's state is (re)starting: it may answer shortly, if its state survived."""

    status = 503
    code = "response_owner_starting"
    retry_after = b"5"

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", self.retry_after)]


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class NoHealthyBackend(GatewayError):
    status = 503
    code = "no_healthy_backend"


class UpstreamError(GatewayError):
    """The engine could not be reached or broke before answering."""

    status = 502
    code = "upstream_error"


class UpstreamBusy(UpstreamError):
    """Every connection to the engine stayed busy past the pool timeout: nothing was sent."""

    status = 503
    code = "upstream_busy"


class UpstreamReplyTooLarge(UpstreamError):
    """The engine's reply is larger than the gateway holds to rewrite it (a non-streamed body)."""

    code = "upstream_reply_too_large"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class EngineFailed(UpstreamError):
    """The engine answered with a 5xx whose body is not relayed (``server.hide_engine_errors``): the
    client gets the engine's status (and a numeric ``Retry-After``) with this generic body."""

    code = "engine_error"

    def __init__(self, backend: str, status: int, retry_after: bytes | None = None) -> None:
        super().__init__(f"backend {backend} failed to answer (HTTP {status}); the details are withheld")
        self.status = status
        self.retry_after = retry_after if retry_after is not None and retry_after.isdigit() else None

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [] if self.retry_after is None else [(b"retry-after", self.retry_after)]


class EngineRefused(GatewayError):
    """An engine's own error answer (a 4xx, or a 5xx relayed), re-rendered in the client's shape because the
    request was translated for it (gateway/translation.py): its status, message and param as the engine
    gave them."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message, param=param)
        self.status = status
        self.type = "invalid_request_error" if status < 500 else "server_error"
        self.code = code or ("invalid_request" if status < 500 else "engine_error")


def error_body(message: str, type_: str, code: str, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()
