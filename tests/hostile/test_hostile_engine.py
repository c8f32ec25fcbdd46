"""The raw-socket hostile engine does what its scripts say (the engine-side hostile tests rely on it)."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from hostile_engine import (
    RESET,
    HostileEngine,
    head_then_silence,
    huge_headers,
    ok_json,
    response,
    steps,
    trickle,
)
from hostile_gateway import HostileGatewayFactory
from hostile_net import RawClient, post


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_scripts_answer_by_path_in_turn_and_keep_the_connection_alive() -> None:
    engine = HostileEngine({"/x": [ok_json({"n": 1}), ok_json({"n": 2})]})
    with engine.serve() as url, RawClient.to(url) as raw:
        got = [raw.request(post("/x?q=1", b'{"a": %d}' % i)).json()["n"] for i in range(3)]
        assert raw.request(b"GET /other HTTP/1.1\r\n\r\n").status == 404
    assert got == [1, 2, 2]  # the last script repeats
    assert [(r.method, r.path, r.body) for r in engine.requests[:2]] == [
        ("POST", "/x?q=1", b'{"a": 0}'),
        ("POST", "/x?q=1", b'{"a": 1}'),
    ]
    assert engine.connections == 1


def test_head_then_silence_sends_the_head_and_holds_the_connection_until_the_client_leaves() -> None:
    engine = HostileEngine({"/s": head_then_silence()})
    with engine.serve() as url:
        with RawClient.to(url) as raw:
            raw.send(b"GET /s HTTP/1.1\r\n\r\n")
            head = raw.recv(10.0)
            assert head is not None and head.startswith(b"HTTP/1.1 200 X\r\n")
            assert b"transfer-encoding: chunked" in head
            assert raw.silent_for(0.3)
            assert engine.open == 1
        deadline = time.monotonic() + 10
        while engine.open and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.open == 0


def test_trickle_spaces_the_bytes_out() -> None:
    engine = HostileEngine({"/t": trickle(response(200, b"ok"), every_s=0.05, chunk=8)})
    with engine.serve() as url, RawClient.to(url) as raw:
        started = time.monotonic()
        r = raw.request(b"GET /t HTTP/1.1\r\n\r\n")
        took = time.monotonic() - started
    assert (r.status, r.body) == (200, b"ok")
    assert took >= 0.05 * (len(response(200, b"ok")) // 8)


def test_huge_headers_and_reset() -> None:
    engine = HostileEngine({"/big": huge_headers(200_000), "/rst": steps(b"HTTP/1.1 200 X\r\n", RESET)})
    with engine.serve() as url:
        with RawClient.to(url) as raw:
            r = raw.request(b"GET /big HTTP/1.1\r\n\r\n")
            assert len(r.headers["x-big"]) == 200_000
        with socket.create_connection(("127.0.0.1", _port(url)), timeout=2) as s:
            s.sendall(b"GET /rst HTTP/1.1\r\n\r\n")
            with pytest.raises(ConnectionResetError):
                while s.recv(65536):
                    pass


def test_the_gateway_can_front_a_hostile_engine(hostile_gateway: HostileGatewayFactory) -> None:
    completion = {
        "id": "c",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"content": "hi"}}],
    }
    engine = HostileEngine({"/health": ok_json({}), "/v1/chat/completions": ok_json(completion)})
    with engine.serve() as url:
        c = hostile_gateway(engines=[], raw_engines={"h": url})
        r = httpx.post(
            c.url + "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
        )
    assert r.status_code == 200, r.text
    assert r.json() == completion
    sent = [q for q in engine.requests if q.path == "/v1/chat/completions"]
    assert json.loads(sent[0].body) == {"model": "m", "messages": [{"role": "user", "content": "x"}]}
