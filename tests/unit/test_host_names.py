"""An inventory host name becomes a path component (perf-gate's report, tune's folder and
host_vars/<host>/, swap's report): Ansible accepts `../../..` as a host name, so every fleet
command checks it against the one grammar (config.schema.HOST_NAME_PATTERN) before that
(issue 29, finding 7.2). Real inventories, the real `ansible-inventory` and the real CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vfleet.errors import VfleetError
from vfleet.fleet.tune_report import host_vars_dir, write_overrides

BAD = "../../escaped"


def inventory(folder: Path, host: str) -> Path:
    folder.mkdir(parents=True)
    path = folder / "inv.yml"
    path.write_text(f'all:\n  hosts:\n    "{host}":\n      ansible_connection: local\n')
    return path


def files_under(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


@pytest.mark.parametrize(
    "command",
    [
        ["tune", BAD],
        ["doctor", BAD],
        ["releases", BAD],
        ["caches", "pack", BAD, "--out", "seed.tar", "--key", "../../../op.key"],
        ["swap", "all", "--model", "tiny-dense"],
        [
            "perf-gate",
            "check",
            "--host",
            BAD,
            "--url",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--release",
            "r",
            "--weights",
            "w",
            "--report-dir",
            "reports",
        ],
    ],
    ids=lambda c: " ".join(c[:2]),
)
def test_a_host_name_that_is_a_path_is_refused_before_anything_is_written(
    tmp_path: Path, command: list[str]
) -> None:
    work = tmp_path / "a/b/c"
    inv = inventory(work, BAD)
    key = tmp_path / "op.key"  # `caches pack` checks its signing key (a 0600 file) first
    key.write_text("not read: the host name is refused before\n")
    key.chmod(0o600)
    before = files_under(tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", "vfleet.cli.main", *command, "-i", str(inv)],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"host name '{BAD}' is not a plain inventory host name" in p.stderr, p.stderr
    assert "fix: rename the host" in p.stderr and "Traceback" not in p.stderr
    assert files_under(tmp_path) == before  # nothing inside the folder, nor outside it


def test_tunes_host_vars_folder_is_never_outside_the_inventory(tmp_path: Path) -> None:
    inv = inventory(tmp_path / "inv", "node1")
    for host in (BAD, "..", ".", "a/b", "", "-x", "node1\n"):
        with pytest.raises(VfleetError, match="not a plain inventory host name"):
            write_overrides(inv, host, ["x=1"], "h", "t")
    assert files_under(tmp_path) == {tmp_path / "inv", inv}
    assert host_vars_dir(inv, "node-1.example_2") == tmp_path / "inv/host_vars/node-1.example_2"
