"""Reading and validating what clients send: body size, JSON, and the few fields the gateway owns.

Everything else in a request body is forwarded untouched (as the original bytes).

Hostile bodies are 400s at this edge, not 500s further in: nesting past the parser's recursion limit,
integers past Python's digit limit, and lone UTF-16 surrogates (``"\ud800"``: valid JSON grammar, but not
text; the key hashing cannot encode it and neither can an engine's tokenizer). Surrogates are rejected in
the strings the gateway reads itself: ``model``, every ``role``, the content of the conversation head (what
the key hashes) and ``prompt``. Later turns are forwarded as the client's bytes for the engine to judge,
which keeps the common path at one parse: an ASCII string is never scanned (``str.isascii`` is a flag),
another costs one UTF-8 encode, and only in the head.

Before that parse: a body is UTF-8 without a byte order mark (json.loads would read UTF-16 and UTF-32 too),
and the values it may hold are counted (``limits.max_json_values``): parsed, tiny values cost 10-25 times
their bytes. During it, a top-level key sent twice is refused: the engine would get both.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any, TypeVar

from starlette.types import Receive

from gateway.errors import BadRequest, GatewayError, InvalidJSON, PayloadTooLarge, ServerBusy
from gateway.throttle import LogThrottle


def first_values(headers: Sequence[tuple[bytes, bytes]]) -> dict[bytes, bytes]:
    """Each request header's first value, by (lower-case) name: a header sent twice counts with its first.
    Built once per request (``RequestContext.first``); everything on the request path reads it."""
    return dict(reversed(headers))  # one C pass, each name's first value kept


class BodyBudget:
    """Request-body bytes one worker holds at once (``limits.max_held_body_bytes``), over every request in
    flight. A body is charged as it arrives (its declared length up front) and released when its request
    ends, so N slow uploads or N large requests waiting on engines cannot together hold more than this."""

    __slots__ = ("held", "limit", "refusals")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0
        self.refusals = LogThrottle(10.0)  # a flood of refusals is one line per 10 s, with its count

    def take(self, n: int) -> None:
        if self.held + n > self.limit:
            err = BodyBudgetFull(
                f"this gateway worker already holds {self.held} bytes of request bodies (limit "
                f"{self.limit}); retry shortly"
            )
            if count := self.refusals.due(time.monotonic()):
                log.warning("503 server_busy: %s (%d refused since the last line)", err.message, count)
            raise err
        self.held += n

    def give(self, n: int) -> None:
        self.held -= n


class BodyBudgetFull(ServerBusy):
    """The worker holds ``limits.max_held_body_bytes`` of request bodies already: come back in a second."""

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", b"1")]


class Charge:
    """What one request has taken from the worker's body budget; ``release`` gives it all back once."""

    __slots__ = ("budget", "taken")

    def __init__(self, budget: BodyBudget | None) -> None:
        self.budget = budget
        self.taken = 0

    def take(self, n: int) -> None:
        if self.budget is not None and n > 0:
            self.budget.take(n)
            self.taken += n

    def release(self) -> None:
        if self.budget is not None:
            self.budget.give(self.taken)
        self.taken = 0


async def read_body(
    headers: Mapping[bytes, bytes], receive: Receive, limit: int, charge: Charge | None = None
) -> bytes:
    """The whole request body, or PayloadTooLarge as soon as it is known to exceed ``limit``.

    ``headers``: the request's first values (``first_values``), for its content-length. With ``charge``,
    the bytes are taken from the worker's body budget as they arrive (all of a declared length at once):
    BodyBudgetFull when the worker holds too much already. The caller releases it."""
    declared = headers.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"request body is {int(declared)} bytes; the limit is {limit}")
    if charge is not None and declared is not None and declared.isdigit():
        charge.take(int(declared))
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes")
        if charge is not None and size > charge.taken:
            charge.take(size - charge.taken)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class ClientGone(Exception):
    """The client disconnected before we answered."""


log = logging.getLogger("warmroute.inbound")

#: Default of ``limits.max_json_values``: what one body may hold, counted before it is parsed.
MAX_JSON_VALUES = 500_000

