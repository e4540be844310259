"""The assertion message of a failed playbook run names the host that failed, even early."""

from __future__ import annotations

from .conftest import playbook_failure

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
