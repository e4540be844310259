"""The roles' argument specs agree with their defaults and cover every entry point in use
(vfleet.checks.argument_specs, run by `make lint`); and Ansible itself validates an entry
point's inputs against them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from vfleet.checks.argument_specs import check, main


def test_the_repositorys_roles_agree_with_their_specs(capsys: pytest.CaptureFixture[str]) -> None:
    assert check(REPO / "ansible") == []
    assert main([str(REPO / "ansible")]) == 0
    assert "argument specs agree" in capsys.readouterr().out


def _role(root: Path, defaults: str, specs: str) -> Path:
    role = root / "roles" / "r"
    (role / "defaults").mkdir(parents=True)
    (role / "meta").mkdir()
    (role / "tasks").mkdir()
    (role / "defaults" / "main.yml").write_text(defaults)
    (role / "meta" / "argument_specs.yml").write_text(specs)
    return role


AGREED = """r_name: x
r_list: [a]
r_flag: true
r_dir: "{{ playbook_dir }}/y"
"""
SPECS = """argument_specs:
  main:
    options:
      r_name: {type: str, default: x}
      r_list: {type: list, elements: str, default: [a]}
      r_flag: {type: bool, default: true}
      r_dir: {type: str, default: "{{ playbook_dir }}/y"}
      r_needed: {type: str, required: true}
  stop:
    options:
      r_name: {type: str, default: x}
"""


def test_agreeing_specs_pass(tmp_path: Path) -> None:
    _role(tmp_path, AGREED, SPECS)
    assert check(tmp_path) == []


MAIN_NAME = "      r_name: {type: str, default: x}\n    "
NEEDED = "{type: str, required: true}"


@pytest.mark.parametrize(
    ("defaults", "specs", "key", "says"),
    [
        # A default no entry point declares.
        (AGREED + "r_extra: 1\n", SPECS, "r_extra", "no entry point"),
        # A spec default that differs (in one of two entry points).
        (AGREED, SPECS.replace(MAIN_NAME, MAIN_NAME.replace("x", "z")), "main.r_name", "'z'"),
        # A type the default does not have (a list's elements included; a bool is no int).
        (AGREED, SPECS.replace("type: bool", "type: int"), "main.r_flag", "does not fit"),
        (AGREED.replace("[a]", "[1]"), SPECS.replace("[a]", "[1]"), "main.r_list", "not fit"),
        # A spec default defaults/main.yml lacks.
        (AGREED.replace("r_flag: true\n", ""), SPECS, "main.r_flag", "not in defaults"),
        # An option nothing gives a value.
        (AGREED, SPECS.replace("required: true", "description: d"), "main.r_needed", "neither"),
        # No type, or an unknown one.
        (AGREED, SPECS.replace(NEEDED, "{required: true}"), "main.r_needed", "no type"),
        (AGREED, SPECS.replace(NEEDED, "{type: text, required: true}"), "main.r_needed", "unknown"),
    ],
)  # fmt: skip
def test_each_disagreement_is_named_with_file_and_key(
    tmp_path: Path, defaults: str, specs: str, key: str, says: str
) -> None:
    _role(tmp_path, defaults, specs)
    problems = check(tmp_path)
    assert [(p.key, says in p.message) for p in problems] == [(key, True)], problems


def test_an_entry_point_in_use_needs_a_spec(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _role(tmp_path, AGREED, SPECS)
    (tmp_path / "play.yml").write_text(
        "- hosts: all\n  roles: [r]\n  tasks:\n"
        "    - ansible.builtin.include_role: {name: r, tasks_from: stop}\n"
        "    - ansible.builtin.import_role: {name: r, tasks_from: rollback.yml}\n"
    )
    problems = check(tmp_path)
    assert [(p.file.name, p.key) for p in problems] == [("argument_specs.yml", "rollback")]
    assert "play.yml" in problems[0].message
    assert main([str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "roles/r/meta/argument_specs.yml: rollback: entry point used by play.yml" in err
    assert "1 argument spec problem(s)" in err


def test_a_folder_without_roles_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(tmp_path)]) == 2
    assert "no roles/ folder" in capsys.readouterr().err


def test_ansible_validates_the_rollback_entry_point(tmp_path: Path) -> None:
    """The real path: ansible-playbook stops at the spec check of `tasks_from: rollback`
    before any task runs, naming the variable."""
    play = tmp_path / "play.yml"
    play.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.include_role: {name: vfleet, tasks_from: rollback}\n"
    )
    r = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-c", "local",
         "-e", "vfleet_warmup=maybe", "-e", f"vfleet_base_dir={tmp_path}", str(play)],
        cwd=REPO / "ansible", capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout[-2000:]
    assert "Validating arguments against arg spec 'rollback'" in r.stdout
    assert "vfleet_warmup" in r.stdout and "bool" in r.stdout, r.stdout[-2000:]
    assert "Read the current and previous release links" not in r.stdout
