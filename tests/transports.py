"""An in-memory ``gateway.transport.UpstreamTransport`` for unit tests of the proxy: no sockets.

Script what each origin answers, in order, then run the code under test and read back what it sent:

    fake = FakeTransport()
    fake.script("http://a", Reply(500), Reply(200, body=[b"data: 1\\n\\n", UpstreamReadError("cut")]))
    fake.script("http://b", Reply(error=UpstreamConnectError("refused")))
    ... proxy under test, with fake as its transport ...
    assert [r.origin for r in fake.requests] == ["http://a", "http://b"]
    assert fake.unclosed() == []

A reply's ``body`` is a list of steps: bytes are yielded by ``aiter_raw()``, an exception is raised there
(an error at step k), an ``asyncio.Event`` is waited on (a stalled engine). ``Reply.error`` is raised by
``request()`` itself, before any head; ``Reply.before_head`` makes ``request()`` wait first.
"""

from __future__ import annotations

import asyncio
import collections
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.transport import UpstreamReadError

Step = bytes | BaseException | asyncio.Event


@dataclass(frozen=True)
class FakeRequest:
    method: str
    origin: str
    path: str
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass
class Reply:
    status: int = 200
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # names lower-case
    body: list[Step] = field(default_factory=list)
    error: BaseException | None = None
    before_head: asyncio.Event | None = None

    @classmethod
    def json(cls, payload: Any, status: int = 200) -> Reply:
        data = json.dumps(payload).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
        return cls(status, headers, [data])


class FakeResponse:
    def __init__(self, request: FakeRequest, reply: Reply) -> None:
        self.request = request
        self.status = reply.status
        self.headers = list(reply.headers)
        self.steps = list(reply.body)
        self.closed = False
        self.finished = False  # the whole body was read

    def header(self, name: bytes) -> bytes | None:
        return next((value for key, value in self.headers if key == name), None)

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        while self.steps:
            if self.closed:
                raise UpstreamReadError("response is closed")
            step = self.steps.pop(0)
            if isinstance(step, asyncio.Event):
                await step.wait()
            elif isinstance(step, BaseException):
                raise step
            else:
                yield step
        if self.closed:
            raise UpstreamReadError("response is closed")
        self.finished = True

    async def aclose(self) -> None:
        self.closed = True


class FakeTransport:
    def __init__(self) -> None:
        self.requests: list[FakeRequest] = []
        self.responses: list[FakeResponse] = []
        self.closed = False
        self._scripts: dict[str, collections.deque[Reply]] = collections.defaultdict(collections.deque)

    def script(self, origin: str, *replies: Reply) -> None:
        """Queue ``replies`` for ``origin``; each request to it takes the next one."""
        self._scripts[origin].extend(replies)

    async def request(
        self, method: str, origin: str, path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes
    ) -> FakeResponse:
        if self.closed:
            raise RuntimeError("FakeTransport is closed")
        request = FakeRequest(method, origin, path, list(headers), body)
        self.requests.append(request)
        queue = self._scripts.get(origin)
        if not queue:
            raise AssertionError(f"no reply scripted for {method} {origin}{path}")
        reply = queue.popleft()
        if reply.before_head is not None:
            await reply.before_head.wait()
        if reply.error is not None:
            raise reply.error
        response = FakeResponse(request, reply)
        self.responses.append(response)
        return response

    async def aclose(self) -> None:
        self.closed = True

    def unclosed(self) -> list[FakeResponse]:
        """Responses the code under test never closed (the real pool would have leaked their permits)."""
        return [r for r in self.responses if not r.closed]

    def unused(self) -> dict[str, int]:
        """Scripted replies nobody asked for, per origin."""
        return {origin: len(queue) for origin, queue in self._scripts.items() if queue}
