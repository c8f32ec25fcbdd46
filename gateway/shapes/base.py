"""What the gateway knows of one API shape (a route family such as OpenAI chat completions), in one value.

Each shape module (gateway/shapes/chat.py, completions.py, passthrough.py) builds one ``ApiShape``;
gateway/shapes/__init__.py lists them in ``SHAPES``, the one table the app mounts its routes and its hot
path from. The endpoint serving a shape holds it and writes it on every ``RequestContext`` it makes
(``ctx.shape``); the phases' modules read the facts they need from there (the guard its text key, the
reasoning filter its rewriter, the observers the usage reader, the relay the error rendering), never a path.

This module imports no shape and no feature module: a shape module may use a feature's pure helpers, and
``gateway/context.py`` can name the type without a circle.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from config.settings import ReasoningFields, RoutingConfig
from gateway.errors import GatewayError
from gateway.observe import ReplyText, Usage, parse_usage
from gateway.quota_windows import RateLimitStyle
from gateway.thinking import BudgetAsk, Thinking
from routing.shape import Shape

#: The body's model, or a ``BadRequest`` in the route's own error shape: checks only the fields the
#: gateway reads itself (everything else is forwarded as the client's bytes).
Validate = Callable[[dict[str, Any]], str]
#: The conversation key of a validated body (model included), from the fields the shape says identify a
#: conversation; the hashing itself stays in ``routing.keys`` (pure).
ConversationKey = Callable[[dict[str, Any], str, RoutingConfig], str]
#: The answer's usage from the last bytes of its body or stream (None: not reported).
UsageReader = Callable[[bytes], Usage | None]
#: The request's conversation as chat messages (``role``, ``content``, ``tool_calls``), for the routing
#: feedback's reading of its turns (gateway/learning.py); None: no turns to read from this body.
Conversation = Callable[[dict[str, Any]], list[Any] | None]
#: Rewrite one parsed response document (a stream chunk when ``streamed``, else the whole body) in place so
#: its reasoning text is in the configured fields; raise ``ValueError``/``LookupError``/``TypeError`` when the
#: document is not of the shape expected (it then goes on as the engine's own bytes).
ReasoningRewrite = Callable[[dict[str, Any], ReasoningFields, bool], None]
#: The request's own thinking fields, validated, or a ``BadRequest`` naming the field (gateway/budgets.py
#: then applies the model's configuration).
ThinkingAsk = Callable[[dict[str, Any]], BudgetAsk]
#: A budget the gateway derived (no client ask) in the shape's own fields: (top-level field, value) to
#: write into the attempt's body, or None (nothing to write).
ThinkingSpell = Callable[[dict[str, Any], Thinking], tuple[str, Any] | None]
#: A validated body's size per turn for the ttft policy (``routing.shape``): head, tail, turn number.
Turns = Callable[[dict[str, Any]], Shape]
#: A validated body's image parts (``gateway.images.ImagePart`` values), for gateway/vision.py.
Images = Callable[[dict[str, Any]], tuple[Any, ...]]
#: True when a read of an answer holds only events an engine sends before its prefill, so not its first byte.
Opening = Callable[[bytes], bool]


@dataclass(frozen=True, slots=True)
class FinishKey:
    """Where an answer says why it ended (``"finish_reason":`` in OpenAI's shapes), and that value as one of
    the bounded metric labels (anything else counts as "other")."""

    key: bytes
    labels: Mapping[str, str]

    @property
    def strings(self) -> tuple[bytes, bytes]:
        """The key followed by a string value, in either spelling (compact, or one space)."""
        return self.key + b'"', self.key + b' "'


_OPENAI_REASONS = ("stop", "length", "tool_calls", "content_filter", "function_call", "abort")
OPENAI_FINISH = FinishKey(b'"finish_reason":', {r: r for r in _OPENAI_REASONS})


class ThinkingUse(StrEnum):
    """What the thinking budget (gateway/budgets.py) does with a request of this shape."""

    RESOLVE = "resolve"  # read and validated (a bad value is a 400), then spelled per dialect
    REFUSE = "refuse"  # a budget field is refused with a 400: the shape has no reasoning to cap
    IGNORE = "ignore"  # not looked at (bodies the gateway does not own)
    #: An effort only, at the shape's ``effort_path``: validated, resolved as chat's (the model's effort
    #: table gives its budget), spelled per dialect on the shape's own route, which reads no token cap; the
    #: budget applies where the attempt goes as chat (gateway/budgets.py ``budget_as_chat``). The client's
    #: own ``thinking_budget`` is refused with a 400.
    EFFORT = "effort"


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """How an error reaches a client of this shape: a whole response's body, and the end of a stream that
    broke after its head was sent (an SSE event the client's SDK reads as an error, then its terminator)."""

    body: Callable[[GatewayError], bytes]
    stream_end: Callable[[GatewayError], bytes]
    content_type: bytes = b"application/json"


def openai_body(err: GatewayError) -> bytes:
    return err.body()  # {"error": {"message", "type", "param", "code"}} (gateway/errors.py)


def openai_stream_end(err: GatewayError) -> bytes:
    return b"event: error\ndata: " + err.body() + b"\n\ndata: [DONE]\n\n"


#: OpenAI's error object, and a stream ended with an error event and ``[DONE]``.
OPENAI_ERRORS = ErrorShape(openai_body, openai_stream_end)


@dataclass(frozen=True, slots=True)
class ApiShape:
    """One API shape: its route, what the gateway owns of its requests, where its answers keep what the
    gateway reads. ``key`` None: no conversations (routed least-loaded, keyed by the path)."""

    name: str  # stable, for logs and tests
    path: str  # the route, and the path forwarded upstream (a trailing slash reaches the same endpoint)
    validate: Validate
    key: ConversationKey | None
    errors: ErrorShape = OPENAI_ERRORS
    usage: UsageReader = parse_usage
    #: The JSON key whose string values the output guard compares, in the engine's own bytes.
    text_key: bytes = b'"content":'
    reasoning: ReasoningRewrite | None = None  # None: its answers carry no reasoning to rewrite
    thinking: ThinkingUse = ThinkingUse.IGNORE
    #: Where its requests keep a reasoning effort (``ThinkingUse.EFFORT``): keys from the top-level object.
    effort_path: tuple[str, ...] = ()
    #: Its turns as chat messages (None: the body's ``messages``, as chat's).
    conversation: Conversation | None = None
    #: Where its answers keep the reply's text (None: chat's ``content``, or a tool call's ``arguments``).
    reply: ReplyText | None = None
    vision: bool = False  # its requests may hold ``image_url`` parts in ``messages`` (gateway/vision.py)
    #: Bytes of the answer's beginning the tap keeps for ``usage`` (0: the tail alone holds it); the reader
    #: is then handed those bytes and the tail, one after the other (an overlap repeats some bytes).
    usage_head: int = 0
    finish: FinishKey = OPENAI_FINISH
    #: False: routed where its conversation is pinned, never creating or moving a pin (a token count).
    pins: bool = True
    turns: Turns | None = None  # None: ``messages`` read as chat's (gateway/learning.py)
    thinking_ask: ThinkingAsk | None = None  # None: the gateway's chat fields (gateway/budgets.py)
    thinking_spell: ThinkingSpell | None = None  # with ``thinking_ask``: the client's fields go as sent
    images: Images | None = None  # None: ``image_url`` parts in ``messages`` (gateway/vision.py)
    #: Its native route takes ``image_embeds`` parts, so ``vision: embeds`` backends can serve its images.
    embeds: bool = True
    #: Without ``embeds``: an attempt holding images on a ``vision: embeds`` backend is translated to chat
    #: (gateway/translation.py), whose ``image_embeds`` parts the sidecar fills. False: such backends are
    #: left out of its image requests.
    embeds_via_chat: bool = False
    #: Whose rate-limit headers a quota writes on its answers and 429s (gateway/quota_windows.py).
    ratelimit: RateLimitStyle = RateLimitStyle.OPENAI
    #: How the event that ends its streams opens (any of them): a client that has it has the whole answer,
    #: and may hang up before the engine's body ends (gateway/proxy.py counts that answered).
    terminal: tuple[bytes, ...] = (b"data: [DONE]",)
    #: Events its engines stream before the prefill (Responses' ``response.created``): reads holding only
    #: those do not stamp the first byte, which ends the request's queued prefill and times it for the
    #: ttft learner. None: the first read is the first byte.
    opening: Opening | None = None
