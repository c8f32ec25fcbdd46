"""``warmroute --version``: the installed distribution's version, which is pyproject.toml's."""

from __future__ import annotations

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
