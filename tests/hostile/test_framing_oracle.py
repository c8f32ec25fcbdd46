"""Request framing held to a strict reference parser: each raw request below goes to the gateway (through
to a raw engine that logs every byte it reads) and to h11. The gateway never dispatches a request h11 does
not read the same way (method, target, body, and how many): never two where h11 reads one, never one where
h11 reads two; it refuses, with one log line and a close, whatever h11 refuses; it may refuse more (every
protocol upgrade, HTTP/2.0 in an HTTP/1 request line, a Content-Length beside chunked, obs-fold, bare LF).

A request whose head was dispatched before its body proved malformed (a bad chunk) is cut: the app is
told the client left, the engine sees nothing. Each case ends the connection itself: its last request
says ``connection: close``, or it is refused.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import h11
import pytest
from hostile_engine import HostileEngine, ok_json, response, steps
from hostile_gateway import HostileGateway, HostileGatewayFactory, lines, start_gateway
from hostile_net import PeerClosed, RawClient
from starlette.types import ASGIApp, Message, Receive, Scope, Send

BODY = b'{"model": "m", "n": 1}'
SMUGGLED = b"POST /admin/backends HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\n{}"
HEALTHZ = b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n"
LAST = b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"
BIG_HEAD = 150 * 1024
CARRIER = json.dumps({"model": "m", "x": SMUGGLED.decode()}).encode()  # a request, inside a JSON body


def post(body: bytes, *fields: bytes, length: bool = True, version: bytes = b"1.1") -> bytes:
    """A POST to a forwarded path; ``fields`` are raw header lines (no CRLF)."""
    head = [b"POST /v1/echo HTTP/" + version, b"host: x", *fields]
    if length:
        head.append(b"content-length: %d" % len(body))
    return b"\r\n".join(head) + b"\r\n\r\n" + body


def chunked(*pieces: bytes, trailer: bytes = b"") -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n" + trailer + b"\r\n"


TE = b"transfer-encoding: chunked"
UPGRADE = (b"connection: upgrade", b"upgrade: h2c")


def te(codings: bytes, body: bytes = BODY, *fields: bytes, version: bytes = b"1.1") -> bytes:
    """A POST whose body is ``body`` chunked, under ``Transfer-Encoding: codings``."""
    return post(chunked(body), b"transfer-encoding: " + codings, *fields, length=False, version=version)


def bad_chunk(size_line: bytes) -> bytes:
    return post(size_line + b"\r\n" + BODY + b"\r\n0\r\n\r\n", TE, length=False)


def cl(value: bytes) -> bytes:
    return post(BODY, b"content-length: " + value, length=False)


@dataclass(frozen=True)
class Case:
    id: str
    writes: tuple[bytes, ...]
    served: int  # requests the gateway dispatches
    refused: int | None = None  # the status it then answers before it closes
    stricter: bool = False  # h11 takes it; the gateway refuses on purpose


WS = b"GET /v1/x HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n"
CONNECT = b"CONNECT 127.0.0.1:1 HTTP/1.1\r\nhost: 127.0.0.1:1\r\n\r\n"
TRAILED = b"2;x=y\r\n" + BODY[:2] + b"\r\n" + chunked(BODY[2:], trailer=b"t: v\r\n")
BIG = HEALTHZ + b"GET /healthz HTTP/1.1\r\nx-big: " + b"a" * BIG_HEAD + b"\r\n\r\n"
H2C = post(SMUGGLED, *UPGRADE)

CASES = [
    # What both parsers read alike.
    Case("post", (post(BODY, b"connection: close"),), 1),
    Case("pipelined", (HEALTHZ + post(BODY) + LAST,), 3),
    Case("pipelined-after-chunked", (post(chunked(BODY[:5], BODY[5:]), TE, length=False) + LAST,), 2),
    Case("chunked-trailer-ext", (post(TRAILED, TE, length=False) + LAST,), 2),
    Case("chunked-upper-case", (te(b"CHUNKED") + LAST,), 2),
    Case("request-inside-a-body", (post(CARRIER) + LAST,), 2),
    Case("request-inside-a-chunk", (te(b"chunked", CARRIER) + LAST,), 2),
    Case("http-1.0-without-host", (b"GET /healthz HTTP/1.0\r\n\r\n",), 1),
    Case("connection-upgrade-alone", (post(BODY, b"connection: upgrade") + LAST,), 2),
    # Smuggling through an upgrade (its body was read as the next request).
    Case("upgrade-h2c-body-in-one-read", (H2C,), 0, 400, True),
    Case("upgrade-h2c-body-in-a-later-read", (H2C[: -len(SMUGGLED)], SMUGGLED), 0, 400, True),
    Case("upgrade-after-a-pipelined-get", (HEALTHZ + H2C,), 1, 400, True),
    Case("upgrade-chunked", (te(b"chunked", SMUGGLED, *UPGRADE),), 0, 400, True),
    Case("upgrade-websocket", (WS + SMUGGLED,), 0, 400, True),
    Case("upgrade-without-connection", (post(SMUGGLED, b"upgrade: h2c"),), 0, 400, True),
    Case("upgrade-http-1.0", (post(SMUGGLED, *UPGRADE, version=b"1.0"),), 0, 400, True),
    Case("connect", (CONNECT + SMUGGLED,), 0, 400, True),
    # Content-Length and Transfer-Encoding.
    Case("cl-and-te", (post(chunked(SMUGGLED), TE),), 0, 400, True),
    Case("te-and-cl", (te(b"chunked", SMUGGLED, b"content-length: 3"),), 0, 400, True),
    Case("two-content-lengths", (post(BODY, b"content-length: 3"),), 0, 400),
    Case("content-length-list", (cl(b"%d, %d" % (len(BODY), len(BODY))),), 0, 400, True),
    Case("content-length-negative", (cl(b"-1"),), 0, 400),
    Case("content-length-plus", (cl(b"+%d" % len(BODY)),), 0, 400),
    Case("content-length-hex", (cl(b"0x16"),), 0, 400),
    Case("chunked-then-identity", (te(b"chunked, identity"),), 0, 400),
    Case("gzip-then-chunked", (te(b"gzip, chunked"),), 0, 501),
    Case("gzip-and-chunked-fields", (te(b"gzip", BODY, TE),), 0, 501),
    Case("gzip-alone", (post(BODY, b"transfer-encoding: gzip", length=False),), 0, 400),
    Case("chunked-twice", (te(b"chunked, chunked"),), 0, 400),
    Case("te-in-http-1.0", (te(b"chunked", version=b"1.0"),), 0, 400, True),
    Case("bad-chunk-size", (bad_chunk(b"zz"),), 0, 400),
    Case("chunk-size-overflow", (bad_chunk(b"1" * 20),), 0, 400, True),
    Case("chunk-size-space", (bad_chunk(b"16 "),), 0, 400, True),
    Case("chunk-without-crlf", (post(b"2\r\nabcd\r\n0\r\n\r\n", TE, length=False),), 0, 400),
    # Line syntax.
    Case("obs-fold", (post(BODY, b"x-a: b\r\n c"),), 0, 400, True),
    Case("bare-lf", (post(BODY, b"x-a: b\nx-b: c"),), 0, 400, True),
    Case("bare-cr", (post(BODY, b"x-a: b\rx-b: c"),), 0, 400),
    Case("nul-in-header", (post(BODY, b"x-a: b\x00c"),), 0, 400),
    Case("space-before-colon", (post(BODY, b"content-length : 3"),), 0, 400),
    # Host and version.
    Case("no-host", (b"GET /healthz HTTP/1.1\r\n\r\n" + SMUGGLED,), 0, 400),
    Case("two-hosts", (HEALTHZ.replace(b"host: x", b"host: x\r\nhost: y"),), 0, 400),
    Case("http-0.9", (b"GET /healthz\r\n\r\n" + SMUGGLED,), 0, 400),
    Case("http-2.0-line", (HEALTHZ.replace(b"HTTP/1.1", b"HTTP/2.0"),), 0, 505, True),
    Case("http-1.2", (HEALTHZ.replace(b"HTTP/1.1", b"HTTP/1.2"),), 0, 400, True),
    # A head over the limit, pipelined behind a small one in the same write.
    Case("big-head-pipelined", (BIG,), 1, 431),
]


@dataclass
class Seen:
    method: str
    target: str
    body: bytearray = field(default_factory=bytearray)
    cut: bool = False  # the app was told the client left before the body was complete
    peer: int = 0  # the client's port: which test connection asked


def h11_reads(data: bytes) -> tuple[list[Seen], str]:
    """The requests h11 reads in full from ``data`` (answering each), and how it stopped: close, error,
    switch (a protocol switch proposed: h11 reads no further), or more (waiting for bytes)."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=64 * 1024)
    conn.receive_data(data)
    seen: list[Seen] = []
    current = Seen("", "")
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError:
            return seen, "error"
        if event is h11.NEED_DATA:
            return seen, "more"
        if isinstance(event, h11.Request):
            current = Seen(event.method.decode(), event.target.decode())
        elif isinstance(event, h11.Data):
            current.body += event.data
        elif isinstance(event, h11.EndOfMessage):
            seen.append(current)
            if conn.their_state is h11.MIGHT_SWITCH_PROTOCOL:
                return seen, "switch"
            conn.send(h11.Response(status_code=200, headers=[("content-length", "0")]))
            conn.send(h11.EndOfMessage())
            if conn.our_state is not h11.DONE:
                return seen, "close"
            conn.start_next_cycle()
        else:
            return seen, f"{event!r}"


