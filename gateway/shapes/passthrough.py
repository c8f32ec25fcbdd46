"""Every other ``/v1/*`` route (embeddings, files, ...): the body is the client's, forwarded untouched;
only its ``model`` is read (to pick a backend that serves it). No conversations: least loaded, keyed by
the path. The endpoint (gateway/endpoints.py ``Passthrough``) keeps the path checks."""

from __future__ import annotations

from typing import Any

from gateway.inbound import require_model
from gateway.shapes.base import ApiShape


def validate(body: dict[str, Any]) -> str:
    return require_model(body)


PASSTHROUGH = ApiShape(name="passthrough", path="/v1/", validate=validate, key=None)
