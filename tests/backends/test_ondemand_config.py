"""On-demand settings: the keys, their defaults, and the configurations refused at load."""

from __future__ import annotations

from typing import Any

import pytest

from backends.demand import scheduler_policy
from backends.ondemand import EngineSpec, GroupSpec
from config.settings import ConfigError, load_settings


def engine(bid: str, **managed: Any) -> dict[str, Any]:
    return {
        "id": bid,
        "url": "http://127.0.0.1:1",
        "models": [f"m{bid}"],
        "managed": {"command": "x", **managed},
    }


def test_the_keys_become_the_schedulers_policy() -> None:
    s = load_settings(
        None,
        backends=[
            engine("a", on_demand=True, idle_ttl_s=300, group="gpu0"),
            engine("b", on_demand=True, group="gpu0"),
            engine("c"),  # always on: not the scheduler's
        ],
        groups={"gpu0": {"max_running": 1, "min_residency_s": 60}},
        on_demand={"max_waiting": 8, "wait_timeout_s": 120, "retry_after_s": 3},
    )
    p = scheduler_policy(s)
    assert p.engines == (EngineSpec("a", ("ma",), "gpu0", 300.0), EngineSpec("b", ("mb",), "gpu0", None))
    assert p.groups == {"gpu0": GroupSpec(1, 60.0)}
    assert (p.max_waiting, p.wait_timeout_s, p.retry_after_s) == (8, 120.0, 3.0)


def test_defaults() -> None:
    s = load_settings(None, backends=[engine("a", on_demand=True)])
    assert s.backends[0].managed is not None and s.backends[0].managed.idle_ttl_s is None
    o = s.on_demand
    assert (o.max_waiting, o.wait_timeout_s, o.retry_after_s, o.keepalive_s, o.hold_header) == (
        64,
        900.0,
        5.0,
        5.0,
        False,
    )


@pytest.mark.parametrize(
    ("backends", "groups", "message"),
    [
        ([engine("a", on_demand=True, group="gpu9")], {}, "group 'gpu9' is not declared in groups (none)"),
        ([engine("a", idle_ttl_s=10)], {}, "idle_ttl_s and group apply to on_demand engines only"),
        ([engine("a", group="g")], {"g": {}}, "idle_ttl_s and group apply to on_demand engines only"),
        ([engine("a", on_demand=True)], {"g": {"max_running": 0}}, "groups.g.max_running"),
    ],
)
def test_refused(backends: list[dict[str, Any]], groups: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(None, backends=backends, groups=groups)
    assert message in str(exc.value)
