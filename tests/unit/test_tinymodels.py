"""The generator's width scaling (issue 19), without torch: which models it touches, and that a
deploy rebuilds a mid model built before it. The weights themselves: the integration tests
(tests/integration/test_tinymodels.py: the tiny builds byte-identical, the wide one scripted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO
from vfleet.config.profiles import load_model
from vfleet.hostside import tinymodels


def arch(name: str) -> dict[str, object]:
    return load_model(name, REPO / "profiles").arch.model_dump()


@pytest.mark.parametrize("name", ["tiny-dense", "tiny-hybrid-mtp"])
def test_tiny_models_are_not_scaled(name: str) -> None:
    assert tinymodels.residual_scale(arch(name)) == 1.0


def test_mid_model_layers_are_scaled_to_the_tiny_width() -> None:
    # hidden 4096 against the wiring's 256.
    assert tinymodels.residual_scale(arch("mid-hybrid-mtp")) == 1 / 16


def write_manifest(root: Path, generator: str, model: dict[str, object], wired: bool) -> None:
    checked = tinymodels._check_arch(generator, model)
    manifest = tinymodels._manifest(generator, checked, 0, root, wired)
    (root / tinymodels.MANIFEST_NAME).write_text(json.dumps(manifest))


def test_manifest_records_the_scale_only_where_applied(tmp_path: Path) -> None:
    tiny, mid = arch("tiny-hybrid-mtp"), arch("mid-hybrid-mtp")
    write_manifest(tmp_path, "tiny-hybrid-mtp", tiny, wired=True)
    assert "residual_scale" not in json.loads((tmp_path / tinymodels.MANIFEST_NAME).read_text())
    write_manifest(tmp_path, "tiny-hybrid-mtp", mid, wired=False)
    assert "residual_scale" not in json.loads((tmp_path / tinymodels.MANIFEST_NAME).read_text())
    assert tinymodels.manifest_matches(
        tmp_path, "tiny-hybrid-mtp", mid, verify_files=False, wired=False
    )
    write_manifest(tmp_path, "tiny-hybrid-mtp", mid, wired=True)
    manifest = json.loads((tmp_path / tinymodels.MANIFEST_NAME).read_text())
    assert manifest["residual_scale"] == 1 / 16
    assert tinymodels.manifest_matches(tmp_path, "tiny-hybrid-mtp", mid, verify_files=False)


def test_a_mid_build_from_before_the_scaling_is_rebuilt(tmp_path: Path) -> None:
    mid = arch("mid-hybrid-mtp")
    write_manifest(tmp_path, "tiny-hybrid-mtp", mid, wired=True)
    path = tmp_path / tinymodels.MANIFEST_NAME
    manifest = json.loads(path.read_text())
    del manifest["residual_scale"]  # what the builder wrote before issue 19
    path.write_text(json.dumps(manifest))
    assert not tinymodels.manifest_matches(tmp_path, "tiny-hybrid-mtp", mid, verify_files=False)
