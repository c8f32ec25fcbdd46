"""The admin API's OpenAPI 3.1 document, generated from the same table that builds its routes.

No extra dependency: pydantic's ``models_json_schema`` produces the component schemas (JSON Schema 2020-12,
which OpenAPI 3.1 uses as is), and each ``Operation`` names its request and response models. A route
cannot exist without its entry here, so the document cannot drift from the API.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import Response

from gateway.admin.models import Problem

Handler = Callable[[Request], Awaitable[Response]]
_PARAM = re.compile(r"{(\w+)(?::\w+)?}")


@dataclass(frozen=True, slots=True)
class Operation:
    method: str
    path: str  # Starlette path under /admin, e.g. "/backends/{id}"
    handler: Handler
    summary: str
    response: type[BaseModel] | None  # None: the response is not JSON (HTML, say)
    body: type[BaseModel] | None = None
    status: int = 200
    errors: tuple[int, ...] = ()
    query: type[BaseModel] | None = None  # its fields are the optional query parameters

    @property
    def openapi_path(self) -> str:
        return "/admin" + _PARAM.sub(r"{\1}", self.path)


def document(operations: Sequence[Operation], title: str = "warmroute admin API") -> dict[str, Any]:
    models = {m for op in operations for m in (op.body, op.response) if m is not None} | {Problem}
    ordered = sorted(models, key=lambda m: m.__name__)
    refs, defs = models_json_schema(
        [(m, "validation" if _is_body(m, operations) else "serialization") for m in ordered],
        ref_template="#/components/schemas/{model}",
    )
    paths: dict[str, dict[str, Any]] = {}
    for op in operations:
        item = paths.setdefault(op.openapi_path, {})
        item[op.method.lower()] = _operation(op, refs)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": "1"},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"admin": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"admin": []}],
    }


def _is_body(model: type[BaseModel], operations: Sequence[Operation]) -> bool:
    return any(op.body is model for op in operations)


def _operation(op: Operation, refs: dict[Any, Any]) -> dict[str, Any]:
    mode = "serialization"
    out: dict[str, Any] = {"summary": op.summary, "operationId": _operation_id(op)}
    params = _PARAM.findall(op.path)
    parameters = [
        {"name": p, "in": "path", "required": True, "schema": {"type": "string", "minLength": 1}}
        for p in params
    ]
    if op.query is not None:
        fields = op.query.model_json_schema()["properties"]
        parameters += [{"name": n, "in": "query", "required": False, "schema": f} for n, f in fields.items()]
    if parameters:
        out["parameters"] = parameters
    if op.body is not None:
        out["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": refs[(op.body, "validation")]}},
        }
    responses: dict[str, Any] = {}
    if op.response is None:
        responses[str(op.status)] = {
            "description": "OK",
            "content": {"text/html": {"schema": {"type": "string"}}},
        }
    else:
        schema = refs[(op.response, "validation" if (op.response, "validation") in refs else mode)]
        responses[str(op.status)] = {"description": "OK", "content": {"application/json": {"schema": schema}}}
    problem = {"content": {"application/json": {"schema": refs[(Problem, "serialization")]}}}
    for status in sorted({401, 403, *op.errors}):
        responses[str(status)] = {"description": _REASONS.get(status, "error"), **problem}
    out["responses"] = responses
    return out


def _operation_id(op: Operation) -> str:
    words = re.sub(r"[{}:]", "", op.path).strip("/").replace("/", "_")
    return f"{op.method.lower()}_{words or 'root'}"


_REASONS = {
    400: "bad request (not JSON, wrong shape)",
    401: "missing or wrong admin token",
    403: "admin API disabled (no token, listener not loopback)",
    404: "unknown backend or pin",
    409: "duplicate backend id",
    413: "body too large",
    422: "a field failed validation (``param`` names it)",
}
