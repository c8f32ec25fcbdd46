"""Translation where an engine lacks a shape: a Messages or Responses request sent to a chat-only engine.

One module, two hooks (gateway/phases.py):

- ``prepare`` (a ``PrepareStep``, the first one): when the backend's dialect does not serve the request's
  shape natively (backends/dialects.py ``native_shapes``), or the request holds images and the backend is
  ``vision: embeds`` (neither vLLM's Messages nor its Responses route takes image embeddings; its chat route
  does: gateway/vision.py ``as_chat``), or it asks a thinking cap the backend's native route does not
  enforce (SGLang's Messages route, ``budget_enforcement: gateway``, a Responses effort's budget where the
  gateway enforces budgets: gateway/budgets.py ``budget_as_chat``; as chat the cap is the dialect's chat
  field or the gateway's two phases; a derived budget on a request the translation refuses goes to the
  engine's own route instead), the attempt's ``Draft`` becomes the chat request (gateway/translate/), the
  attempt goes to ``/v1/chat/completions`` and is marked ``translated``. Every later step sees a chat body:
  the thinking budget is spelled for chat (so this step runs before the budget step), images are chat
  ``image_url`` parts, the engine priority is a chat field. A retry on an engine that serves the shape
  starts again from the client's body.
- ``body_filter`` (a ``BodyFilters``, the first one): the engine's chat answer back in the client's shape:
  each streamed chunk as that shape's events, a whole body translated once held, and the engine's own error
  answers rendered as the client shape's errors. Every later filter (the guard, reasoning fields) and the
  observers see the client's shape, exactly as from an engine that serves it.

Requests that are not translated pay a dict lookup in ``prepare`` and an attribute test in ``body_filter``:
no filter, no copy.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from backends.dialects import DIALECTS, ShapeName
from backends.registry import Backend
from gateway.budgets import budget_as_chat
from gateway.context import Attempt, Draft, RequestContext, canonical_json
from gateway.errors import BadRequest, EngineRefused, UpstreamError
from gateway.phases import BodyFilter, BodyFilterBase
from gateway.shapes.base import ErrorShape, ThinkingUse
from gateway.sse import Event, Overflow, Piece, Pieces, as_list
from gateway.translate import messages, responses
from gateway.translate.common import Untranslated
from gateway.vision import as_chat

CHAT_PATH = "/v1/chat/completions"


class ChatStream(Protocol):
    """A streamed chat answer's translator (gateway/translate/): fed chunks, then its end."""

    done: bool

    def chunk(self, doc: dict[str, Any]) -> list[bytes]: ...

    def finish(self) -> list[bytes]: ...


@dataclass(frozen=True, slots=True)
class ChatTranslator:
    """One client shape's translation to chat and back; ``req`` is always the client's own body."""

    shape: ShapeName
    request: Callable[[dict[str, Any]], dict[str, Any]]
    response: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]  # (chat completion, req)
    stream: Callable[[dict[str, Any]], ChatStream]  # req -> a fresh translator of the stream
    untranslated: tuple[Untranslated, ...]


def _messages_stream(req: dict[str, Any]) -> ChatStream:
    model = req.get("model")
    return messages.MessagesStream(model if isinstance(model, str) else None)


def _messages_response(doc: dict[str, Any], req: dict[str, Any]) -> dict[str, Any]:
    model = req.get("model")
    return messages.response(doc, model if isinstance(model, str) else None)


#: The shapes translated to chat, by shape name (``ApiShape.name`` is the ``ShapeName`` value).
TRANSLATORS: Mapping[str, ChatTranslator] = {
    ShapeName.MESSAGES.value: ChatTranslator(
        ShapeName.MESSAGES, messages.request, _messages_response, _messages_stream, messages.UNTRANSLATED
    ),
    ShapeName.RESPONSES.value: ChatTranslator(
        ShapeName.RESPONSES, responses.request, responses.response, responses.ResponsesStream,
        responses.UNTRANSLATED,
    ),
}  # fmt: skip


class Stitching(Protocol):
    """The gateway-enforced budget's stitching of two chat phases (gateway/continuation.py)."""

    def stitch(self, ctx: RequestContext, attempt: Attempt, status: int) -> BodyFilter | None: ...


class Translation:
    """The ``PrepareStep`` and ``BodyFilters`` above. With ``stitching``, an attempt whose thinking budget
    the gateway enforces has its two chat phases stitched into one chat answer first, then translated."""

    def __init__(
        self, translators: Mapping[str, ChatTranslator] = TRANSLATORS, stitching: Stitching | None = None
    ) -> None:
        self.translators = translators
        self.stitching = stitching

    @staticmethod
    def serves(backend: Backend, shape: ShapeName) -> bool:
        """The backend's own ``native_shapes`` when configured, else its dialect's."""
        natives = backend.cfg.native_shapes
        if natives is None:
            return shape in DIALECTS[backend.cfg.dialect].native_shapes
        return shape.value in natives

    async def prepare(self, ctx: RequestContext, backend: Backend, draft: Draft) -> None:
        translator = self.translators.get(ctx.shape.name)
        if translator is None:
            return
        needed = not self.serves(backend, translator.shape) or as_chat(ctx, backend)
        if not needed and not budget_as_chat(ctx, backend):
            return
        source = draft.read()
        assert source is not None and ctx.attempt is not None  # only owned bodies reach the prepare steps
        try:
            chat = translator.request(source)  # a BadRequest names the client's field
        except BadRequest:
            if needed or ctx.thinking is None or ctx.thinking.explicit:
                raise  # never sent uncapped, nor to a route the engine lacks
            return  # a budget the gateway derived: the engine's own route, with its own effort control
        if ctx.shape.thinking is ThinkingUse.IGNORE:
            chat.pop("thinking_budget", None)  # nobody resolves it: it would reach the engine as sent
        body = draft.edit()
        body.clear()
        body.update(chat)
        ctx.attempt.path = CHAT_PATH
        ctx.attempt.translated = ctx.shape.name

    def body_filter(self, ctx: RequestContext, attempt: Attempt, status: int, sse: bool) -> BodyFilter | None:
        if attempt.translated is None:
            return None
        translator = self.translators[attempt.translated]
        req = ctx.body or {}
        backend = attempt.backend.id
        if status >= 400:
            return None if sse else _EngineError(ctx.shape.errors, status)
        back: BodyFilter = (
            _Stream(translator.stream(req), backend) if sse else _Whole(translator, req, backend)
        )
        stitch = None if self.stitching is None else self.stitching.stitch(ctx, attempt, status)
        return back if stitch is None else _Chained(stitch, back)


