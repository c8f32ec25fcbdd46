"""An engine's SSE framing and reply size, through raw sockets: a CRLF-framed stream (valid SSE, and
sse-starlette's default) is relayed event by event at the engine's pace, and a non-streamed chat reply too
large to rewrite is a 502 at once, never held whole."""

from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest
from hostile_engine import HANG, Conn, HostileEngine, RawRequest, Script, response, steps
from hostile_gateway import HostileGatewayFactory, assert_one_line

from gateway.context import canonical_json

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def delta(**fields: str) -> bytes:
    return json.dumps({"choices": [{"index": 0, "delta": fields}]}, separators=(",", ":")).encode()


EVENTS = [
    b"data: " + delta(reasoning_content="hmm") + b"\r\n\r\n",
    b": ping\r\n\r\n",
    b"data: " + delta(content="yes") + b"\r\n\r\n",
    b"data: [DONE]\r\n\r\n",
]


def paced(gates: list[threading.Event]) -> Script:
    """The events above, chunked; each after the client has seen the one before (or never)."""

    async def run(_request: RawRequest, conn: Conn) -> None:
        conn.writer.write(SSE_HEAD)
        for i, event in enumerate(EVENTS):
            if i:
                while not gates[i - 1].is_set():  # noqa: ASYNC110 - set by the client's thread
                    await asyncio.sleep(0.01)
            conn.writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await conn.writer.drain()
        conn.writer.write(b"0\r\n\r\n")
        await conn.writer.drain()

    return run


def test_a_crlf_framed_stream_is_relayed_event_by_event(hostile_gateway: HostileGatewayFactory) -> None:
    gates = [threading.Event() for _ in EVENTS]
    engine = HostileEngine({"/health": steps(response(200)), "/v1/chat/completions": paced(gates)})
    with engine.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"crlf": url}, timeouts={"read_s": 5})
        received = b""
        with httpx.stream("POST", c.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as s:
            for data in s.iter_raw():
                received += data
                for gate in gates[: received.count(b"\r\n\r\n")]:
                    gate.set()  # the client saw this event: the engine may send the next
        doc = {"choices": [{"index": 0, "delta": {"reasoning": "hmm", "reasoning_content": "hmm"}}]}
        rewritten = b"data: " + canonical_json(doc) + b"\r\n\r\n"  # in the engine's own framing
        assert received == rewritten + b"".join(EVENTS[1:])
        assert c.gateway.registry.total_in_flight() == 0


def test_a_chat_reply_said_to_be_over_16_mib_is_a_502_at_once(
    hostile_gateway: HostileGatewayFactory, gateway_log: pytest.LogCaptureFixture
) -> None:
    size = 16 * 1024 * 1024 + 1
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % size
    engine = HostileEngine(
        {"/health": steps(response(200)), "/v1/chat/completions": steps(head, b"{" + b" " * 65535, HANG)}
    )
    with engine.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"big": url}, timeouts={"read_s": 30, "request_s": 60})
        gateway_log.clear()
        r = httpx.post(c.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 502
        assert r.json()["error"] == {
            "message": "backend big sent a reply larger than 16777216 bytes; the gateway does not hold one "
            "that large to rewrite it (ask for a stream)",
            "type": "server_error",
            "param": None,
            "code": "upstream_reply_too_large",
        }
        assert c.gateway.registry.total_in_flight() == 0
        assert_one_line(gateway_log, "backend big sent a reply larger than 16777216 bytes")
