"""Small helpers shared by the admin tests."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

SYS = {"role": "system", "content": "You are a coding agent."}


def until(check: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll a condition another thread or process makes true (a real server: no event to wait on)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.02)


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
