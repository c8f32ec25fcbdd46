"""``warmroute --version``: the installed distribution's version, which is pyproject.toml's.
``warmroute serve``: its settings are loaded once and handed to every worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from gateway import cli

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_version_flag_prints_the_project_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"warmroute {VERSION}\n"


def test_version_from_a_bare_checkout_says_it_is_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(_name: str) -> str:
        raise cli.PackageNotFoundError("warmroute")

    monkeypatch.setattr(cli, "version", missing)
    assert cli.installed_version() == "unknown (not installed: pip install .)"


def test_version_flag_as_a_process() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "--version"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, f"warmroute {VERSION}\n", "")


# ``warmroute serve`` with the server swapped for what a worker does with the Config it is handed: uvicorn
# pickles it into each spawned worker (several), or loads it in place (one). Before the worker loads it,
# the config file is overwritten with junk: a worker that read it again would fail or serve other backends.
_SERVE = """
import json, pickle, sys
from pathlib import Path
import config.settings
from gateway import cli

loads = []
validate = config.settings.Settings.__init__

def counting(self, *args, **kwargs):
    loads.append(1)
    validate(self, *args, **kwargs)

config.settings.Settings.__init__ = counting

def run(uvicorn_config):
    Path(sys.argv[1]).write_text("backends: [not, a, backend]")
    worker = pickle.loads(pickle.dumps(uvicorn_config)) if uvicorn_config.workers > 1 else uvicorn_config
    worker.load()
    settings = worker.loaded_app.app.app.state.gateway.settings
    server = settings.server
    listen = [server.host, server.port, server.workers]
    print(json.dumps({"loads": len(loads), "listen": listen, "backends": [b.id for b in settings.backends]}))
    return 0

cli.run = run
raise SystemExit(cli.main(["serve", "--config", sys.argv[1], *sys.argv[2:]]))
"""


def serve_counting(tmp_path: Path, config: str, *flags: str) -> dict[str, object]:
    path = tmp_path / "warmroute.yaml"
    path.write_text(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WARMROUTE_")}
    done = subprocess.run(
        [sys.executable, "-c", _SERVE, str(path), *flags],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


CONFIG = "backends:\n  - {id: a, url: 'http://127.0.0.1:9', models: [m]}\n"


def test_serve_loads_the_settings_once_and_the_app_runs_on_them(tmp_path: Path) -> None:
    result = serve_counting(tmp_path, CONFIG, "--port", "18123", "--host", "127.0.0.2")
    assert result == {"loads": 1, "listen": ["127.0.0.2", 18123, 1], "backends": ["a"]}


def test_workers_are_handed_the_validated_settings_and_read_nothing_again(tmp_path: Path) -> None:
    shared = CONFIG + "redis: {url: 'redis://127.0.0.1:9/0'}\n"
    result = serve_counting(tmp_path, shared, "--workers", "2", "--port", "18124")
    assert result == {"loads": 1, "listen": ["127.0.0.1", 18124, 2], "backends": ["a"]}
