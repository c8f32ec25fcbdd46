"""What the gateway saw of one answered request, handed to observers when the request is finished.

The proxy's relay feeds every upstream chunk to a ``ResponseTap`` (cheap: it keeps a bounded tail and
counts SSE events); ``finish`` turns it into one ``Observation`` and gives it to each ``Observer``
(metrics: tokens and TTFT; routing: learned engine speed). Observers are synchronous and do no I/O: they
run in the relay's ``finally`` on the event loop.

``usage`` is what the engine reported (the last ``"usage"`` object of the body or stream), ``None`` when it
reported none (a stream without ``stream_options.include_usage``, an error body, a broken stream).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from gateway.outcomes import RequestOutcome
from gateway.sse import Event, EventSplitter, Pieces, Whole
from routing.keys import REPLY_CHARS, reply_text
from routing.types import Reason

# The usage object sits in the last few hundred bytes of a body or stream (vLLM, SGLang and llama.cpp put it
# in the final chunk); 4 KiB is room for it plus a trailing `[DONE]` and a long finish chunk.
_TAIL_BYTES = 4096
_TAIL = slice(-_TAIL_BYTES, None)  # the tail of a longer buffer: one slice, not one per read
# A read this long may hold an event whose start, with the blank line before it, is not in the tail.
_LONG_READ = _TAIL_BYTES - 8
_USAGE = b'"usage"'
_DECODER = json.JSONDecoder()
_T = TypeVar("_T")
# The first reply's beginning (identical heads told apart): sought in at most this many SSE events or bytes of
# a plain body, so a long reasoning prelude costs a bounded amount (the reply then stays unknown).
_REPLY_EVENTS = 256
_REPLY_HEAD_BYTES = 16384
_REPLY_EVENT_BYTES = 64 * 1024  # a larger event is not looked into (a reply delta is a few bytes)
_CONTENT = b'"content"'
_ARGUMENTS = b'"arguments"'


@dataclass(slots=True)
class RouteInfo:
    """What the ttft routing planned for one request (``gateway.learning``), read back by its observer."""

    head_key: str  # the key of the conversation head (twins share it; ``key`` may extend it)
    first_turn: bool  # no assistant message yet: the reply is this conversation's first
    prompt_chars: int  # the body's size (a learned ratio turns it into tokens)
    head_chars: int
    tail_chars: int = 0  # after the last assistant message (the whole prompt on turn 1)
    own_key: bool = False  # keyed by a session id: the key names this conversation alone, never a twin's head
    teaches: bool = True  # False for a request that is no turn (a token count): routed as one, learns nothing
    uncached_tokens: int = 0  # the estimate for the backend the request went to
    sent_at: float = -1.0  # when it was sent there (the feedback's clock; -1: not sent through it)
    busy_s: float = -1.0  # the engine busy time its span added at its first byte (-1: none taken then)
    kv_mark: int = -1  # its engine's KV event mark when it was sent (-1: the engine publishes no events)
    kv_estimate: int = -1  # cached tokens the KV index said that engine held (-1: it had no answer)
    home: str | None = None  # a follow-up's pinned backend or twin hint: where its history should be cached

    @property
    def twin_head(self) -> bool:
        """A first turn keyed by its head: a pin under that key is whoever prefilled the head first."""
        return self.first_turn and not self.own_key


# Slotted, not frozen (as ``Observation`` and ``routing.types.RouteRequest``): one is built per answered
# request, and a frozen dataclass's ``__init__`` sets each field through ``object.__setattr__`` (~5.7k
# instructions for these three fields, ~1.3k unfrozen). Its readers treat it as a read-only value.
@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # usage.prompt_tokens_details.cached_tokens, when the engine reports it


# Not frozen: a frozen dataclass's __init__ costs twice as much (object.__setattr__ per field), and one is
# built per request. Observers treat it as read-only.
@dataclass(slots=True)
class Observation:
    backend: str
    model: str | None
    key: str  # the conversation key
    reason: Reason  # why this backend was chosen
    outcome: RequestOutcome
    status: int  # the engine's HTTP status (0: no response)
    streamed: bool
    duration_s: float  # request start (gateway) to the end of the relay
    first_byte_s: float | None  # request start to the engine's first body byte
    events: int  # SSE ``data:`` events relayed (about one per token for a streamed chat)
    body_bytes: int  # bytes relayed
    usage: Usage | None
    route: RouteInfo | None = None  # set when the ttft policy routed it
    reply: str | None = None  # the beginning of the reply (``REPLY_CHARS``), when the tap was asked for it


class Observer(Protocol):
    def observe(self, obs: Observation) -> None: ...


@dataclass(frozen=True, slots=True)
class ReplyText:
    """Where an API shape's answers keep the reply's text, for the tap (chat's is built in): in a stream,
    the string after ``key`` in events that hold ``marker``; in a whole body, what ``body`` finds."""

    marker: bytes
    key: bytes
    body: Callable[[Any], str | None]


class ResponseTap:
    """Fed each relayed chunk; remembers a bounded tail and counts SSE events. O(chunk) in C per feed.

    With ``reply=True`` it also keeps the beginning of the reply: the first ``REPLY_CHARS`` characters of the
    streamed ``delta.content`` (else of the first tool call's arguments), or of a plain JSON body's first
    message. Only events that contain a content or arguments string are decoded, and only until enough is
    collected; after that a feed costs one attribute test more than without it.
    """

    __slots__ = (
        "_args",
        "_content",
        "_events",
        "_head",
        "_long",
        "_plain",
        "_seeking",
        "_tail",
        "_text",
        "body_bytes",
        "events",
    )

    def __init__(self, reply: bool = False, text: ReplyText | None = None) -> None:
        self._text = text  # the shape's reply location (None: chat's ``content``/tool-call ``arguments``)
        self._tail = b""
        self._long: bytes | None = None  # the last read of events about the tail's size or more (``take``)
        self.events = 0
        self.body_bytes = 0
        self._seeking = reply
        self._plain: bool | None = None  # a JSON body (True) or a stream (False); None: no byte seen yet
        self._head = b""  # a plain body's first bytes (only while seeking)
        self._events: EventSplitter | None = None  # a stream's events (only while seeking)
        self._content = ""
        self._args = ""

    def feed(self, chunk: bytes) -> None:
        self.body_bytes += len(chunk)
        self.events += chunk.count(b"data: ")
        tail = self._tail + chunk
        self._tail = tail[_TAIL] if len(tail) > _TAIL_BYTES else tail
        if self._seeking:
            self._seek(chunk)

    def take(self, pieces: Pieces) -> None:
        """What the relay sends, as the relay's own splitter cut it into events (no splitter of its own): a
        ``Whole`` read's events are cut only while the reply is sought.

        Each read here is whole events (the splitter holds an unended one back until it ends), so the last
        event relayed lies whole in the last read that held one: a read about the tail's size or longer is
        kept as well (``_long``, a reference: no copy), for ``ended`` to find where an event longer than the
        tail began (``response.completed`` repeats the whole output). Only reads past the tail test for it."""
        if type(pieces) is Whole:
            chunk = pieces.raw
        else:
            chunk = pieces[0].raw if len(pieces) == 1 else b"".join([p.raw for p in pieces])
        self.body_bytes += len(chunk)
        self.events += chunk.count(b"data: ")
        tail = self._tail + chunk
        if len(tail) > _TAIL_BYTES:
            if len(chunk) >= _LONG_READ:
                self._long = chunk
            tail = tail[_TAIL]
        self._tail = tail
        if self._seeking:
            if self._plain is None:
                self._plain = False
            for piece in pieces:
                if isinstance(piece, Event) and len(piece.raw) <= _REPLY_EVENT_BYTES:
                    self._look_into(piece)
            self._seen_enough()

    def usage(self, read: Callable[[bytes], Usage | None] | None = None) -> Usage | None:
        """The usage in what was relayed, where ``read`` finds it (the route's shape; else OpenAI's)."""
        return parse_usage(self._tail) if read is None else read(self._tail)

    def ended(self, terminal: tuple[bytes, ...]) -> bool:
        """Whether the last event relayed opens with one of ``terminal`` (its shape's end of a stream): the
        client has the whole answer. An event longer than the tail is found in the long read that held it
        (a stream's, ``take``); fed bytes (a plain body) have only the tail, and no terminal event."""
        tail = self._tail.rstrip()
        cut = _last_event(tail)
        if cut >= 0:
            return tail[cut:].lstrip().startswith(terminal)
        if self.body_bytes == len(self._tail):
            return tail.lstrip().startswith(terminal)
        return self._long is not None and _ends_with(self._long, tail, terminal)

    def reply(self) -> str | None:
        """The reply's beginning, or None (not asked for, nothing found, or not found in time)."""
        if self._content or self._args:
            return (self._content or self._args)[:REPLY_CHARS]
        if self._plain and self._head:
            if self._text is not None:
                return _shaped_reply(self._head, self._text)
            return _plain_reply(self._head)
        return None

    def _seek(self, chunk: bytes) -> None:
        if self._plain is None:  # the first bytes say which: a JSON body opens with "{", a stream does not
            start = chunk.lstrip()
            if not start:
                return
            self._plain = start[:1] == b"{"
        if self._plain:
            self._head += chunk[: _REPLY_HEAD_BYTES - len(self._head)]
            self._seeking = len(self._head) < _REPLY_HEAD_BYTES
            return
        if self._events is None:
            self._events = EventSplitter(_REPLY_EVENT_BYTES)
        for event in self._events.feed(chunk):
            if isinstance(event, Event):
                self._look_into(event)
        self._seen_enough()

    def _look_into(self, event: Event) -> None:
        raw = event.raw  # ``find``, not ``in`` (gateway/sse.py says why)
        text = self._text
        if text is not None:
            if raw.find(text.marker) >= 0:
                for line in event.lines():
                    at = line.find(text.key)
                    if at >= 0 and (found := _string_at(line[at + len(text.key) :])) is not None:
                        self._content += found
            return
        if raw.find(_CONTENT) >= 0 or raw.find(_ARGUMENTS) >= 0:
            for line in event.lines():
                if line.find(_CONTENT) >= 0 or line.find(_ARGUMENTS) >= 0:
                    self._take(line)

    def _seen_enough(self) -> None:
        if len(self._content) >= REPLY_CHARS or self.events > _REPLY_EVENTS:
            self._seeking = False
            self._events = None

    def _take(self, line: bytes) -> None:
        at = line.find(_CONTENT)
        if at >= 0:  # a content delta: decode only its string, not the whole event (the common case)
            text = _string_at(line[at + len(_CONTENT) :])
            if text is not None:
                self._content += text
                return
        if self._content or _ARGUMENTS not in line:
            return
        try:  # a tool call: rare enough to decode whole (its index must be checked)
            calls = json.loads(line.removeprefix(b"data:"))["choices"][0]["delta"]["tool_calls"]
            call = calls[0]
            arguments = call["function"]["arguments"]
        except (ValueError, LookupError, TypeError):
            return
        if isinstance(arguments, str) and isinstance(call, dict) and call.get("index", 0) == 0:
            self._args += arguments


class HeadTap(ResponseTap):
    """A tap that also keeps the answer's first ``head`` bytes, for shapes whose usage is split between the
    first event and the last (Anthropic's ``message_start`` and ``message_delta``). A subclass, so the
    shapes that need no head pay nothing for it."""

    __slots__ = ("_first", "_room")

    def __init__(self, head: int, reply: bool = False, text: ReplyText | None = None) -> None:
        super().__init__(reply, text)
        self._first = b""
        self._room = head

    def feed(self, chunk: bytes) -> None:
        if self._room:
            self._keep(chunk)
        super().feed(chunk)

    def take(self, pieces: Pieces) -> None:
        if self._room:
            self._keep(pieces.raw if type(pieces) is Whole else b"".join([p.raw for p in pieces]))
        super().take(pieces)

    def usage(self, read: Callable[[bytes], Usage | None] | None = None) -> Usage | None:
        """The head, then the tail: both in one buffer for ``read`` (repeated bytes where they overlap)."""
        data = self._first + b"\n" + self._tail if self._first else self._tail
        return parse_usage(data) if read is None else read(data)

    def _keep(self, chunk: bytes) -> None:
        kept = chunk[: self._room]
        self._first += kept
        self._room -= len(kept)


def _last_event(data: bytes) -> int:
    """Where the last event in ``data`` (right-stripped) begins after a blank line, or -1: none there."""
    return max(data.rfind(b"\n\n"), data.rfind(b"\r\n\r\n"), data.rfind(b"\r\r"))


def _ends_with(read: bytes, tail: bytes, terminal: tuple[bytes, ...]) -> bool:
    """Whether ``read`` (whole events, about the tail's size or more) ended the stream with a ``terminal``
    event: it ends an event (not a part of one over the splitter's bound, passed on unended), nothing but
    blank lines came after it (the stripped ``tail`` is its end), and its last event opens with one."""
    end = read[-8:]
    run = end[len(end.rstrip(b"\r\n")) :]  # the line ends it closes with: two or more end an event
    if run.count(b"\n") + run.count(b"\r") - run.count(b"\r\n") < 2:
        return False
    body = read.rstrip()
    if not body.endswith(tail[-len(body) :]):  # the tail may begin before it: the last line end before it
        return False
    cut = _last_event(body)
    return body[max(cut, 0) :].lstrip().startswith(terminal)


def _string_at(rest: bytes) -> str | None:
    """The JSON string value after a key (``rest`` starts right after ``"content"``), or None."""
    text = rest[: 4 * REPLY_CHARS + 64].decode("utf-8", "replace").lstrip()
    if not text.startswith(":"):
        return None
    text = text[1:].lstrip()
    if not text.startswith('"'):
        return None  # null (a reasoning or role delta)
    try:
        value, _ = _DECODER.raw_decode(text)
    except ValueError:  # longer than the window: take it whole
        try:
            value, _ = _DECODER.raw_decode(rest.decode("utf-8", "replace").lstrip()[1:].lstrip())
        except ValueError:
            return None
    return value if isinstance(value, str) else None


def _plain_reply(head: bytes) -> str | None:
    """The first message's reply text in a (possibly cut) JSON chat-completion body."""
    try:
        message = json.loads(head)["choices"][0]["message"]
    except (ValueError, LookupError, TypeError):
        at = head.find(_CONTENT)
        if at < 0:
            return None
        rest = head[at + len(_CONTENT) :].decode("utf-8", "replace").lstrip()
        if not rest.startswith(":"):
            return None
        try:
            text, _ = _DECODER.raw_decode(rest[1:].lstrip())
        except ValueError:
            return None  # cut inside the string: unknown
        return text[:REPLY_CHARS] if isinstance(text, str) else None
    return reply_text(message) if isinstance(message, dict) else None


def _shaped_reply(head: bytes, text: ReplyText) -> str | None:
    """The reply text of a whole (possibly cut: then unknown) JSON body, where the shape finds it."""
    try:
        doc = json.loads(head)
    except ValueError:
        return None
    found = text.body(doc)
    return None if found is None else found[:REPLY_CHARS]


def parse_usage(tail: bytes) -> Usage | None:
    """The last well-formed ``"usage": {...}`` object in ``tail``, or None (null, absent, cut off, odd)."""
    return last_object(tail, _USAGE, _chat_usage)


def _chat_usage(value: dict[str, Any]) -> Usage | None:
    return usage_counts(value, "prompt_tokens", "completion_tokens", "prompt_tokens_details")


def last_object(tail: bytes, key: bytes, read: Callable[[dict[str, Any]], _T | None]) -> _T | None:
    """What ``read`` makes of the last ``key: {...}`` object in ``tail`` that it accepts (``key`` quoted:
    ``b'"usage"'``), or None: an earlier object counts where a later one is null, cut off or refused."""
    at = tail.rfind(key)
    while at >= 0:
        value = _object_at(tail, at + len(key))
        found = None if value is None else read(value)
        if found is not None:
            return found
        at = tail.rfind(key, 0, at)
    return None


def _object_at(tail: bytes, at: int) -> dict[str, Any] | None:
    text = tail[at : at + _TAIL_BYTES].decode("utf-8", "replace").lstrip()
    if not text.startswith(":"):
        return None
    try:
        value, _ = _DECODER.raw_decode(text[1:].lstrip())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None  # "usage": null in every chunk but the last one


def usage_counts(value: dict[str, Any], prompt: str, completion: str, details: str) -> Usage | None:
    """A ``Usage`` from one usage object, its fields named in the shape's spelling; None where the prompt or
    completion count is missing or not a count."""
    prompt_tokens, completion_tokens = _count(value, prompt), _count(value, completion)
    if prompt_tokens is None or completion_tokens is None:
        return None
    found = value.get(details)
    cached = _count(found, "cached_tokens") if isinstance(found, dict) else None
    return Usage(prompt_tokens, completion_tokens, cached)


def _count(obj: dict[str, Any], name: str) -> int | None:
    value = obj.get(name)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None