class Recorder:
    """ASGI middleware: every request the app was asked, and the body bytes it read."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.seen: list[Seen] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        query = scope["query_string"].decode()
        seen = Seen(scope["method"], scope["raw_path"].decode() + (f"?{query}" if query else ""))
        seen.peer = int(scope["client"][1]) if scope.get("client") else 0
        self.seen.append(seen)

        async def recorded() -> Message:
            message = await receive()
            seen.body += message.get("body", b"")
            seen.cut = seen.cut or message["type"] == "http.disconnect"
            return message

        await self.app(scope, recorded, send)


def forwarded_to(engine: HostileEngine) -> list[tuple[str, str, bytes]]:
    """What the engine was asked, its health probes and the default policy's /metrics scrapes left out."""
    return [(r.method, r.path, r.body) for r in engine.requests if r.path not in ("/health", "/metrics")]


@dataclass
class Rig:
    gateway: HostileGateway
    engine: HostileEngine
    recorder: Recorder


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    engine = HostileEngine(default=ok_json({"ok": True}))
    recorders: list[Recorder] = []

    def wrap(app: ASGIApp) -> ASGIApp:
        recorders.append(Recorder(app))
        return recorders[0]

    with contextlib.ExitStack() as stack:
        url = stack.enter_context(engine.serve())
        gateway = start_gateway(stack, engines=[], raw_engines={"e": url}, wrap=wrap)
        yield Rig(gateway, engine, recorders[0])


