"""`vfleet tune`'s write of step-times.json into the instance folder (fleet/tune.py
put_file_script), run by a real sh as this user: only into a folder of that user alone, and a
link at the file's place is replaced, never written through."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from vfleet.fleet.tune import put_file_script


def put(path: Path, text: str = '{"depths": {}}\n') -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", "-c", put_file_script(str(path))],
        input=text,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_writes_whole_with_mode_0644_and_no_temporary_left(tmp_path: Path) -> None:
    folder = tmp_path / "instances" / "main"  # made by the script, as mkdir -p would
    proc = put(folder / "step-times.json")
    assert proc.returncode == 0, proc.stderr
    assert (folder / "step-times.json").read_text() == '{"depths": {}}\n'
    assert (folder / "step-times.json").stat().st_mode & 0o777 == 0o644
    assert sorted(p.name for p in folder.iterdir()) == ["step-times.json"]


def test_a_link_at_the_files_place_is_replaced_not_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("untouched\n")
    folder = tmp_path / "main"
    folder.mkdir(mode=0o755)
    (folder / "step-times.json").symlink_to(victim)
    assert put(folder / "step-times.json").returncode == 0
    assert victim.read_text() == "untouched\n"
    assert not (folder / "step-times.json").is_symlink()


def test_a_folder_others_can_write_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "main"
    folder.mkdir()
    os.chmod(folder, 0o777)
    proc = put(folder / "step-times.json")
    assert proc.returncode == 3
    assert "is not a folder of" in proc.stderr and "nothing written" in proc.stderr
    assert list(folder.iterdir()) == []


def test_a_folder_that_is_a_link_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o755)
    (tmp_path / "main").symlink_to(real)
    proc = put(tmp_path / "main" / "step-times.json")
    assert proc.returncode == 3, proc.stderr
    assert list(real.iterdir()) == []


def test_odd_characters_in_the_path_stay_one_word(tmp_path: Path) -> None:
    folder = tmp_path / "a b;$(touch pwned)"
    proc = put(folder / "step-times.json")
    assert proc.returncode == 0, proc.stderr
    assert (folder / "step-times.json").is_file()
    assert not (Path.cwd() / "pwned").exists() and not (tmp_path / "pwned").exists()
