"""Headless Chromium driven over the DevTools protocol, with a stdlib WebSocket client (RFC 6455, client side:
masked text frames out, unmasked frames in). Nothing else is needed: ``websockets`` is not among our
dependencies and CDP uses a tiny part of the protocol (no extensions, no pings from the browser)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from tools.procs import child

REQUIRE_ENV = "WARMROUTE_REQUIRE_CHROMIUM"
TIMEOUT_S = 30.0


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found is not None:
            return found
    message = "chromium not found on PATH (apt-get install chromium)"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message} ({REQUIRE_ENV}=1)")
    pytest.skip(message)


class WebSocket:
    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=TIMEOUT_S)
        key = base64.b64encode(os.urandom(16)).decode()
        request = (
            f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        self.sock.sendall(request.encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(4096)
            assert chunk, "DevTools closed the connection during the handshake"
            head += chunk
        head, self.buffer = head.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head

    def send(self, text: str) -> None:
        payload = text.encode()
        mask = os.urandom(4)
        n = len(payload)
        header = bytes([0x81])  # FIN + text
        if n < 126:
            header += bytes([0x80 | n])
        elif n < 1 << 16:
            header += bytes([0x80 | 126]) + struct.pack("!H", n)
        else:
            header += bytes([0x80 | 127]) + struct.pack("!Q", n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(header + mask + masked)

    def recv(self) -> str:
        """One whole message (continuation frames joined)."""
        message = b""
        while True:
            first, second = self._read(2)
            n = second & 0x7F
            if n == 126:
                (n,) = struct.unpack("!H", self._read(2))
            elif n == 127:
                (n,) = struct.unpack("!Q", self._read(8))
            payload = self._read(n)
            opcode = first & 0x0F
            if opcode == 0x8:
                raise ConnectionError("DevTools closed the WebSocket")
            if opcode in (0x0, 0x1, 0x2):
                message += payload
                if first & 0x80:
                    return message.decode()

    def _read(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("DevTools connection closed")
            self.buffer += chunk
        out, self.buffer = self.buffer[:n], self.buffer[n:]
        return out

    def close(self) -> None:
        self.sock.close()


@dataclass
class Page:
    """One tab: ``call`` a CDP method; every event that arrives meanwhile is kept in ``events``."""

    ws: WebSocket
    events: list[dict[str, Any]] = field(default_factory=list)
    _id: int = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self._id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                result: dict[str, Any] = msg.get("result", {})
                return result
            self.events.append(msg)

    def wait_event(self, method: str, seen: int = 0) -> dict[str, Any]:
        """The first ``method`` event after the first ``seen`` events kept (waiting for it if need be)."""
        for msg in self.events[seen:]:
            if msg.get("method") == method:
                return msg
        while True:
            msg = json.loads(self.ws.recv())
            self.events.append(msg)
            if msg.get("method") == method:
                return msg

    def open(self, url: str) -> None:
        """Navigate and wait for the load event, collecting console and log events from the start."""
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable")
        seen = len(self.events)
        self.call("Page.navigate", url=url)
        self.wait_event("Page.loadEventFired", seen)

    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and browser log errors (failed loads, CSP violations)."""
        out = []
        for msg in self.events:
            method, params = msg.get("method"), msg.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
                out.append("console: " + " ".join(str(a.get("value", a)) for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                out.append("exception: " + json.dumps(params.get("exceptionDetails", {}))[:500])
            elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
                entry = params["entry"]
                out.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")
        return out

    def evaluate(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))


@contextlib.contextmanager
def chromium(profile: Path) -> Iterator[Page]:
    """Headless Chromium with DevTools on a free loopback port; yields its first tab."""
    argv = [
        chromium_binary(),
        "--headless=new",
        "--no-sandbox",  # tests run as root in CI, where the sandbox refuses to start
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--remote-debugging-address=127.0.0.1",
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        "--window-size=1280,900",
        "about:blank",
    ]
    with child(argv, stderr=subprocess.DEVNULL, group=True) as process:  # group: its helpers go too
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + TIMEOUT_S
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"chromium did not open DevTools (exit {process.poll()})")
            time.sleep(0.05)
        port = int(port_file.read_text().splitlines()[0])
        tabs: list[dict[str, Any]] = []
        while not tabs:  # the first tab shows up a moment after DevTools listens
            targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=TIMEOUT_S).json()
            tabs = [t for t in targets if t.get("type") == "page"]
            if not tabs and time.monotonic() > deadline:
                pytest.fail("chromium opened no tab")
            time.sleep(0.05)
        ws = WebSocket(tabs[0]["webSocketDebuggerUrl"])
        try:
            yield Page(ws)
        finally:
            ws.close()
