"""Rendered systemd units: `systemd-analyze verify` with no output at all, an exposure score
within the limits docs/SECURITY.md states, and the role's verifier refusing any directive the
template cannot produce."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.support.cases import COMBOS
from vfleet.config.schema import HostVars
from vfleet.engine.compile import Launch, resolve
from vfleet.render.release import (
    expected_unit_directives,
    render_files,
    sidecar_unit_name,
    unit_directives,
    unit_name,
    write_atomic,
)

NO_SYSTEMD = shutil.which("systemd-analyze") is None
VERIFIER = REPO / "ansible" / "roles" / "vfleet" / "files" / "vfleet-verify-unit"
# docs/SECURITY.md ("Unit hardening"): the most `systemd-analyze security` may score.
SCORE_LIMITS = {
    ("sidecar", False): 2.0,
    ("vllm", False): 3.5,
    ("sidecar", True): 2.0,
    ("vllm", True): 4.5,
}


def rendered_unit(tmp_path: Path, profile: str, model: str, which: Any) -> tuple[Launch, Path]:
    """A rendered release laid out as on a host, with the commands its units run in place."""
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
    return launch, unit


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        env=dict(os.environ, SYSTEMD_LOG_LEVEL="notice"),
        check=False,
    )


@pytest.mark.skipif(NO_SYSTEMD, reason="systemd-analyze not installed")
@pytest.mark.parametrize("which", [unit_name, sidecar_unit_name], ids=["vllm", "sidecar"])
@pytest.mark.parametrize(("profile", "model"), COMBOS)
def test_unit_verifies_clean(tmp_path: Path, profile: str, model: str, which: Any) -> None:
    _, unit = rendered_unit(tmp_path, profile, model, which)
    proc = verify(unit)
    assert proc.returncode == 0 and proc.stdout == "" and proc.stderr == "", proc.stderr


@pytest.mark.skipif(NO_SYSTEMD, reason="systemd-analyze not installed")
@pytest.mark.parametrize("which", ["vllm", "sidecar"])
@pytest.mark.parametrize(("profile", "model"), COMBOS)
def test_exposure_score_within_its_limit(
    tmp_path: Path, profile: str, model: str, which: str
) -> None:
    """`systemd-analyze security --offline=yes` on the rendered unit, as the docs state it.

    Offline mode scores the unit file alone (systemd 250 and later); the fleet host's test
    scores the installed, running units the same way.
    """
    launch = resolve(profile, model)
    name = {"vllm": unit_name, "sidecar": sidecar_unit_name}[which]("main")
    unit = tmp_path / name
    unit.write_text(next(f.content for f in render_files(launch) if f.name == name))
    gpu = launch.profile.accelerator.kind == "cuda"
    score = exposure_score(unit)
    assert score <= SCORE_LIMITS[(which, gpu)], f"{name} on {profile}: {score}"


def exposure_score(unit: Path) -> float:
    proc = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        check=False,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", proc.stdout)
    assert found, f"systemd-analyze security --offline=yes gave no score: {proc.stderr}"
    return float(found.group(1))


def run_verifier(unit: Path, name: str, directives: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VERIFIER), name, str(unit), " ".join(directives)],
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.skipif(NO_SYSTEMD, reason="systemd-analyze not installed")
@pytest.mark.parametrize("which", ["vllm", "sidecar"])
def test_role_verifier_passes_the_unit_and_rejects_an_injected_directive(
    tmp_path: Path, which: str
) -> None:
    fn = {"vllm": unit_name, "sidecar": sidecar_unit_name}[which]
    launch, unit = rendered_unit(tmp_path, "cpu", "tiny-hybrid-mtp", fn)
    expected = expected_unit_directives(launch, which)
    assert expected == unit_directives(unit.read_text())
    clean = run_verifier(unit, fn("main"), expected)
    assert clean.returncode == 0, clean.stderr
    # What a newline in a value would make of ExecStart=: one more directive that systemd
    # itself accepts (verify passes on it), the role must not.
    text = unit.read_text()
    injected = tmp_path / "injected" / fn("main")
    injected.parent.mkdir()
    injected.write_text(
        re.sub(r"^(ExecStart=.*)$", r"\1\nExecStartPre=/bin/touch /tmp/pwned", text, flags=re.M)
    )
    assert verify(injected).returncode == 0
    bad = run_verifier(injected, fn("main"), expected)
    assert bad.returncode != 0 and "ExecStartPre" in bad.stderr, bad.stderr
    # A value ending in a backslash would join the next line onto its own.
    joined = injected.parent / "joined"
    joined.write_text(text.replace("Type=exec", "Type=exec\\"))
    bad = run_verifier(joined, fn("main"), expected)
    assert bad.returncode != 0 and "backslash" in bad.stderr, bad.stderr
