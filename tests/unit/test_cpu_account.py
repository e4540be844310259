"""tests/support/cpu_account.py: acct(5) v3 records read back, and CPU put in kinds by name or
by the nearest named ancestor (how docs/BENCHMARKS.md's "Where the CPU goes" was made)."""

from __future__ import annotations

from pathlib import Path

from tests.support import cpu_account as ca


def _record(pid: int, ppid: int, comm: str, ticks: int) -> bytes:
    # flag, version 3, tty, exitcode, uid, gid, pid, ppid, btime, etime, utime, stime, mem, io,
    # rw, minflt, majflt, swaps, comm
    return ca.RECORD.pack(0, 3, 0, 0, 0, 0, pid, ppid, 1000 + pid, 0.0, ticks, 0, 0, 0, 0, 0, 0,
                          0, comm.encode())  # fmt: skip


def test_comp_t_decodes_the_kernels_16_bit_float() -> None:
    assert ca.comp_t(5) == 5
    assert ca.comp_t((1 << 13) | 3) == 3 << 3  # exponent 1: base 8


def test_records_are_read_and_put_in_kinds(tmp_path: Path) -> None:
    f = tmp_path / "pacct"
    f.write_bytes(
        _record(10, 1, "sshd", 10)
        + _record(11, 10, "python3", 300)  # an Ansible module on a test host
        + _record(20, 1, "systemd", 5)
        + _record(21, 20, "python3", 200)  # a service under a host's systemd
        + _record(22, 21, "VLLM::Worker", 900)
        + _record(30, 1, "ansible-playboo", 100)
        + b"\0" * 7  # a short tail is ignored
    )
    procs = ca.read(f)
    assert [p.comm for p in procs][:2] == ["sshd", "python3"] and procs[1].cpu_s == 3.0
    kinds = ca.kinds(procs)
    assert kinds["ansible modules on hosts"] == 3.0
    assert kinds[ca.SERVICES] == 2.0
    assert kinds["vllm engine and workers"] == 9.0
    assert kinds["ansible controller"] == 1.0
    assert ca.main([str(f)]) == 0
    empty = tmp_path / "empty"
    empty.touch()
    assert ca.main([str(empty)]) == 2  # no records: said, not a table of nothing
