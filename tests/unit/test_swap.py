"""`vfleet swap`: its downtime arithmetic, its reading of Ansible's recap, its bad-input errors
and the playbook command it runs. The swap itself, on real hosts with real vLLM servers, is in
test_fleet_hosts.py (make test-fleet)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from vfleet.fleet import swap
from vfleet.fleet.swap import HostReport, Sample


def samples(*states: tuple[float, bool]) -> list[Sample]:
    return [Sample(t, ok, "m" if ok else None) for t, ok in states]


def test_outage_runs_from_the_last_success_to_the_next() -> None:
    found = swap.outages(samples((0, True), (1, True), (2, False), (3, False), (4.5, True)))
    assert [(o.start, o.end, o.ongoing) for o in found] == [(1, 4.5, False)]
    assert found[0].seconds == 3.5


def test_outages_add_up_and_an_unfinished_one_is_ongoing() -> None:
    found = swap.outages(
        samples((0, False), (1, True), (2, True), (3, False), (4, True), (5, False), (6, False))
    )
    assert [(o.start, o.end, o.ongoing) for o in found] == [
        (0, 1, False),
        (2, 4, False),
        (4, 6, True),
    ]


def test_no_failure_no_outage() -> None:
    assert swap.outages(samples((0, True), (1, True))) == []


RECAP_OUT = """
TASK [Stop the rollout] ****
fatal: [node1]: FAILED! => {"changed": false, "msg": "swap of node1 ..."}

PLAY RECAP *********************************************************************
node1    : ok=40   changed=9    unreachable=0    failed=1    skipped=12   rescued=1  ignored=0
node2    : ok=3    changed=0    unreachable=0    failed=0    skipped=0    rescued=0  ignored=0
"""


def test_recap_is_read_per_host() -> None:
    recap = swap.parse_recap(RECAP_OUT)
    assert recap["node1"]["failed"] == 1 and recap["node1"]["rescued"] == 1
    assert recap["node2"] == {
        "ok": 3,
        "changed": 0,
        "unreachable": 0,
        "failed": 0,
        "skipped": 0,
        "rescued": 0,
        "ignored": 0,
    }
    assert swap.parse_recap("no recap at all") == {}


def test_why_is_the_last_fatal_message_per_host() -> None:
    out = (
        RECAP_OUT
        + 'fatal: [node2 -> localhost]: FAILED! => {"msg": "first"}\n'
        + "fatal: [node3]: UNREACHABLE! => "
        + '{"changed": false, "msg": "Failed to connect to the host via ssh: ssh: connect to '
        + 'host 127.0.0.1 port 2222: Connection refused", "unreachable": true}\n'
        + "fatal: [node2]: FAILED! => not json\n"
    )
    why = swap.host_errors(out)
    assert why["node1"] == "swap of node1 ..."
    assert why["node2"] == "not json"
    assert why["node3"].startswith("unreachable: Failed to connect to the host via ssh")
    assert swap.host_errors("ok: [node1]") == {}


@pytest.mark.parametrize(
    ("recap", "before", "after", "says"),
    [
        (None, "a", "a", "not touched"),
        ({"failed": 0}, "a", "b", "swapped to b"),
        ({"failed": 1, "rescued": 1}, "a", "a", "back on a (previous release), serving"),
        ({"failed": 1, "rescued": 1}, "a", None, "NOT serving"),
        ({"unreachable": 1}, "a", None, "unreachable"),
        ({"failed": 0}, "a", "a", "but it serves a, not b"),
        ({"failed": 0}, "a", "b", "swapped to b"),
    ],
)
def test_outcome_names_what_happened(
    recap: dict[str, int] | None, before: str, after: str | None, says: str
) -> None:
    r = HostReport("h", "http://x", "b", model_before=before, model_after=after, recap=recap)
    assert says in swap.outcome(r)


def test_watcher_counts_a_closed_port_as_down() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens
    w = swap.Watcher("h", f"http://127.0.0.1:{port}", None, 0.05, time.monotonic())
    w.start()
    time.sleep(0.3)
    w.done.set()
    w.join(timeout=10)
    assert len(w.samples) >= 3 and not any(s.ok for s in w.samples)
    assert "Connection refused" in (w.samples[0].error or "")
    assert [o.ongoing for o in swap.outages(w.samples)] == [True]


def test_bad_input_exits_2_and_says_what_to_fix(cli) -> None:  # type: ignore[no-untyped-def]
    res = cli("swap", "localhost", "--model", "no-such-model")
    assert res.rc == 2
    assert "unknown model preset 'no-such-model'" in res.err and "tiny-dense" in res.err
    res = cli("swap", "localhost", "--model", "tiny-dense", "--serial", "1,half")
    assert res.rc == 2 and "--serial" in res.err and "1,50%" in res.err
    res = cli("swap", "nowhere", "--model", "tiny-dense", "--dry-run")
    assert res.rc == 2 and "no inventory host matches 'nowhere'" in res.err


def test_dry_run_names_the_playbook_the_hosts_and_the_new_served_name(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    inv = tmp_path / "inv.yml"
    inv.write_text(
        "all:\n  children:\n    pair:\n      hosts:\n"
        "        a: {ansible_connection: local, vfleet_set: [port=18001, api_key=k1]}\n"
        "        b: {ansible_connection: local, vfleet_set: [port=18002]}\n"
    )
    res = cli(
        "swap", "pair", "-i", str(inv), "--model", "tiny-dense", "--set",
        "served_model_name=chat", "--serial", "1,100%", "--base-dir", str(tmp_path / "vf"),
        "--dry-run",
    )  # fmt: skip
    assert res.rc == 0, res.err
    first, *hosts = res.out.strip().splitlines()
    argv = first.split(" ", 5)
    assert argv[1:4] == ["-i", str(inv), str(REPO / "ansible" / "swap.yml")]
    extra = json.loads(argv[5])
    # The performance gate is on by default: the bench's options, and where verdicts go.
    gate = extra.pop("vfleet_perf_gate")
    assert gate["inventory"] == str(inv) and gate["args"] == ["--concurrency", "1"]
    assert Path(gate["report_dir"]).name.startswith("vfleet-perf-")
    assert extra == {
        "vfleet_hosts": "pair",
        "vfleet_model": "tiny-dense",
        # The host's own vfleet_set (ports, key) stays; the swap's settings come after it.
        "vfleet_extra_set": ["served_model_name=chat"],
        "vfleet_swap_serial": [1, "100%"],
        "vfleet_base_dir": str(tmp_path / "vf"),
    }
    assert hosts == [
        "a: watch http://127.0.0.1:18001, expect chat after the swap",
        "b: watch http://127.0.0.1:18002, expect chat after the swap",
    ]


def test_swap_playbook_passes_ansible_syntax_check(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            str(REPO / ".venv" / "bin" / "ansible-playbook"),
            "-i", "localhost,", "--syntax-check", str(REPO / "ansible" / "swap.yml"),
        ],
        capture_output=True, text=True, timeout=120, check=False,
        env={"ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_an_alias_is_followed_to_the_weights_behind_it() -> None:
    # Clients keep calling "chat"; the report says which model folder serves it.
    r = HostReport("h", "http://x", "chat", "tiny-dense", recap={"failed": 0})
    r.model_before, r.weights_before = "chat", "tiny-hybrid-mtp"
    r.model_after, r.weights_after = "chat", "tiny-dense"
    assert swap.outcome(r) == "swapped to tiny-dense as chat"
    r.weights_after = "tiny-hybrid-mtp"  # same name, old weights: not swapped
    assert "not tiny-dense as chat" in swap.outcome(r)
    r.recap = {"failed": 1, "rescued": 1}
    assert "back on tiny-hybrid-mtp as chat (previous release)" in swap.outcome(r)


def test_the_report_gives_each_stopped_host_its_reason() -> None:
    lost = HostReport("node1", "http://x", "b", model_before="a", recap={"unreachable": 1})
    lost.why, lost.left_drained = "unreachable: Failed to connect to the host via ssh", True
    lost.outcome = swap.outcome(lost)
    fine = HostReport("node2", "http://y", "b", model_before="a", model_after="a")
    fine.outcome = swap.outcome(fine)
    text = swap.report_text([lost, fine], 1, 12.0)
    assert "swap STOPPED in 12 s" in text
    assert "lost (unreachable) during its swap" in text and "left drained" in text
    assert "why node1: unreachable: Failed to connect to the host via ssh" in text
    assert "why node2" not in text and "not touched" in text


def test_the_balancers_report_row_has_no_gate_verdict_and_is_not_a_host_name(
    tmp_path: Path,
) -> None:
    """The report's "(balancer)" row is not an inventory host: reading the gate's verdicts
    must skip it (a host-name check on it ended every swap behind a balancer with exit 2, seen
    in a fresh-clone run: the fleet swap, the broken canary, the gate, tune and the lost host),
    while a host name that is a path is still refused."""
    (tmp_path / "node1.json").write_text(
        json.dumps({"verdict": {"state": "pass", "reference": "release r1", "checks": []}})
    )
    assert swap._perf_verdict(tmp_path, swap.BALANCER) is None
    verdict = swap._perf_verdict(tmp_path, "node1")
    assert verdict is not None and (verdict.state, verdict.reference) == ("pass", "release r1")
    assert swap._perf_verdict(None, "node1") is None
    with pytest.raises(swap.VfleetError, match="not a plain inventory host name"):
        swap._perf_verdict(tmp_path, "../node1")


def _task_named(tasks: list[dict[str, object]], name: str) -> dict[str, object]:
    for t in tasks:
        if t.get("name") == name:
            return t
        inner = t.get("block")
        if isinstance(inner, list):
            try:
                return _task_named(inner, name)
            except LookupError:
                pass
    raise LookupError(name)


def test_the_report_says_which_host_needed_a_restart_systemd_made(tmp_path: Path) -> None:
    """wait_unit.yml's own "Say that systemd restarted vLLM by itself" task (a deploy's, a swap's
    and a rollback's start), with the one that reads why, run by the real
    ansible-playbook with the project's ansible.cfg (result_format yaml wraps the message) for
    two hosts, one restarted once, one not: the swap reads it per host into its report."""
    import sys

    import yaml

    wait = yaml.safe_load((REPO / "ansible/roles/vfleet/tasks/wait_unit.yml").read_text())
    read = _task_named(wait, "Read why the start systemd restarted ended")
    task = _task_named(wait, "Say that systemd restarted vLLM by itself")
    # The role's logwhy.py where the lookup finds it beside a playbook, and a log whose start
    # before the last ended with a worker killed by SIGILL (the lines the fleet tests saw).
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "logwhy.py").symlink_to(REPO / "src/vfleet/hostside/logwhy.py")
    log = tmp_path / "vllm-main.log"
    log.write_text(
        "vfleet launch: instance main, tiny-dense on vLLM 0.32.0 at 2026-12-07T15:10:00Z\n"
        "Fatal Python error: Illegal instruction\n\n"
        "Current thread 0x00007f (most recent call first):\n"
        '  File "/v/torch/_ops.py", line 1279 in __call__\n'
        "(EngineCore pid=2872) ERROR 12-07 15:11:44 [multiproc_executor.py:315] Worker proc "
        "VllmWorker-0 died unexpectedly (exit code: -4), shutting down executor.\n"
        "vfleet launch: instance main, tiny-dense on vLLM 0.32.0 at 2026-12-07T15:12:00Z\n"
        "(APIServer pid=9) INFO 12-07 15:12:09 [api_server.py:1] Starting vLLM server\n"
    )
    book = tmp_path / "play.yml"
    book.write_text(
        yaml.safe_dump(
            [
                {
                    "hosts": "all",
                    "gather_facts": False,
                    "vars": {
                        "vfleet_start_retries": 1,
                        "vfleet_python": sys.executable,
                        "_vfleet_wait_unit": "vfleet-vllm@main.service",
                        "_vfleet_wait_log": str(log),
                    },
                    "tasks": [
                        {
                            "name": "Show the unit",
                            "ansible.builtin.set_fact": {
                                "__vfleet_unit_show": {
                                    "stdout_lines": ["NRestarts={{ restarts }}", "MainPID=1"]
                                }
                            },
                        },
                        read,
                        task,
                    ],
                }
            ]
        )
    )
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("ansible-playbook")), "-i", "node1,node2,",
         "-c", "local", "-e", f"ansible_python_interpreter={sys.executable}",
         "-e", '{"restarts": "{{ 1 if inventory_hostname == \'node1\' else 0 }}"}', str(book)],
        cwd=REPO, env=dict(os.environ, ANSIBLE_CONFIG=str(swap.ANSIBLE_CFG), ANSIBLE_NOCOLOR="1"),
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = " ".join(proc.stdout.split())
    assert "restarted it 1 time(s)" in said, proc.stdout
    assert "died unexpectedly (exit code: -4)" in said, said
    assert "Fatal Python error: Illegal instruction in __call__ (/v/torch/_ops.py:1279)" in said
    assert swap.self_restarts(proc.stdout) == {"node1": 1}

    r = HostReport("node1", "http://x", "b", model_before="a", model_after="b", recap={})
    r.self_restarts = swap.self_restarts(proc.stdout)["node1"]
    r.outcome = swap.outcome(r)
    assert r.outcome == "swapped to b (after 1 restart(s) systemd made by itself: see why)"
    text = swap.report_text([r], 0, 30.0)
    assert "why node1 restarted: its vLLM ended after the new start served" in text
    assert "vfleet doctor node1" in text
