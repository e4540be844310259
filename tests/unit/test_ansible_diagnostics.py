"""The tests' Ansible diagnostics: the assertion message of a failed playbook names the host
that failed, even early; the task-times callback records each task per host with the pinned
Ansible, and its summary adds them up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, ansible_task_times, playbook_failure
from tests.support.task_times import main as task_times_main

OUT = (
    """PLAY [Deploy vLLM with vfleet] *************************************************

TASK [Gathering Facts] *********************************************************
ok: [node1]
fatal: [node2]: UNREACHABLE! => changed=false
  msg: 'Failed to connect to the host via ssh: Connection timed out during banner exchange'
  unreachable: true

TASK [vfleet : Create vfleet's folders] ****************************************
"""
    + "changed: [node1] => (item=/opt/vfleet/x)\n" * 400
    + """
PLAY RECAP *********************************************************************
node1                      : ok=60   changed=30   unreachable=0    failed=0
node2                      : ok=0    changed=0    unreachable=1    failed=0
"""
)


def test_an_early_unreachable_host_leads_the_message() -> None:
    msg = playbook_failure(OUT, "make: *** [deploy] Error 2")
    first = msg.split("--- stderr ---")[0]
    assert first.startswith("TASK [Gathering Facts]")
    assert "fatal: [node2]: UNREACHABLE!" in first and "banner exchange" in first
    assert "node2                      : ok=0" in first
    assert "make: *** [deploy] Error 2" in msg
    assert len(msg) < len(OUT)


def test_no_failed_task_says_so() -> None:
    assert playbook_failure("PLAY [x]\nok: [a]\n").startswith("(no failed task in the output)")


def test_task_times_records_each_task_per_host(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    book = tmp_path / "play.yml"
    book.write_text(
        "- hosts: all\n  gather_facts: false\n  tasks:\n"
        "    - name: Sleep a little\n      ansible.builtin.command: sleep 0.5\n"
        "    - name: Say so\n      ansible.builtin.debug: {msg: done}\n"
    )
    env = dict(os.environ, **ansible_task_times(tmp_path))
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "a,b,", "-c", "local",
         "-e", f"ansible_python_interpreter={sys.executable}", str(book)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
    (times,) = tmp_path.glob("task-times-*.jsonl")
    rows = [json.loads(line) for line in times.read_text().splitlines()]
    assert sorted((r["host"], r["task"]) for r in rows) == [
        ("a", "Say so"),
        ("a", "Sleep a little"),
        ("b", "Say so"),
        ("b", "Sleep a little"),
    ]
    slept = [r["end"] - r["start"] for r in rows if r["task"] == "Sleep a little"]
    assert all(s >= 0.5 for s in slept), rows
    assert task_times_main([str(times)]) == 0
    out = capsys.readouterr().out
    assert "a: 2 task runs" in out and "b: 2 task runs" in out and "Sleep a little" in out
