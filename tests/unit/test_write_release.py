"""The role's release writer (ansible/roles/vfleet/files/write_release.py), run as the role runs
it: the host's Python, the files as JSON on stdin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

WRITER = REPO / "ansible" / "roles" / "vfleet" / "files" / "write_release.py"
FILES = [
    {"name": "vllm.yaml", "content": "port: 8000\n", "mode": "0644"},
    {"name": "vllm.env", "content": "VLLM_API_KEY=secret\n", "mode": "0600"},
    {"name": "launch.sh", "content": "#!/bin/sh\n", "mode": "0755"},
]


def run_writer(dest: Path, files: list[dict[str, str]] = FILES) -> subprocess.CompletedProcess[str]:
    """The writer as the role runs it: `python -c SCRIPT`, the request on stdin."""
    return subprocess.run(
        [sys.executable, "-c", WRITER.read_text()],
        input=json.dumps({"dir": str(dest), "files": files}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def write(dest: Path, files: list[dict[str, str]] = FILES) -> str:
    proc = run_writer(dest, files)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_a_new_release_appears_whole_with_its_modes(tmp_path: Path) -> None:
    dest = tmp_path / "releases" / "abc123"
    dest.parent.mkdir()
    assert write(dest) == "changed"
    assert sorted(p.name for p in dest.iterdir()) == ["launch.sh", "vllm.env", "vllm.yaml"]
    modes = {p.name: p.stat().st_mode & 0o7777 for p in dest.iterdir()}
    assert modes == {"vllm.yaml": 0o644, "vllm.env": 0o600, "launch.sh": 0o755}
    assert dest.stat().st_mode & 0o7777 == 0o755
    assert (dest / "vllm.env").read_text() == "VLLM_API_KEY=secret\n"
    assert [p.name for p in dest.parent.iterdir()] == ["abc123"]  # no temporary folder left
    assert write(dest) == "ok"  # the same release again: nothing to do


def test_a_changed_file_in_an_existing_release_is_put_back(tmp_path: Path) -> None:
    dest = tmp_path / "r"
    dest.mkdir()
    write(dest)
    (dest / "vllm.yaml").write_text("port: 9999\n")
    (dest / "launch.sh").chmod(0o644)
    (dest / "vllm.env").unlink()
    assert write(dest) == "changed"
    assert (dest / "vllm.yaml").read_text() == "port: 8000\n"
    assert (dest / "launch.sh").stat().st_mode & 0o7777 == 0o755
    assert (dest / "vllm.env").stat().st_mode & 0o7777 == 0o600
    assert sorted(p.name for p in dest.iterdir()) == ["launch.sh", "vllm.env", "vllm.yaml"]


def test_a_failed_write_leaves_no_release(tmp_path: Path) -> None:
    dest = tmp_path / "r"
    bad = [*FILES, {"name": "sub/x", "content": "", "mode": "0644"}]  # no such subfolder
    proc = run_writer(dest, bad)
    assert proc.returncode != 0
    assert list(tmp_path.iterdir()) == []  # neither the release nor its temporary folder


def test_a_file_that_is_not_utf8_is_rewritten(tmp_path: Path) -> None:
    dest = tmp_path / "r"
    dest.mkdir()
    write(dest)
    (dest / "vllm.yaml").write_bytes(b"\xff\xfe not utf-8")
    assert write(dest) == "changed"
    assert (dest / "vllm.yaml").read_text() == "port: 8000\n"


def test_a_killed_run_s_temporary_folder_is_removed_and_never_listed(tmp_path: Path) -> None:
    releases = tmp_path / "releases"
    (releases / ".tmp-leftover").mkdir(parents=True)
    (releases / ".tmp-leftover" / "release.json").write_text("{}")
    assert write(releases / "abc") == "changed"
    assert [p.name for p in releases.iterdir()] == ["abc"]


def test_an_error_names_the_cause_and_never_the_content(tmp_path: Path) -> None:
    proc = run_writer(tmp_path / "absent" / "r")
    assert proc.returncode == 1 and proc.stdout == ""
    assert "No such file or directory" in proc.stderr and "secret" not in proc.stderr


def test_a_new_key_reaches_every_kept_release_and_no_old_key_stays(tmp_path: Path) -> None:
    """Issue 22, finding 3: a release that held a key kept it on disk after the key changed
    (and a rollback to it would serve with the replaced key). The key is per instance: every
    kept release gets the new key, or loses it where the instance now has none."""
    releases = tmp_path / "releases"
    releases.mkdir()

    def env(key: str | None, port: int = 8000) -> list[dict[str, str]]:
        text = f"# rule: x\nA='1'\n{f'VLLM_API_KEY={key!r}' + chr(10) if key else ''}B='{port}'\n"
        return [{"name": "vllm.env", "content": text, "mode": "0600"}]

    def deploy(rid: str, files: list[dict[str, str]]) -> str:
        proc = subprocess.run(
            [sys.executable, "-c", WRITER.read_text()],
            input=json.dumps(
                {
                    "dir": str(releases / rid),
                    "files": files,
                    "secrets": {"file": "vllm.env", "keys": ["VLLM_API_KEY"]},
                }
            ),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def on_disk() -> dict[str, str]:
        return {p.parent.name: p.read_text() for p in releases.glob("*/vllm.env")}

    assert deploy("old", env("sk-old", 8000)) == "changed"
    assert deploy("cur", env("sk-old", 9000)) == "changed"
    assert deploy("cur", env("sk-old", 9000)) == "ok"  # nothing to do: nothing rewritten
    # The key rotates: the same release (its id leaves the value out), rewritten in place.
    assert deploy("cur", env("sk-new", 9000)) == "changed"
    assert on_disk() == {
        "old": env("sk-new", 8000)[0]["content"],
        "cur": env("sk-new", 9000)[0]["content"],
    }
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in releases.glob("*/vllm.env"))
    # The key is removed (a new release): no kept release holds one.
    assert deploy("open", env(None, 9000)) == "changed"
    assert not any("VLLM_API_KEY" in text for text in on_disk().values())
    assert on_disk()["old"] == env(None, 8000)[0]["content"]
