"""Issue 22, finding 2: the API key reaches a deploy through a file, never a command line.

`make deploy SET='api_key=...'` put the key into ansible-playbook's argv (readable by every
local user in /proc for the whole deploy), into make's echoed command line and, through
MAKEFLAGS and SET, into pm2's stored environment of both apps. Now make refuses it and takes
API_KEY_FILE=path; only the path travels and the plan lookup reads the key. Real make, real
ansible-playbook with the role's lookup plugin, the real CLI; the pm2 side is checked on the
fleet hosts (tests/integration/test_fleet_hosts.py, /proc and `pm2 jlist` scanned).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO, Result
from vfleet.errors import VfleetError
from vfleet.render.plan import plan

KEY = "sk-file-key-4b7e91"


def key_file(tmp_path: Path, text: str = KEY + "\n", mode: int = 0o600) -> Path:
    path = tmp_path / "api.key"
    path.write_text(text)
    path.chmod(mode)
    return path


def env_file(p: dict[str, object]) -> str:
    files = p["files"]
    assert isinstance(files, list)
    return str(next(f["content"] for f in files if f["name"] == "vllm.env"))


def make(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_make_refuses_a_key_in_set_and_names_api_key_file() -> None:
    r = make("deploy", f"SET=port=8001 api_key={KEY}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "API_KEY_FILE=" in r.stderr and "every local user" in r.stderr
    assert KEY not in r.stdout + r.stderr
    assert "ansible-playbook" not in r.stdout  # refused before anything ran


def test_make_passes_the_file_path_never_the_key(tmp_path: Path) -> None:
    path = key_file(tmp_path)
    # -n: the commands make would run (and echo), not run.
    r = make("-n", "deploy", f"API_KEY_FILE={path}", "SET=port=8001")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if "ansible-playbook" in x)
    assert f"-e vfleet_api_key_file={path}" in line and KEY not in r.stdout


def test_the_plan_reads_the_key_file_into_the_0600_env_file_only(tmp_path: Path) -> None:
    p = plan("cpu", "tiny-dense", api_key_file=str(key_file(tmp_path)))
    assert f"VLLM_API_KEY='{KEY}'" in env_file(p)
    for f in p["files"]:
        assert (KEY in f["content"]) == (f["name"] == "vllm.env"), f["name"]
    # The same release as the key given as a setting (a vault variable in the inventory).
    assert p["release_id"] == plan("cpu", "tiny-dense", sets=[f"api_key={KEY}"])["release_id"]


@pytest.mark.parametrize(
    ("text", "mode", "why"),
    [
        (KEY + "\n", 0o644, "mode 0644"),
        (KEY + "\n", 0o640, "mode 0640"),
        ("", 0o600, "alone on one line"),
        (KEY + "\nsecond line\n", 0o600, "alone on one line"),
        (f" {KEY}\n", 0o600, "alone on one line"),
    ],
)
def test_a_bad_key_file_is_refused_without_showing_its_content(
    tmp_path: Path, text: str, mode: int, why: str
) -> None:
    path = key_file(tmp_path, text, mode)
    with pytest.raises(VfleetError) as exc:
        plan("cpu", "tiny-dense", api_key_file=str(path))
    msg = exc.value.render()
    assert why in msg and str(path) in msg and "API_KEY_FILE" in msg and "fix:" in msg
    assert KEY not in msg


def test_a_missing_key_file_and_a_key_given_twice_are_refused(tmp_path: Path) -> None:
    with pytest.raises(VfleetError, match="cannot read the API key file"):
        plan("cpu", "tiny-dense", api_key_file=str(tmp_path / "nope"))
    with pytest.raises(VfleetError, match="given twice"):
        plan("cpu", "tiny-dense", sets=["api_key=x"], api_key_file=str(key_file(tmp_path)))


def test_the_role_lookup_reads_the_key_file(tmp_path: Path) -> None:
    """The real path: ansible-playbook's lookup (ansible/plugins/lookup/vfleet_plan.py) gets the
    file's path as a variable and renders the env file with the key."""
    path = key_file(tmp_path)
    playbook = tmp_path / "p.yml"
    out = tmp_path / "env.json"
    playbook.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.copy:\n"
        "        content: >-\n"
        "          {{ lookup('vfleet_plan', profile='cpu', model='tiny-dense',\n"
        "             api_key_file=vfleet_api_key_file).files\n"
        "             | selectattr('name', 'equalto', 'vllm.env') | first | to_json }}\n"
        f"        dest: {out}\n"
        "        mode: '0600'\n"
        "      no_log: true\n"
    )
    r = subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "ansible-playbook"),
            "-i",
            "localhost,",
            "-c",
            "local",
            str(playbook),
            "-e",
            f"vfleet_api_key_file={path}",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
        ],
        cwd=REPO,
        env=dict(os.environ, ANSIBLE_CONFIG=str(REPO / "ansible" / "ansible.cfg")),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["mode"] == "0600" and f"VLLM_API_KEY='{KEY}'" in got["content"]
    assert KEY not in r.stdout + r.stderr


def test_swap_refuses_a_key_on_its_command_line(cli: Callable[..., Result]) -> None:
    res = cli("swap", "localhost", "--model", "tiny-dense", "--set", f"api_key={KEY}")
    assert res.rc == 2 and "--api-key-file" in res.err and KEY not in res.err


def test_swap_passes_the_key_file_path_to_the_playbook(
    cli: Callable[..., Result], tmp_path: Path
) -> None:
    inv = tmp_path / "inv.yml"
    inv.write_text("all:\n  hosts:\n    a: {ansible_connection: local, vfleet_set: [port=18001]}\n")
    path = key_file(tmp_path)
    res = cli(
        "swap", "a", "-i", str(inv), "--model", "tiny-dense", "--api-key-file", str(path),
        "--base-dir", str(tmp_path / "vf"), "--dry-run",
    )  # fmt: skip
    assert res.rc == 0, res.err
    extra = json.loads(res.out.splitlines()[0].split(" ", 5)[5])
    assert extra["vfleet_api_key_file"] == str(path) and KEY not in res.out
