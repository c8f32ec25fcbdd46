"""Small helpers shared by the admin tests."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import uvicorn

from config.settings import Settings
from gateway.app import create_app
from gateway.server import _admin_socket, uvicorn_config
from tools.procs import free_port

SYS = {"role": "system", "content": "You are a coding agent."}


def until(check: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll a condition another thread or process makes true (a real server: no event to wait on)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.02)


def until_announced(
    url: str, check: Callable[[], bool], what: str, timeout: float = 10.0, **kwargs: Any
) -> None:
    """Wait for a state a gateway (in another process or thread) announces: re-check after each change
    it reports on its ``GET /admin/changes`` long poll. ``kwargs`` go to each request (the token)."""
    deadline = time.monotonic() + timeout
    version = 0  # a change between a check and the next poll makes that poll answer at once
    while not check():
        left = deadline - time.monotonic()
        assert left > 0, f"{what} not reached within {timeout} s"
        r = httpx.get(
            url + "/admin/changes",
            params={"since": version, "wait_s": min(left, 30.0)},
            timeout=left + 5,
            **kwargs,
        )
        assert r.status_code == 200, r.text
        version = r.json()["version"]


def chat_body(conv: str, turn: int = 0, model: str = "m") -> dict[str, Any]:
    messages: list[dict[str, Any]] = [SYS, {"role": "user", "content": conv}]
    for j in range(turn):
        messages += [{"role": "assistant", "content": f"a{j}"}, {"role": "user", "content": f"u{j}"}]
    return {"model": model, "messages": messages}


def chat(url: str, conv: str, turn: int = 0, **kwargs: Any) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=chat_body(conv, turn), timeout=10, **kwargs)


def state_of(url: str, backend: str, **kwargs: Any) -> str | None:
    r = httpx.get(f"{url}/admin/backends/{backend}", timeout=5, **kwargs)
    return r.json()["state"] if r.status_code == 200 else None


def metric_lines(url: str, name: str) -> list[str]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return [line for line in text.splitlines() if line.startswith(name)]


@contextlib.contextmanager
def two_listeners(settings: Settings) -> Iterator[tuple[str, str]]:
    """The gateway as ``warmroute serve`` runs it with ``admin.port``: one server, two sockets."""
    config = uvicorn_config(create_app(settings), settings, port=free_port(), log_level="warning")
    sockets = [config.bind_socket(), *_admin_socket(config)]
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "gateway did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{config.port}", f"http://127.0.0.1:{settings.admin.port}"
    finally:
        server.should_exit = True
        thread.join(10)