_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]+")  # JSON's whitespace
_OPEN = re.compile(r"[ \t\n\r]*\{[ \t\n\r]*(\}?)")  # group 1: the object is empty
_PLAIN_KEY = re.compile(r'[ \t\n\r]*"([^"\\\x00-\x1f]*)"[ \t\n\r]*:[ \t\n\r]*')  # no escapes
_COLON = re.compile(r"[ \t\n\r]*:[ \t\n\r]*")
# After a member's value: the closing brace (group 1), or a comma and, when it has no escapes, the next key
# (group 2) up to its value.
_AFTER_VALUE = re.compile(r'[ \t\n\r]*(?:(\})|,[ \t\n\r]*(?:"([^"\\\x00-\x1f]*)"[ \t\n\r]*:[ \t\n\r]*)?)')
#: The frames below a value's parse beyond the loop's own (see ``_members``).
_HEADROOM = 4
_scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]

E = TypeVar("E", bound=GatewayError)


def parse_object(raw: bytes, max_values: int = MAX_JSON_VALUES) -> dict[str, Any]:
    """The body as a dict: at most ``max_values`` JSON values, UTF-8, one object, no top-level key twice."""
    if not raw.strip():
        raise BadRequest("request body is empty; expected a JSON object")
    _check_size(raw, max_values)
    text = _utf8(raw)
    try:
        return _top_level_object(text)
    except json.JSONDecodeError as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        depth = sys.getrecursionlimit() - _stack_depth()
        raise _hostile(
            InvalidJSON(f"request body is not valid JSON: nesting deeper than {depth} levels")
        ) from None
    except ValueError as exc:  # only int() raises a bare ValueError in json: the digit limit
        digits = sys.get_int_max_str_digits()
        msg = f"integer literal too long (over {digits} digits)" if "integer string" in str(exc) else str(exc)
        raise _hostile(InvalidJSON(f"request body is not valid JSON: {msg}")) from None


def _utf8(raw: bytes) -> str:
    """The body as text. JSON between systems is UTF-8 without a byte order mark (RFC 8259 §8.1); json.loads
    would also take UTF-16, UTF-32 and a BOM, and the engine would then get bytes its parser may read
    otherwise. Encoded surrogates pass here, as in json.loads, to be refused where the gateway reads them."""
    encoding = json.detect_encoding(raw)
    if encoding == "utf-8-sig":
        raise _hostile(
            InvalidJSON("request body is not valid JSON: it starts with a byte order mark; send it without")
        )
    if encoding != "utf-8":
        raise _hostile(
            InvalidJSON(f"request body is not valid JSON: it is {encoding.upper()}; JSON must be UTF-8")
        )
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as exc:
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None


def _check_size(raw: bytes, limit: int) -> None:
    """Refuse, before any object is built, a body that may hold more than ``limit`` JSON values. Parsed, small
    values cost 10-25 times their bytes (``{},`` is 3 bytes and a 64-byte dict): a 32 MiB body of them took
    770 MB and a second of the event loop to refuse. Every value after a container's first follows a comma,
    so commas plus brackets bound the count (those inside strings count too: a bound, not a census). A body
    no longer than ``limit`` bytes cannot exceed it and is not scanned."""
    if len(raw) <= limit:
        return
    count = raw.count(b",")
    if count <= limit:
        count += raw.count(b"{") + raw.count(b"[")
    if count > limit:
        raise _hostile(
            PayloadTooLarge(
                f"request body holds more than {limit} JSON values (',', '{{' and '[' counted before parsing)"
            )
        )


def _top_level_object(text: str) -> dict[str, Any]:
    """json.loads for an object, its top level read member by member so that a key sent twice is seen: the
    gateway would validate the last ``model`` or ``messages`` and forward bytes that hold both, which another
    parser may read the other way. json's C scanner parses each value; this loop costs one regex match per
    top-level field (the comma or the end, and the next plain key: a pairs hook on every object cost 60 %
    more on a 20 KB chat body). Anything unexpected is handed to json itself, for its exact error."""
    body: dict[str, Any]
    if text.startswith('{"'):  # what clients send: no regex for the opening (~2k instructions per body)
        body, idx = _members(text, 1)
    else:
        opened = _OPEN.match(text)
        if opened is None:
            raise _not_an_object(text)
        if opened.group(1):
            idx = opened.end()
            body = {}
        else:
            body, idx = _members(text, opened.end())
    if idx != len(text) and _past_space(text, idx) != len(text):  # no regex without trailing space
        raise _not_an_object(text)
    return body


