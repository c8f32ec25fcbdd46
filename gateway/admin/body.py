"""Reading admin request bodies and writing admin responses, safely for anything a client can send.

Bodies: bounded size, JSON parsed by the gateway's hardened parser (deep nesting, huge integers: 400),
non-finite numbers and lone surrogates refused (they would not survive being written back as JSON), then
validated by a pydantic model: a failure is a 422 in OpenAI's error shape whose ``param`` names the first
offending field (all of them are listed in the message).
"""

from __future__ import annotations

import json
import math
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import BadRequest, GatewayError, InvalidJSON, NotFound, PayloadTooLarge
from gateway.inbound import parse_object

M = TypeVar("M", bound=BaseModel)


class Unprocessable(GatewayError):
    status = 422
    type = "invalid_request_error"
    code = "validation_error"


class Conflict(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class UnknownBackend(NotFound):
    code = "backend_not_found"

    def __init__(self, backend_id: str) -> None:
        super().__init__(f"no backend {backend_id!r}", param="id")


async def read_model(request: Request, model: type[M], limit: int) -> M:
    return validate(model, await read_object(request, limit))


async def read_object(request: Request, limit: int) -> dict[str, Any]:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {int(declared)} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():  # a disconnect raises ClientDisconnect: the app drops it quietly
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    body = parse_object(b"".join(chunks))
    _check_values(body)
    return body


def validate(model: type[M], data: Any) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _unprocessable(exc) from None
    except RecursionError:
        raise InvalidJSON("request body nests too deeply") from None


def _unprocessable(exc: ValidationError) -> Unprocessable:
    errors = exc.errors(include_url=False, include_input=False)
    parts = [f"{'.'.join(str(p) for p in e['loc']) or '(body)'}: {e['msg']}" for e in errors]
    first = ".".join(str(p) for p in errors[0]["loc"]) if errors else None
    return Unprocessable("invalid request body: " + "; ".join(parts)[:2000], param=first or None)


def _check_values(body: dict[str, Any]) -> None:
    """Non-finite floats (1e999) and lone surrogates: valid JSON input, impossible JSON output."""
    try:
        json.dumps(body, ensure_ascii=False, allow_nan=False, default=str).encode()
    except ValueError as exc:  # UnicodeEncodeError is a ValueError too
        what = "a lone surrogate" if isinstance(exc, UnicodeEncodeError) else "a non-finite number"
        raise BadRequest(f"request body holds {what}, which the admin API does not accept") from None
    except RecursionError:
        raise InvalidJSON("request body nests too deeply") from None


def finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def json_response(data: BaseModel | dict[str, Any], status: int = 200) -> Response:
    """ASCII JSON (any string survives), the model's own serialisation for models."""
    if isinstance(data, BaseModel):
        text = data.model_dump_json()
        payload = json.dumps(json.loads(text)).encode()
    else:
        payload = json.dumps(data, default=str).encode()
    return Response(payload, status_code=status, media_type="application/json")