def _exchange(port: int, writes: tuple[bytes, ...], peers: list[int] | None = None) -> list[int]:
    """Send ``writes``, then read response statuses until the gateway closes. ``peers`` gets the client port
    (a request of an earlier case may reach the app late, under load: it is told apart by its port)."""
    statuses = []
    with RawClient(port) as raw:
        if peers is not None:
            peers.append(raw.sock.getsockname()[1])
        for data in writes:
            with contextlib.suppress(OSError):  # refused before the last write: it may find a closed socket
                raw.send(data)
        while True:
            try:
                statuses.append(raw.read_response(5.0).status)
            except PeerClosed:
                assert raw.buffer == b""
                return statuses


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_gateway_reads_requests_as_h11_does_or_refuses(
    rig: Rig, case: Case, gateway_log: pytest.LogCaptureFixture
) -> None:
    want, how = h11_reads(b"".join(case.writes))
    rig.recorder.seen.clear()
    rig.engine.requests.clear()
    rig.engine.received.clear()
    gateway_log.clear()
    peers: list[int] = []
    statuses = _exchange(rig.gateway.port, case.writes, peers)

    seen = [s for s in rig.recorder.seen if s.peer in peers]
    got = [s for s in seen if not s.cut]
    assert len(seen) - len(got) <= (case.refused is not None)  # a body found bad: cut
    assert [(s.method, s.target) for s in got] == [(s.method, s.target) for s in want[: len(got)]]
    assert len(got) == case.served, (got, statuses)
    assert statuses[: case.served] == [200] * case.served
    forwarded = [s for s in want[: case.served] if s.target.startswith("/v1/")]
    assert forwarded_to(rig.engine) == [(s.method, s.target, bytes(s.body)) for s in forwarded]
    received = rig.engine.received
    probes = received.count(b"GET /health HTTP/1.1\r\n") + received.count(b"GET /metrics HTTP/1.1\r\n")
    request_lines = received.count(b" HTTP/1.1\r\n") - probes
    assert request_lines == len(forwarded)  # the engine read nothing but these requests (and probes)
    if case.refused is None:
        assert (len(want), how) == (case.served, "close")  # h11 reads exactly these, then the close
        assert statuses == [200] * case.served
        return
    assert how != "close" or len(want) > case.served  # h11 reads more, or stops where the gateway refuses
    assert statuses[case.served :] == [case.refused]
    refusals = [r.getMessage() for r in lines(gateway_log) if f": {case.refused} " in r.getMessage()]
    assert len(refusals) == 1, [r.getMessage() for r in lines(gateway_log)]


