"""A managed vision sidecar: the gateway starts it, restarts it with the cause kept, and stops it on shutdown.

The sidecar is ``vision_fakes.py`` as a process of its own; the engines are fakes in test threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from config.settings import load_settings
from gateway.app import Gateway, create_app
from gateway.sidecar import SidecarHost
from tools import procs

from clusters import loop_of, wait_on_changes
from upstreams import PROBE_TIMEOUT_S, FakeEngine, serve

FAKE_SIDECAR = Path(__file__).with_name("vision_fakes.py")
START_S = 45.0  # a Python process importing Starlette on a busy 2-core machine
NEVER = 1000  # failed probes before an outage: 100 s of them (0.1 s apart), longer than the test
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,Y2F0"}}
CHAT = {"model": "m", "messages": [{"role": "user", "content": [IMAGE]}]}


def _announced(
    host: SidecarHost, loop: asyncio.AbstractEventLoop, check: Callable[[], Any], what: str
) -> None:
    """Wait until ``check()`` holds, re-checked on the gateway's loop after each change the sidecar's
    lifecycle announces (``SidecarHost.changes``), with the room a Python start-up needs on a busy machine."""
    wait_on_changes(host.changes, loop, check, what, START_S)


def _pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_the_gateway_starts_restarts_and_stops_its_managed_sidecar() -> None:
    engine = FakeEngine("e")
    port = procs.free_port()
    restart = {"grace_s": 0.0, "backoff_initial_s": 0.01, "backoff_max_s": 0.02, "max_restarts": 3}
    with contextlib.ExitStack() as stack:
        engine_url, _ = stack.enter_context(serve(engine.app()))
        settings = load_settings(
            None,
            backends=[{"id": "e", "url": engine_url, "models": ["m"], "vision": "embeds"}],
            sidecar={
                "url": f"http://127.0.0.1:{port}",
                "managed": {
                    "command": [sys.executable, str(FAKE_SIDECAR), "--port", str(port)],
                    "restart": restart,
                },
            },
            # Only the exit makes the outage: a probe failing in the moment between the kill and the exit
            # being seen would make it one first, and the restart's stop would then be the exit's cause.
            health={"interval_s": 0.1, "timeout_s": PROBE_TIMEOUT_S, "fail_threshold": NEVER},
        )
        app = create_app(settings)
        gw: Gateway = app.state.gateway
        assert gw.sidecar is not None
        host = gw.sidecar
        with serve(app) as (url, server):
            loop = loop_of(server)
            _announced(host, loop, lambda: host.available, "the sidecar available")
            side = httpx.get(url + "/readyz").json()["vision_sidecar"]
            assert (side["state"], side["available"], side["status"]["url"]) == ("ready", True, host.cfg.url)
            assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
            first_pid = host.status()["managed"]["pid"]

            os.kill(first_pid, signal.SIGKILL)

            def restarted() -> bool:
                managed = host.status()["managed"]
                return bool(managed["exits"]) and host.available and managed["pid"] not in (None, first_pid)

            _announced(host, loop, restarted, "the sidecar's exit recorded and a new one available")
            managed = host.status()["managed"]
            (exit_,) = managed["exits"]
            assert (exit_["cause"], exit_["requested"]) == ("was killed by signal 9 (SIGKILL)", False)
            assert "fake sidecar listening on" in "\n".join(exit_["lines"])
            assert managed["restarts_in_window"] == 1
            assert httpx.post(url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
            second_pid = managed["pid"]
        # The gateway's shutdown stopped its child.
        assert _pid_gone(second_pid)
    sent = [json.loads(raw)["messages"][0]["content"][0]["type"] for raw in engine.raw]
    assert sent == ["image_embeds", "image_embeds"]
