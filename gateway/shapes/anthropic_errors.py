"""Anthropic's error shape: ``{"type": "error", "error": {"type", "message"}}``, and a stream that broke after
its head ends with ``event: error`` carrying the same object (no ``[DONE]``: Anthropic streams have none).

The error type follows the HTTP status, as Anthropic's API and its SDK (``anthropic._exceptions``: one class
per status) read it; the gateway's own status is kept (a 503 stays a 503).
"""

from __future__ import annotations

import json

from gateway.errors import GatewayError
from gateway.shapes.base import ErrorShape

#: HTTP status -> Anthropic error type (the types of the SDK's ``ErrorType``, plus ``request_too_large``,
#: which the API documents for 413).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    """The Anthropic type of a status: another 4xx is an invalid request, another 5xx an API error."""
    return ERROR_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")


def anthropic_body(err: GatewayError) -> bytes:
    error = {"type": error_type(err.status), "message": err.message}
    return json.dumps({"type": "error", "error": error}).encode()


def anthropic_stream_end(err: GatewayError) -> bytes:
    return b"event: error\ndata: " + anthropic_body(err) + b"\n\n"


ANTHROPIC_ERRORS = ErrorShape(anthropic_body, anthropic_stream_end)