@pytest.mark.parametrize("case", [c for c in CASES if c.refused], ids=[c.id for c in CASES if c.refused])
def test_h11_refuses_the_same_unless_the_gateway_is_stricter_on_purpose(case: Case) -> None:
    """Where the gateway refuses, h11 does too, after the same requests; or the case says the gateway is
    the stricter (an upgrade it will not serve, a version it does not speak, framing it finds ambiguous)."""
    want, how = h11_reads(b"".join(case.writes))
    if case.stricter:
        assert how != "error"
    else:
        assert (len(want), how) == (case.served, "error")


def test_leading_empty_lines_are_ignored_where_h11_refuses_them(rig: Rig) -> None:
    """RFC 9112 §2.2: a server SHOULD ignore at least one empty line before a request line; h11 refuses
    any. The framing is the same either way: one request, the same one."""
    assert h11_reads(b"\r\n" + LAST) == ([], "error")
    rig.recorder.seen.clear()
    assert _exchange(rig.gateway.port, (b"\r\n\r\n" + LAST,)) == [200]
    assert [(s.method, s.target) for s in rig.recorder.seen] == [("GET", "/healthz")]


def test_an_upgrade_is_refused_at_its_head_and_its_body_in_a_later_read_is_never_parsed(
    rig: Rig, gateway_log: pytest.LogCaptureFixture
) -> None:
    """The body of a refused upgrade, sent only after the refusal arrived, is not read as a request."""
    rig.recorder.seen.clear()
    rig.engine.requests.clear()
    gateway_log.clear()
    with RawClient(rig.gateway.port) as raw:
        raw.send(H2C[: -len(SMUGGLED)])
        r = raw.read_response(5.0)
        assert (r.status, r.error_code(), r.headers["connection"]) == (400, "invalid_request", "close")
        assert r.json()["error"]["message"] == "protocol upgrade is not supported (Upgrade: 'h2c')"
        with contextlib.suppress(OSError):
            raw.send(SMUGGLED)
        assert raw.wait_closed(5.0) == b""
    assert rig.recorder.seen == [] and forwarded_to(rig.engine) == []
    assert [r.getMessage().split(": ", 1)[1] for r in lines(gateway_log)] == [
        "400 invalid_request: protocol upgrade is not supported (Upgrade: 'h2c')"
    ]


def test_a_refusal_behind_a_slow_request_waits_for_its_answer(
    hostile_gateway: HostileGatewayFactory,
) -> None:
    """Pipelined: a request the engine answers late, then an upgrade. The 400 used to go out at once, as the
    answer to the first request (which was then dropped); now the first is answered, then the 400."""
    engine = HostileEngine({"/v1/slow": steps(0.3, response(200, b'{"late": true}'))}, ok_json({}))
    with engine.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"e": url})
        slow = post(BODY).replace(b"/v1/echo", b"/v1/slow")
        with RawClient(c.port) as raw:
            raw.send(slow + H2C)
            first = raw.read_response(5.0)
            assert (first.status, first.body) == (200, b'{"late": true}')
            assert raw.read_response(5.0).status == 400
            assert raw.wait_closed(5.0) == b""
    assert forwarded_to(engine) == [("POST", "/v1/slow", BODY)]
