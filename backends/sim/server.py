"""Serving a simulator with uvicorn: in the foreground (the CLI) or on a background thread (tests, demo)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from starlette.applications import Starlette

from backends.sim.app import create_sim_app, engine_of
from backends.sim.config import SimConfig
from backends.sim.engine import SimEngine

LOCALHOST = "127.0.0.1"
START_TIMEOUT_S = 10.0


def uvicorn_config(
    app: Starlette, host: str, port: int, *, log_level: str, access_log: bool
) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        loop="auto",
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=1,
    )


class SimServer:
    """A simulator on a free local port, served by uvicorn on a daemon thread::

    with SimServer(SimConfig(time_scale=0)) as sim:
        httpx.get(f"{sim.base_url}/health")
    """

    def __init__(
        self, cfg: SimConfig, host: str = LOCALHOST, port: int = 0, log_level: str = "warning"
    ) -> None:
        self.cfg = cfg
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = self._socket.getsockname()[:2]
        self.app = create_sim_app(cfg)
        config = uvicorn_config(self.app, self.host, self.port, log_level=log_level, access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def engine(self) -> SimEngine:
        return engine_of(self.app)

    def start(self) -> None:
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"simulator {self.cfg.name!r} did not start on {self.base_url}")
            time.sleep(0.005)

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._socket.close()
        self.engine.close()

    def __enter__(self) -> SimServer:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def serve(cfg: SimConfig, host: str, port: int, *, log_level: str = "info", access_log: bool = False) -> None:
    """Serve in the foreground until SIGINT/SIGTERM."""
    config = uvicorn_config(create_sim_app(cfg), host, port, log_level=log_level, access_log=access_log)
    uvicorn.Server(config).run()
