"""The API shapes the gateway serves, in one table (gateway/shapes/base.py says what a shape is).

``SHAPES`` is what ``create_app`` mounts: one endpoint per entry, at its ``path`` (and with a trailing
slash), on the hot path and in the admin dry run; ``PASSTHROUGH`` is the ``/v1/{rest}`` fallback. A new
shape is one module and one entry here.
"""

from __future__ import annotations

from gateway.shapes.base import ApiShape, ErrorShape, ThinkingUse
from gateway.shapes.chat import CHAT
from gateway.shapes.completions import COMPLETIONS
from gateway.shapes.messages import COUNT_TOKENS, MESSAGES
from gateway.shapes.passthrough import PASSTHROUGH
from gateway.shapes.responses import RESPONSES

SHAPES: tuple[ApiShape, ...] = (CHAT, COMPLETIONS, MESSAGES, COUNT_TOKENS, RESPONSES)

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "COUNT_TOKENS",
    "MESSAGES",
    "PASSTHROUGH",
    "RESPONSES",
    "SHAPES",
    "ApiShape",
    "ErrorShape",
    "ThinkingUse",
]
