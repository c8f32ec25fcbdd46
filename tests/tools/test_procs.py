"""tools.procs: ports for children to listen on, waiting for a child to answer, and stopping it (and its own
children) afterwards."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tools.procs import (
    LOCALHOST,
    NotReady,
    PortAllocator,
    child,
    ephemeral_ports,
    free_port,
    listen_ports,
    ok,
    python,
    spawn,
    stop,
    wait_http,
)

from upstreams import serve

# Prints the pid of a grandchild it started, then sleeps: both must be gone once the group is stopped.
PARENT_OF_SLEEPER = (
    "import subprocess, sys, time\n"
    "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(60)\n"
)
IGNORES_SIGTERM = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


# Takes argv[2] ports from an allocator over the whole listen range whose cursor is the file argv[1], once
# every sibling is ready (the file argv[3] exists), and prints them as JSON.
TAKES_PORTS = (
    "import json, os, sys, time\n"
    "from pathlib import Path\n"
    "from tools.procs import PortAllocator, ephemeral_ports, listen_ports\n"
    "allocator = PortAllocator(listen_ports(ephemeral_ports()), Path(sys.argv[1]))\n"
    "while not os.path.exists(sys.argv[3]):\n"
    "    time.sleep(0.01)\n"
    "print(json.dumps([allocator.take() for _ in range(int(sys.argv[2]))]))\n"
)


def test_free_ports_are_outside_the_range_outgoing_connections_take() -> None:
    ephemeral = ephemeral_ports()
    with socket.create_server((LOCALHOST, 0)) as server, socket.create_connection(server.getsockname()) as c:
        assert c.getsockname()[1] in ephemeral  # where the kernel puts an outgoing connection's local port
        assert server.getsockname()[1] in ephemeral  # and a port-0 bind: where the old free_port looked
    ports = [free_port() for _ in range(200)]
    assert not set(ports) & set(ephemeral)
    assert set(ports) <= set(listen_ports(ephemeral))
    assert all(p >= 1024 for p in ports)
    assert len(set(ports)) == len(ports)  # handed out in turn, not found again


def test_the_listen_range_lies_beside_the_ephemeral_one() -> None:
    assert listen_ports(range(32768, 61000), span=8192) == range(24576, 32768)
    assert listen_ports(range(1024, 60000), span=8192) == range(60000, 65536)  # more room above
    assert listen_ports(range(2000, 65536), span=8192) == range(1024, 2000)


def test_concurrent_processes_never_get_the_same_port(tmp_path: Path) -> None:
    state, go, each = tmp_path / "cursor", tmp_path / "go", 100
    argv = python("-c", TAKES_PORTS, str(state), str(each), str(go))
    procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, cwd=Path(__file__).parents[2]) for _ in range(4)]
    go.touch()  # all at once: they contend for the cursor
    taken = []
    for proc in procs:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        taken += json.loads(out)
    assert len(taken) == 4 * each
    assert len(set(taken)) == len(taken)


def test_a_port_in_use_is_skipped_and_the_turn_comes_round(tmp_path: Path) -> None:
    ports = [free_port(), free_port(), free_port()]
    state = tmp_path / "cursor"
    state.write_text("0")
    allocator = PortAllocator(ports, state)
    with socket.create_server((LOCALHOST, ports[1])):  # something listens on the second one
        assert [allocator.take() for _ in range(3)] == [ports[0], ports[2], ports[0]]
        with (
            socket.create_server((LOCALHOST, ports[0])),
            socket.create_server((LOCALHOST, ports[2])),
            pytest.raises(OSError, match="in use"),
        ):
            allocator.take()
    assert allocator.take() == ports[1]  # free again: its turn has come


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie waiting for init to reap it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_wait_http_fails_fast_when_the_process_exits_first() -> None:
    proc = spawn(python("-c", "raise SystemExit(3)"))
    started = time.monotonic()
    with pytest.raises(NotReady) as caught:
        wait_http(f"http://127.0.0.1:{free_port()}/", timeout_s=30, process=proc)
    assert caught.value.returncode == 3
    assert time.monotonic() - started < 10  # not the 30 s timeout


def test_wait_http_polls_until_ready_and_times_out_otherwise() -> None:
    hits = 0

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        nonlocal hits
        if scope["type"] != "http":
            return
        hits += 1
        status = 200 if hits >= 3 and scope["path"] == "/ready" else 503
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    with serve(app) as (url, _server):
        wait_http(url + "/ready", ok, timeout_s=10)
        assert hits == 3  # two 503s, then the 200
        with pytest.raises(NotReady) as caught:
            wait_http(url + "/never", ok, timeout_s=0.3)
        assert caught.value.returncode is None


def test_child_stops_the_whole_group_on_the_way_out() -> None:
    with (
        pytest.raises(RuntimeError),
        child(python("-c", PARENT_OF_SLEEPER), stdout=subprocess.PIPE, group=True) as proc,
    ):
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        proc.stdout.close()
        raise RuntimeError("the block fails; the children must still be stopped")
    assert proc.returncode == -signal.SIGTERM
    deadline = time.monotonic() + 5
    while not _gone(grandchild) and time.monotonic() < deadline:  # SIGTERM is delivered asynchronously
        time.sleep(0.02)
    assert _gone(grandchild)


def test_stop_escalates_to_sigkill_when_sigterm_is_ignored() -> None:
    proc = spawn(python("-c", IGNORES_SIGTERM), stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"  # the handler is installed
    stop(proc, timeout_s=0.5)
    assert proc.returncode == -signal.SIGKILL
    stop(proc)  # already exited: nothing to do, no error
    proc.stdout.close()
