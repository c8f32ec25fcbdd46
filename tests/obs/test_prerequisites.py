"""Without prometheus or chromium the tests that need them skip; under CI's REQUIRE flag they fail."""

from __future__ import annotations

from collections.abc import Callable

import cdp
import pytest
import test_prometheus

FINDERS: list[tuple[Callable[[], str], str, object]] = [
    (lambda: test_prometheus.binary("prometheus"), test_prometheus.REQUIRE_ENV, test_prometheus.shutil),
    (cdp.chromium_binary, cdp.REQUIRE_ENV, cdp.shutil),
]


@pytest.mark.parametrize(("find", "env", "module"), FINDERS, ids=["prometheus", "chromium"])
def test_missing_binary_skips_or_fails_when_required(
    monkeypatch: pytest.MonkeyPatch, find: Callable[[], str], env: str, module: object
) -> None:
    monkeypatch.setattr(module, "which", lambda _name: None)
    monkeypatch.delenv(env, raising=False)
    with pytest.raises(pytest.skip.Exception):
        find()
    monkeypatch.setenv(env, "1")
    with pytest.raises(pytest.fail.Exception, match=env):
        find()