def _members(text: str, idx: int, headroom: int = _HEADROOM) -> tuple[dict[str, Any], int]:
    """The members of the object whose first key starts at ``idx``, and where it ends (past its ``}``).

    json's C scanner parses each value ``headroom`` frames deeper than it needs: whatever nests just inside
    the recursion limit here must still re-encode where the key hashing runs json.dumps, a few frames deeper
    than this parse (json.loads, which parsed the whole object at once, started two levels deeper)."""
    if headroom:
        return _members(text, idx, headroom - 1)
    decode, after, body = _DECODER.raw_decode, _AFTER_VALUE.match, {}
    key, idx = _key(text, idx)
    while True:
        value, idx = decode(text, idx)
        if key in body:
            name = key[:64]
            raise _hostile(BadRequest(f"duplicate key {name!a} in the request body object", param=name))
        body[key] = value
        found = after(text, idx)
        if found is None:
            raise _not_an_object(text)
        if found.lastindex == 1:  # the closing brace
            return body, found.end()
        key = found.group(2)
        if key is None:  # a key with escapes, or not a key at all
            key, idx = _key(text, found.end())
        else:
            idx = found.end()


def _key(text: str, idx: int) -> tuple[str, int]:
    """A member's key and where its value starts; a key with escapes goes through json's own scanstring."""
    plain = _PLAIN_KEY.match(text, idx)
    if plain is not None:
        return plain.group(1), plain.end()
    idx = _past_space(text, idx)
    if not text.startswith('"', idx):
        raise _not_an_object(text)
    key, idx = _scanstring(text, idx + 1)
    colon = _COLON.match(text, idx)
    if colon is None:
        raise _not_an_object(text)
    return key, colon.end()


def _past_space(text: str, idx: int) -> int:
    space = _SPACE.match(text, idx)
    return idx if space is None else space.end()


def _not_an_object(text: str) -> GatewayError:
    """json's own error for text that is not a JSON object, or (valid JSON) which type it is instead."""
    value = _DECODER.decode(text)  # raises JSONDecodeError, RecursionError, ValueError as json.loads does
    return BadRequest(f"request body must be a JSON object, not {type(value).__name__}")


def require_model(body: dict[str, Any]) -> str:
    model = body.get("model")
    if model is None:
        raise BadRequest("'model' is required", param="model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string", param="model")
    check_text(model, "model")
    return model


def check_common(body: dict[str, Any]) -> None:
    """The fields every generation shape shares: ``stream`` a boolean, ``tools`` an array."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("'tools' must be an array", param="tools")


def check_content(content: Any, param: str) -> None:
    """Surrogates in what the key hashes of one message: its text, text parts and image URLs."""
    if isinstance(content, str):
        check_text(content, param)
        return
    for j, part in enumerate(content or ()):
        if not isinstance(part, dict):
            continue  # hashed as JSON, which escapes surrogates
        text = part.get("text")
        if isinstance(text, str):
            check_text(text, f"{param}[{j}].text")
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if isinstance(url, str):
            check_text(url, f"{param}[{j}].image_url" + (".url" if isinstance(image, dict) else ""))


def check_text(value: str, param: str) -> None:
    """BadRequest naming ``param`` if ``value`` holds a lone surrogate (it has no UTF-8 encoding)."""
    if value.isascii():  # O(1): CPython keeps a flag
        return
    try:
        value.encode()
    except UnicodeEncodeError as exc:
        char = f"\\u{ord(value[exc.start]):04x}"
        raise _hostile(
            BadRequest(f"invalid unicode: lone surrogate {char} in {param}", param=param)
        ) from None


def _hostile(err: E) -> E:
    """Log a hostile body's rejection: one line, no traceback (an ordinary 400 logs nothing)."""
    log.info("rejected a request body: %s", err.message)
    return err


def _stack_depth() -> int:
    frame: FrameType | None = sys._getframe()
    depth = 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth
