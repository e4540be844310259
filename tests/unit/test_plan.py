"""The typed deploy plan and the dict the Ansible role reads.

`plan()` returns a `Plan` (frozen dataclasses); the role sees `Plan.as_dict()`, made only in the
vfleet_plan lookup, and hands that dict back to the vfleet_doctor lookup, which reads it with
`Plan.from_dict()`. tests/golden/plans.json holds the dicts `plan()` returned before the plan was
typed (commit fae2b44), for profiles that cover the branches (CPU and GPU, a named instance and
base dir, a deployment file with pm2, a draft vocabulary built on the host, an API key): the
role must see exactly those. When a change to the templates, profiles or plan is meant to
change them, write the file again with `PYTHONPATH=src .venv/bin/python -m tests.unit.test_plan`
and review its diff.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import FrozenInstanceError, asdict, replace
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from vfleet.fleet.doctor import preflight
from vfleet.fleet.inventory import request
from vfleet.render.plan import Plan, plan, prometheus_plan

GOLDEN = REPO / "tests" / "golden" / "plans.json"
CASES: dict[str, Any] = json.loads(GOLDEN.read_text())


def _plan(args: dict[str, Any]) -> Plan:
    args = dict(args)
    if args.get("deployment"):
        args["deployment"] = str(REPO / args["deployment"])  # stored relative to the checkout
    return plan(**args)


def _json(value: Any) -> Any:
    """As Ansible gets it: through JSON (tuples become lists, keys strings)."""
    return json.loads(json.dumps(value))


@pytest.mark.parametrize("case", sorted(CASES["plan"]))
def test_as_dict_is_the_dict_the_role_read_before_the_plan_was_typed(case: str) -> None:
    want = CASES["plan"][case]["dict"]
    got = _plan(CASES["plan"][case]["args"]).as_dict()
    assert sorted(got) == sorted(want)
    for key in want:
        assert _json(got[key]) == want[key], key


@pytest.mark.parametrize("case", sorted(CASES["plan"]))
def test_from_dict_reads_back_the_plan_as_ansible_hands_it_over(case: str) -> None:
    p = _plan(CASES["plan"][case]["args"])
    back = Plan.from_dict(_json(p.as_dict()))
    assert back == p
    assert back.as_dict() == p.as_dict()


def test_the_plan_is_frozen_and_typed() -> None:
    p = _plan(CASES["plan"]["cpu--tiny-hybrid-mtp"]["args"])
    with pytest.raises(FrozenInstanceError):
        p.service.port = 1  # type: ignore[misc]
    changed = replace(p, service=replace(p.service, port=1))
    assert changed.as_dict()["port"] == 1 and p.as_dict()["port"] != 1
    assert p.software.stack.python == p.as_dict()["stack"]["python"]
    assert p.env()["VLLM_CPU_KVCACHE_SPACE"].isdigit()  # vllm.env, parsed
    assert p.config()["port"] == p.service.port  # vllm.yaml, parsed
    assert "VLLM_API_KEY" in p.secret_keys()


def test_the_logrotate_file_is_the_hosts_not_an_instances() -> None:
    # /etc/logrotate.d/vfleet serves every instance under a base dir: another model or instance
    # renders the same file (a swap wrote it again in /etc when its header named the model),
    # another base dir another one.
    args = CASES["plan"]["cpu--tiny-hybrid-mtp"]["args"]
    text = _plan(args).logrotate
    assert "tiny-hybrid-mtp" not in text and "/opt/vfleet/logs/*.log {" in text
    other = _plan({**args, "model": "tiny-dense", "instance": "b", "sets": ["port=8001"]})
    assert other.logrotate == text
    moved = _plan({**args, "base_dir": "/srv/elsewhere"})
    assert moved.logrotate != text and "/srv/elsewhere/logs/*.log {" in moved.logrotate


def test_prometheus_plan_is_the_dict_it_was() -> None:
    c = CASES["prometheus_plan"]
    target = plan(*c["targets_from"]).as_dict()["monitoring"] | {"address": c["address"]}
    assert _json(prometheus_plan([target], **c["args"])) == c["dict"]


PLAYBOOK = """\
- hosts: localhost
  gather_facts: false
  tasks:
    - ansible.builtin.set_fact:
        plan: "{{ lookup('vfleet_plan', profile='cpu', model='tiny-hybrid-mtp', base_dir=base) }}"
    - ansible.builtin.set_fact:
        req: "{{ lookup('vfleet_doctor', plan=plan) }}"
    - ansible.builtin.command:
        cmd: "{{ ansible_python_interpreter }} {{ req.script }} {{ req.request | to_json | quote }}"
      register: hostfacts
      changed_when: false
    - ansible.builtin.set_fact:
        doctor: "{{ lookup('vfleet_doctor', plan=plan, facts=hostfacts.stdout | from_json) }}"
    - ansible.builtin.copy:
        content: >-
          {{ {'plan': plan, 'request': req.request, 'facts': hostfacts.stdout | from_json,
              'findings': doctor.findings} | to_json }}
        dest: "{{ out }}"
        mode: "0600"
"""


def test_the_role_hands_the_plan_dict_back_to_the_doctor_lookup(tmp_path: Path) -> None:
    """The real path of the deploy's preflight (tasks/preflight.yml): ansible-playbook's
    vfleet_plan lookup makes the dict, the vfleet_doctor lookup reads it back (Ansible hands
    lookups lazy containers), hostfacts.py runs on this machine, and the lookup judges its
    facts as `vfleet doctor` does."""
    (tmp_path / "p.yml").write_text(PLAYBOOK)
    out = tmp_path / "out.json"
    base = tmp_path / "vf"
    r = subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "ansible-playbook"),
            *("-i", "localhost,", "-c", "local", str(tmp_path / "p.yml")),
            *("-e", f"base={base}", "-e", f"out={out}"),
            *("-e", f"ansible_python_interpreter={sys.executable}"),
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
    p = plan("cpu", "tiny-hybrid-mtp", base_dir=str(base))
    assert got["plan"] == _json(p.as_dict())
    assert got["request"] == _json(request(p))
    assert got["findings"] == [asdict(f) for f in preflight(p, got["facts"])]
    assert [f["check"] for f in got["findings"]][:3] == ["python", "os-packages", "time-sync"]


def _capture() -> dict[str, Any]:
    out: dict[str, Any] = {"captured_from": "python -m tests.unit.test_plan", "plan": {}}
    for case, c in CASES["plan"].items():
        out["plan"][case] = {"args": c["args"], "dict": _json(_plan(c["args"]).as_dict())}
    p = CASES["prometheus_plan"]
    target = plan(*p["targets_from"]).as_dict()["monitoring"] | {"address": p["address"]}
    out["prometheus_plan"] = {**p, "dict": _json(prometheus_plan([target], **p["args"]))}
    return out


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(_capture(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}", file=sys.stderr)
