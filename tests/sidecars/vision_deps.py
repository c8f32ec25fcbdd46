"""Skip the sidecar tests without its optional dependencies, unless WARMROUTE_REQUIRE_VISION=1 (CI)."""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRE_ENV = "WARMROUTE_REQUIRE_VISION"
PACKAGES = ("torch", "transformers", "PIL", "safetensors")


def require_vision() -> None:
    missing = [p for p in PACKAGES if importlib.util.find_spec(p) is None]
    if not missing:
        return
    message = f"vision sidecar dependencies missing ({', '.join(missing)}): pip install -e '.[vision]'"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{message} ({REQUIRE_ENV}=1)", pytrace=False)
    pytest.skip(message, allow_module_level=True)
