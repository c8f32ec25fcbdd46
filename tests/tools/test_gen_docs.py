"""tools.gen_docs: the type and default spelling of the configuration reference, the environment-name
lookup, and ``--check`` on a stale page."""

from __future__ import annotations

from pathlib import Path

import pytest

from config.settings import BackendConfig, RoutingConfig, SidecarConfig
from tools import gen_docs


def test_types_and_defaults_are_spelled_for_yaml_readers() -> None:
    assert gen_docs.type_name(RoutingConfig.model_fields["policy"].annotation).startswith("one of `affinity`")
    assert gen_docs.type_name(BackendConfig.model_fields["models"].annotation) == "list of string"
    assert gen_docs.type_name(SidecarConfig.model_fields["managed"].annotation) == "section or null"
    assert gen_docs.default_text(RoutingConfig.model_fields["repin_on_spill"]) == "`false`"
    assert gen_docs.default_text(BackendConfig.model_fields["url"]) == "required"


def test_env_field_follows_sections_only() -> None:
    assert gen_docs.env_field("WARMROUTE_ROUTING__POLICY") is RoutingConfig.model_fields["policy"]
    assert gen_docs.env_field("WARMROUTE_SIDECAR__URL") is SidecarConfig.model_fields["url"]
    assert gen_docs.env_field("WARMROUTE_ROUTING__NOPE") is None
    assert gen_docs.env_field("OTHER_ROUTING__POLICY") is None


def test_check_names_a_stale_page_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    page = tmp_path / "page.md"
    page.write_text("old\n")
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    monkeypatch.setattr(gen_docs, "render", lambda: {page: "new\n"})
    assert gen_docs.main(["--check"]) == 1
    assert page.read_text() == "old\n" and "stale: page.md" in capsys.readouterr().out
    assert gen_docs.main([]) == 0
    assert page.read_text() == "new\n"
    assert gen_docs.main(["--check"]) == 0