class _Chained(BodyFilterBase):
    """Two filters as one, ``first``'s output through ``then`` (the stitching of two chat phases, then
    their translation); the follow-up is ``first``'s. A held part (an empty body: phase 1 waiting for
    phase 2) is not handed on."""

    rewrites = True
    __slots__ = ("first", "holds", "then")

    def __init__(self, first: BodyFilter, then: BodyFilter) -> None:
        self.first, self.then = first, then
        self.holds = first.holds or then.holds

    def events(self, pieces: Pieces) -> Pieces:
        pieces = self.first.events(pieces)
        return self.then.events(pieces) if pieces else pieces

    def body(self, data: bytes) -> bytes:
        data = self.first.body(data)
        return self.then.body(data) if data else data

    def follow_up(self) -> dict[str, Any] | None:
        return self.first.follow_up()

    def continued(self) -> None:
        self.first.continued()
        self.then.continued()

    def end(self) -> list[Piece]:
        tail = self.first.end()
        out = as_list(self.then.events(tail)) if tail else []
        return out + self.then.end()

    def close(self) -> None:
        self.first.close()
        self.then.close()


class _Whole(BodyFilterBase):
    """A whole chat completion, held, translated once."""

    holds = True
    rewrites = True
    __slots__ = ("backend", "req", "translator")

    def __init__(self, translator: ChatTranslator, req: dict[str, Any], backend: str) -> None:
        self.translator, self.req, self.backend = translator, req, backend

    def body(self, data: bytes) -> bytes:
        try:
            doc = json.loads(data)
            if not isinstance(doc, dict):
                raise TypeError("not an object")
            return canonical_json(self.translator.response(doc, self.req))
        except (ValueError, LookupError, TypeError, AttributeError):
            raise UpstreamError(
                f"backend {self.backend} answered a body that is not a chat completion; it cannot be "
                f"translated to {self.translator.shape.value}"
            ) from None


class _Stream(BodyFilterBase):
    """A chat stream, event by event, as the client shape's events.

    An engine's error event ends the answer, but what it sent before in the same read still goes first:
    the error is raised on the next read or at the end.
    """

    rewrites = True
    __slots__ = ("backend", "failed", "stream")

    def __init__(self, stream: ChatStream, backend: str) -> None:
        self.stream, self.backend = stream, backend
        self.failed: UpstreamError | None = None

    def events(self, pieces: Pieces) -> Pieces:
        if self.failed is not None:
            raise self.failed
        out: list[bytes] = []
        try:
            self._translate(pieces, out)
        except UpstreamError as exc:
            if not out:
                raise
            self.failed = exc
        return [Event(raw) for raw in out]

    def _translate(self, pieces: Pieces, out: list[bytes]) -> None:
        for piece in pieces:
            if isinstance(piece, Overflow):
                raise UpstreamError(f"backend {self.backend} sent an event too large to translate")
            data = (piece if isinstance(piece, Event) else Event(piece.raw)).data()
            if data is None:
                continue  # a comment or the bytes between events: the client shape has its own
            if data == b"[DONE]":
                out += self.stream.finish()
                continue
            try:
                doc = json.loads(data)
            except ValueError:
                raise UpstreamError(f"backend {self.backend} sent a stream event that is not JSON") from None
            if not isinstance(doc, dict):
                continue
            try:
                out += self.stream.chunk(doc)
            except (ValueError, LookupError, TypeError, AttributeError):
                raise UpstreamError(
                    f"backend {self.backend} sent a stream event that is not a chat chunk: {data[:200]!r}"
                ) from None

    def end(self) -> list[Piece]:
        if self.failed is not None:
            raise self.failed
        return [Event(raw) for raw in self.stream.finish()]  # an engine that never sent [DONE]


class _EngineError(BodyFilterBase):
    """The engine's error answer ({"error": {...}} or anything else), as the client shape's error body."""

    holds = True
    rewrites = True
    __slots__ = ("errors", "status")

    def __init__(self, errors: ErrorShape, status: int) -> None:
        self.errors, self.status = errors, status

    def body(self, data: bytes) -> bytes:
        message: str = f"the engine answered HTTP {self.status}"
        param = code = None
        try:
            error = json.loads(data).get("error")
        except (ValueError, AttributeError):
            error = None
        if isinstance(error, dict):
            if isinstance(error.get("message"), str):
                message = error["message"]
            param = error.get("param") if isinstance(error.get("param"), str) else None
            code = error.get("code") if isinstance(error.get("code"), str) else None
        elif isinstance(error, str):
            message = error
        return self.errors.body(EngineRefused(self.status, message, param=param, code=code))
