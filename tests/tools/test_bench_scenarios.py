"""The routing scenarios' variant names, and a variant's gateway run from another checkout (``--tree``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tools import bench, bench_scenarios
from tools.launch import Launcher


@pytest.fixture
def trees(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    main = tmp_path / "main"
    monkeypatch.setattr(bench_scenarios, "TREES", {"main": main})
    return {"main": main}


def test_a_variant_names_its_policy_extras_settings_and_tree(trees: dict[str, Path]) -> None:
    parse = bench_scenarios.parse_variant
    assert parse("ttft") == ("ttft", set(), {}, None)
    assert parse("ttft+weights%main") == ("ttft", {"weights"}, {}, trees["main"])
    assert parse("ttft+kv@stay_margin=0.5;load_share=2%main") == (
        "ttft",
        {"kv"},
        {"stay_margin": 0.5, "load_share": 2},
        trees["main"],
    )
    assert bench_scenarios._extras("ttft+weights+kv%main") == {"weights", "kv"}


def test_a_tree_that_was_not_given_is_refused(trees: dict[str, Path]) -> None:
    with pytest.raises(SystemExit, match="--tree old=PATH"):
        bench_scenarios.parse_variant("ttft%old")


def test_a_tree_must_be_a_checkout(tmp_path: Path) -> None:
    (tmp_path / "gateway").mkdir()
    with pytest.raises(SystemExit, match="--tree expects"):
        bench._trees([f"main={tmp_path}"])
    (tmp_path / "gateway" / "cli.py").write_text("")
    assert bench._trees([f"main={tmp_path}"]) == {"main": tmp_path.resolve()}


def test_a_child_from_another_checkout_imports_that_checkout(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "gateway").mkdir(parents=True)
    (tree / "gateway" / "__init__.py").write_text("")
    probe = "import gateway, os; print(gateway.__file__, os.getcwd())"
    with Launcher("warmroute-test-") as launch:
        child = launch._spawn("probe", 1, [sys.executable, "-c", probe], tree)
        assert child.process.wait(timeout=30) == 0
        where, cwd = child.log_path.read_text().split()
    assert Path(where) == tree / "gateway" / "__init__.py" and Path(cwd) == tree
