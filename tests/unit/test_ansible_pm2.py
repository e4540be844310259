"""roles/vfleet_pm2, the one pm2 implementation of the vfleet and vfleet_prometheus roles, run
by ansible-playbook on this machine.

pm2 itself is a stand-in here: a script at pm2's place that prints what a real pm2 printed
(daemon start-up lines before the JSON, when its daemon was not running) and records its
arguments and environment. The real pm2 runs these tasks in the end-to-end deploy, stop and
rollback (tests/integration/test_e2e_deploy.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO, playbook_failure

JLIST = [
    {"name": "vfleet-vllm-main", "pm2_env": {"status": "online"}},
    {"name": "vfleet-sidecar-main", "pm2_env": {"status": "errored"}},
    {"name": "vfleet-prometheus", "pm2_env": {"status": "online"}},
]
# What pm2 7 prints on `jlist` when the call had to start its daemon.
STARTUP = "[PM2] Spawning PM2 daemon with pm2_home=/x/home\n[PM2] PM2 Successfully daemonized\n"


def _pm2(tmp_path: Path) -> Path:
    pm2_dir = tmp_path / "pm2"
    bin_dir = pm2_dir / "node_modules" / ".bin"
    bin_dir.mkdir(parents=True)
    (tmp_path / "jlist.txt").write_text(STARTUP + json.dumps(JLIST) + "\n")
    script = bin_dir / "pm2"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$* | PM2_HOME=$PM2_HOME | MAKEFLAGS=${{MAKEFLAGS:-unset}}" >> {tmp_path}/calls\n'
        f'[ "$1" = jlist ] && cat {tmp_path}/jlist.txt\n'
        "exit 0\n"
    )
    script.chmod(0o755)
    return pm2_dir


def _play(tmp_path: Path, tasks: str) -> dict[str, object]:
    out = tmp_path / "out.json"
    play = tmp_path / "play.yml"
    play.write_text(
        "- hosts: localhost\n  gather_facts: false\n  tasks:\n"
        + tasks
        + "    - ansible.builtin.copy:\n"
        "        content: >-\n"
        "          {{ {'listed': _vfleet_pm2_listed | default(none),\n"
        "              'names': _vfleet_pm2_names | default(none),\n"
        "              'online': _vfleet_pm2_online | default(none),\n"
        "              'started': __vfleet_pm2_started.changed | default(none)} | to_json }}\n"
        f"        dest: {out}\n"
        "        mode: '0644'\n"
    )
    env = dict(os.environ, MAKEFLAGS="-j2 SET=secret")  # what `make deploy` hands down
    r = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-c", "local",
         "-e", f"ansible_python_interpreter={sys.executable}", str(play)],
        cwd=REPO / "ansible", env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert r.returncode == 0, playbook_failure(r.stdout, r.stderr)
    result: dict[str, object] = json.loads(out.read_text())
    return result


def _import(entry: str, **inputs: str) -> str:
    lines = [
        "    - ansible.builtin.import_role:\n",
        f"        name: vfleet_pm2\n        tasks_from: {entry}\n      vars:\n",
        *(f"        {k}: {v}\n" for k, v in inputs.items()),
    ]
    return "".join(lines)


def test_list_reads_the_json_after_the_daemons_start_up_lines(tmp_path: Path) -> None:
    pm2_dir = _pm2(tmp_path)
    facts = _play(tmp_path, _import("list", vfleet_pm2_dir=str(pm2_dir)))
    assert facts == {
        "listed": True,
        "names": ["vfleet-vllm-main", "vfleet-sidecar-main", "vfleet-prometheus"],
        "online": ["vfleet-vllm-main", "vfleet-prometheus"],
        "started": None,
    }
    # pm2 ran with its own home and without make's environment (env -i).
    assert (tmp_path / "calls").read_text().splitlines() == [
        f"jlist | PM2_HOME={pm2_dir}/home | MAKEFLAGS=unset"
    ]


def test_list_without_pm2_lists_nothing(tmp_path: Path) -> None:
    facts = _play(tmp_path, _import("list", vfleet_pm2_dir=str(tmp_path / "none")))
    assert facts["listed"] is False and facts["names"] == [] and facts["online"] == []


def test_start_deletes_the_files_apps_then_starts_the_file(tmp_path: Path) -> None:
    pm2_dir = _pm2(tmp_path)
    eco = tmp_path / "rel ease" / "ecosystem.config.js"  # a path that needs quoting
    facts = _play(
        tmp_path, _import("start", vfleet_pm2_dir=str(pm2_dir), vfleet_pm2_file=f"'{eco}'")
    )
    assert facts["started"] is True
    assert (tmp_path / "calls").read_text().splitlines() == [
        f"delete {eco} | PM2_HOME={pm2_dir}/home | MAKEFLAGS=unset",
        f"start {eco} | PM2_HOME={pm2_dir}/home | MAKEFLAGS=unset",
    ]
