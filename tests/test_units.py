"""Rendered systemd units pass `systemd-analyze verify` with no output at all."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from vfleet.compile import resolve
from vfleet.config import HostVars
from vfleet.render import render_files, sidecar_unit_name, unit_name, write_atomic

from .test_rules import COMBOS


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
@pytest.mark.parametrize("which", [unit_name, sidecar_unit_name], ids=["vllm", "sidecar"])
@pytest.mark.parametrize(("profile", "model"), COMBOS)
def test_unit_verifies_clean(tmp_path: Path, profile: str, model: str, which: Any) -> None:
    base = tmp_path / "vfleet"
    launch = resolve(profile, model, host=HostVars(base_dir=str(base)))
    inst = base / "instances" / "main"
    release = inst / "releases" / "r1"
    write_atomic(render_files(launch), release)
    (inst / "current").symlink_to(release)
    # The unit's commands must exist for verify; probe and exporter live in the vLLM venv.
    bindir = Path(launch.venv) / "bin"
    bindir.mkdir(parents=True)
    for tool in ("vfleet-probe", "vfleet-exporter"):
        (bindir / tool).write_text("#!/bin/sh\n")
        (bindir / tool).chmod(0o755)
    (base / "logs").mkdir()
    unit = tmp_path / which("main")
    shutil.copy(release / which("main"), unit)
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        env=dict(os.environ, SYSTEMD_LOG_LEVEL="notice"),
        check=False,
    )
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr
