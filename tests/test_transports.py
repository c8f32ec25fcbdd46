"""Self-tests of tests/transports.py, the in-memory transport the proxy's unit tests stand on."""

from __future__ import annotations

import asyncio

import pytest

from gateway.transport import UpstreamConnectError, UpstreamReadError

from transports import FakeRequest, FakeResponse, FakeTransport, Reply

pytestmark = pytest.mark.anyio

ORIGIN = "http://a"


async def read_all(response: FakeResponse) -> bytes:
    return b"".join([chunk async for chunk in response.aiter_raw()])


async def test_replies_in_order_and_requests_recorded() -> None:
    fake = FakeTransport()
    fake.script(ORIGIN, Reply(201, [(b"x-a", b"1")], [b"he", b"llo"]), Reply.json({"ok": True}, status=503))
    first = await fake.request("POST", ORIGIN, "/v1/x", [(b"accept", b"*/*")], b"{}")
    assert (first.status, first.header(b"x-a"), first.header(b"x-b")) == (201, b"1", None)
    assert [chunk async for chunk in first.aiter_raw()] == [b"he", b"llo"]
    await first.aclose()
    second = await fake.request("GET", ORIGIN, "/v1/y", [], b"")
    assert second.status == 503
    assert second.header(b"content-length") == b"12"
    assert await read_all(second) == b'{"ok": true}'
    assert fake.requests == [
        FakeRequest("POST", ORIGIN, "/v1/x", [(b"accept", b"*/*")], b"{}"),
        FakeRequest("GET", ORIGIN, "/v1/y", [], b""),
    ]
    assert fake.unclosed() == [second]
    assert fake.unused() == {}
    with pytest.raises(AssertionError, match="no reply scripted for GET http://a/v1/z"):
        await fake.request("GET", ORIGIN, "/v1/z", [], b"")


async def test_errors_before_the_head_and_at_step_k() -> None:
    fake = FakeTransport()
    fake.script(
        ORIGIN,
        Reply(error=UpstreamConnectError("refused")),
        Reply(body=[b"a", b"b", UpstreamReadError("cut")]),
    )
    with pytest.raises(UpstreamConnectError, match="refused"):
        await fake.request("POST", ORIGIN, "/", [], b"1")
    response = await fake.request("POST", ORIGIN, "/", [], b"2")
    got: list[bytes] = []
    with pytest.raises(UpstreamReadError, match="cut"):
        async for chunk in response.aiter_raw():
            got.append(chunk)
    assert got == [b"a", b"b"]
    assert [r.body for r in fake.requests] == [b"1", b"2"]  # a failed request is recorded too
    assert not response.finished


async def test_events_stall_the_head_and_the_body() -> None:
    fake = FakeTransport()
    head, more = asyncio.Event(), asyncio.Event()
    fake.script(ORIGIN, Reply(body=[b"first", more, b"second"], before_head=head))
    pending = asyncio.create_task(fake.request("GET", ORIGIN, "/", [], b""))
    await asyncio.sleep(0)
    assert not pending.done() and len(fake.requests) == 1
    head.set()
    response = await pending
    chunks = response.aiter_raw()
    assert await anext(chunks) == b"first"
    stalled = asyncio.create_task(anext(chunks))
    await asyncio.sleep(0)
    assert not stalled.done()
    more.set()
    assert await stalled == b"second"
    await response.aclose()
    with pytest.raises(UpstreamReadError):
        await anext(chunks)
    assert fake.unclosed() == []
