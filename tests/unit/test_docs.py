"""Docs that must not go stale."""

from __future__ import annotations

from tests.conftest import REPO
from vfleet.config.schema import ServeSettings


def test_every_setting_is_documented() -> None:
    doc = (REPO / "docs" / "PROFILES.md").read_text()
    missing = [k for k in ServeSettings.model_fields if f"`{k}`" not in doc]
    assert not missing, f"docs/PROFILES.md does not list {missing}"


def test_readme_starts_with_the_two_commands() -> None:
    readme = (REPO / "README.md").read_text()
    block = readme.split("```sh", 1)[1].split("```", 1)[0]
    assert [ln.split("#")[0].strip() for ln in block.strip().splitlines()] == [
        "make deploy",
        "make test",
    ]
    ci = (REPO / ".ci" / "run").read_text()
    assert ci.strip().splitlines()[-1] == "make test"
