"""The example fleet inventory is valid: every host resolves to a plan vfleet can render."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO
from vfleet.render.plan import plan

INVENTORY = REPO / "ansible" / "inventory" / "example-fleet"


def test_every_example_host_renders() -> None:
    bin_dir = Path(sys.executable).parent
    out = subprocess.run(
        [str(bin_dir / "ansible-inventory"), "-i", str(INVENTORY), "--list"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    hostvars = json.loads(out)["_meta"]["hostvars"]
    assert set(hostvars) == {"box1", "box2", "box4-a", "box4-b", "box-a100"}
    profiles = set()
    for name, hv in hostvars.items():
        p = plan(
            hv["vfleet_profile"],
            hv["vfleet_model"],
            sets=hv.get("vfleet_set", []),
            base_dir=hv["vfleet_base_dir"],
            python=hv["vfleet_python"],
            host_name=name,
        )
        assert p.accelerator.kind == "cuda"
        profiles.add(p.profile)
    assert profiles == {"2x2080ti-22g", "4x2080ti-22g", "a100-32g"}
    assert plan("2x2080ti-22g", "qwen3.6-27b-fp8", sets=["port=8001"]).service.port == 8001


def test_the_4_gpu_box_is_two_replicas_on_distinct_gpu_pairs() -> None:
    plans = {
        name: plan(
            "4x2080ti-22g",
            "qwen3.6-27b-awq-int4",
            sets=sets,
            instance=instance,
            host_name=name,
        )
        for name, instance, sets in (
            ("box4-a", "a", ["gpus=[0,1]", "port=8001"]),
            ("box4-b", "b", ["gpus=[2,3]", "port=8002"]),
        )
    }
    a, b = plans["box4-a"], plans["box4-b"]
    assert (a.service.port, b.service.port) == (8001, 8002)
    assert (a.service.unit_name, b.service.unit_name) == (
        "vfleet-vllm@a.service",
        "vfleet-vllm@b.service",
    )
    assert a.dirs.cache != b.dirs.cache and a.dirs.venv == b.dirs.venv
    envs = [p.file("vllm.env") for p in (a, b)]
    assert "CUDA_VISIBLE_DEVICES='0,1'" in envs[0] and "CUDA_VISIBLE_DEVICES='2,3'" in envs[1]
    assert "--tensor-parallel-size" not in envs[0]  # TP lives in the config
    configs = [p.file("vllm.yaml") for p in (a, b)]
    assert all("tensor-parallel-size: 2" in c for c in configs)


LOOKUP_PLAY = """
- hosts: all
  gather_facts: false
  tasks:
    - ansible.builtin.debug:
        msg: "twins of {{ inventory_hostname }}: {{ lookup('vfleet_same_box') | join(',') }}"
"""


def test_same_box_lookup_finds_the_other_instance_of_one_machine(tmp_path: Path) -> None:
    """The role's preflight refuses two instances of one box in one batch: the lookup it uses,
    run by ansible-playbook on an inventory of aliases."""
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        "all:\n  hosts:\n"
        "    a: {ansible_host: 192.0.2.14}\n"
        "    b: {ansible_host: 192.0.2.14}\n"
        "    c: {ansible_host: 192.0.2.14, ansible_port: 2222}\n"
        "    d: {ansible_connection: local}\n"
        "    e: {ansible_connection: local, ansible_host: 192.0.2.99}\n"
    )
    playbook = tmp_path / "play.yml"
    # gather_facts is off and the task is a debug: nothing connects to the 192.0.2.x hosts.
    playbook.write_text(LOOKUP_PLAY)
    bin_dir = Path(sys.executable).parent
    proc = subprocess.run(
        [str(bin_dir / "ansible-playbook"), "-i", str(inventory), str(playbook)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={
            "PATH": f"{bin_dir}:/usr/bin:/bin",
            "ANSIBLE_LOOKUP_PLUGINS": str(REPO / "ansible" / "plugins" / "lookup"),
            "ANSIBLE_NOCOLOR": "1",
        },
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # d and e both run on the control machine: one box, whatever address e names.
    for host, twins in (("a", "b"), ("b", "a"), ("c", ""), ("d", "e"), ("e", "d")):
        assert f'"msg": "twins of {host}: {twins}"' in proc.stdout, proc.stdout


def test_ansible_runs_while_this_process_stdin_is_non_blocking() -> None:
    """Ansible's CLIs refuse a non-blocking stdin ("Ansible requires blocking IO"), and the
    project's CI once handed one to a deploy (an inherited stdin that another process had set
    O_NONBLOCK on). vfleet's own Ansible calls give each a /dev/null of its own: with this
    process's fd 0 a real non-blocking pipe, both still read the inventory. The check first
    shows the fault is real: ansible-inventory with that stdin inherited fails."""
    import os

    from vfleet.fleet.inventory import host_vars, hosts_of

    read, write = os.pipe()
    os.set_blocking(read, False)
    saved = os.dup(0)
    try:
        os.dup2(read, 0)
        inherited = subprocess.run(
            [str(Path(sys.executable).parent / "ansible-inventory"), "--version"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert inherited.returncode != 0 and "blocking IO" in inherited.stderr, inherited
        assert set(hosts_of(str(INVENTORY), "all")) >= {"box1", "box-a100"}
        assert host_vars(str(INVENTORY), "box1")["vfleet_profile"] == "2x2080ti-22g"
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read, write):
            os.close(fd)
