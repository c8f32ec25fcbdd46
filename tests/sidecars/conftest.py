"""Fixtures for the vision sidecar: the tiny checkpoint (built once, cached on disk), an encoder, images."""

from __future__ import annotations

import fcntl
import hashlib
import inspect
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from vision_deps import require_vision

CACHE = Path(os.environ.get("WARMROUTE_MODEL_CACHE", Path.home() / ".cache" / "warmroute" / "models"))


def cached_build(name: str, builder: Callable[[Path], Path]) -> Path:
    """Built at most once per machine: keyed by the builder's source and the transformers version."""
    require_vision()
    import tiny_vl
    import transformers

    digest = hashlib.sha256(
        inspect.getsource(tiny_vl).encode() + transformers.__version__.encode()
    ).hexdigest()
    folder = CACHE / f"{name}-{digest[:12]}"
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test sessions never build into one folder at once
        if not (folder / "DONE").is_file():
            shutil.rmtree(folder, ignore_errors=True)
            builder(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_checkpoint() -> Path:
    import tiny_vl

    return cached_build("tiny-qwen2_5_vl", tiny_vl.build)


@pytest.fixture(scope="session")
def tiny_qwen3_5_checkpoint() -> Path:
    import tiny_vl

    return cached_build("tiny-qwen3_5", tiny_vl.build_qwen3_5)


@pytest.fixture(scope="session")
def encoder(tiny_checkpoint: Path) -> Any:
    from sidecars.vision.encoder import Encoder
    from sidecars.vision.settings import VisionSettings

    return Encoder(VisionSettings(checkpoint=tiny_checkpoint))


@pytest.fixture
def copy_checkpoint(tiny_checkpoint: Path, tmp_path: Path) -> Iterator[Path]:
    """A private copy to break (remove a shard, edit the index) without touching the cached one."""
    target = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, target)
    yield target
