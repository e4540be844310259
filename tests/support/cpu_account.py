"""Where a test run's CPU went, by kind of process, from the kernel's process accounting.

    touch /var/tmp/ci.pacct && accton /var/tmp/ci.pacct   # as root, before the run
    make test; accton off
    .venv/bin/python -m tests.support.cpu_account /var/tmp/ci.pacct [--by comm]

The kernel writes one record (acct(5), version 3) for every process when it exits, with its
user and system CPU time, its command name and its parent: the test hosts' processes too
(systemd-nspawn shares the kernel, and the records of a child pid namespace also reach the
file of its parent's). A run's processes have all exited when it ends, so the records add up
to the run's CPU. Each is put in a kind by its own command name or, for a plain interpreter
(python3, sh), by its nearest ancestor that names one: an Ansible module on a test host is a
python3 under sshd, a vLLM worker a process named VLLM::Worker... (docs/BENCHMARKS.md, "Where
the CPU goes").
"""

from __future__ import annotations

import struct
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime,
# etime (float), utime, stime, mem, io, rw, minflt, majflt, swaps (comp_t), comm[16].
RECORD = struct.Struct("<BBHIIIIIIf8H16s")
AHZ = 100  # comp_t ticks per second on Linux


def comp_t(v: int) -> int:
    """The kernel's 16-bit float: 13-bit mantissa, 3-bit base-8 exponent."""
    return (v & 0x1FFF) << (3 * (v >> 13))


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    comm: str
    cpu_s: float
    btime: int


def read(path: Path) -> list[Proc]:
    data = path.read_bytes()
    out = []
    for off in range(0, len(data) - RECORD.size + 1, RECORD.size):
        f = RECORD.unpack_from(data, off)
        if f[1] & 0x0F != 3:
            continue  # not a v3 record (the file was not written by this kernel's acct)
        utime, stime = comp_t(f[10]), comp_t(f[11])
        comm = f[18].split(b"\0", 1)[0].decode("utf-8", "replace")
        out.append(Proc(pid=f[6], ppid=f[7], comm=comm, cpu_s=(utime + stime) / AHZ, btime=f[8]))
    return out


# A command name -> its kind. Checked in order, by prefix. Names the kernel cut at 15 chars.
KINDS = (
    ("VLLM::", "vllm engine and workers"),
    ("vllm", "vllm api server"),
    ("ansible-playboo", "ansible controller"),
    ("ansible-", "ansible controller"),
    ("pip", "pip"),
    ("dockerd", "docker"),
    ("containerd", "docker"),
    ("docker", "docker"),
    ("buildkit", "docker"),
    ("runc", "docker"),
    ("debootstrap", "host roots"),
    ("dpkg", "host roots"),
    ("apt", "host roots"),
    ("npm", "pm2 and node"),
    ("node", "pm2 and node"),
    ("PM2", "pm2 and node"),
    ("pm2", "pm2 and node"),
    ("nginx", "nginx"),
    ("prometheus", "prometheus"),
    ("promtool", "lint"),
    ("mypy", "lint"),
    ("ruff", "lint"),
    ("yamllint", "lint"),
    ("hadolint", "lint"),
    ("systemd-analyze", "lint"),
    ("vfleet-exporter", "sidecar"),
    ("vfleet-probe", "probe"),
    ("vfleet", "vfleet cli"),
    ("sshd", "ssh"),
    ("ssh", "ssh"),
    ("systemd-nspawn", "host roots"),
    ("systemd", "hosts' systemd"),
    ("journal", "hosts' systemd"),
    ("pytest", "pytest"),
    ("gcc", "compilers"),
    ("cc1", "compilers"),
    ("g++", "compilers"),
    ("ld", "compilers"),
    ("as", "compilers"),
    ("ninja", "compilers"),
)
# Interpreters and shells: their kind is their nearest named ancestor's.
SERVICES = "python services on hosts (vLLM API server, sidecar)"
PLAIN = ("python", "python3", "python3.11", "python3.12", "sh", "bash", "env", "timeout", "sudo")


def own_kind(comm: str) -> str | None:
    if comm in PLAIN or comm.startswith("python"):
        return None
    for prefix, kind in KINDS:
        if comm.startswith(prefix):
            return kind
    return None


def kinds(procs: list[Proc]) -> dict[str, float]:
    """CPU seconds by kind. A process whose name says nothing (an interpreter, a shell) takes
    its nearest named ancestor's kind; under sshd it is an Ansible module on a test host, under
    a host's systemd or pm2 a Python service (vLLM's API server, the sidecar, the probe)."""
    by_pid = {p.pid: p for p in procs}  # a pid reused later: the later record, fine for a ranking
    through = {"ssh": "ansible modules on hosts", "hosts' systemd": SERVICES,
               "pm2 and node": SERVICES}  # fmt: skip

    def kind_of(p: Proc) -> str:
        own = own_kind(p.comm)
        if own is not None:
            return own
        anc, seen = by_pid.get(p.ppid), {p.pid}
        while anc is not None and anc.pid not in seen:
            named = own_kind(anc.comm)
            if named is not None:
                return through.get(named, named)
            seen.add(anc.pid)
            anc = by_pid.get(anc.ppid)
        return "python (pytest, tools)" if p.comm.startswith("python") else "other"

    out: dict[str, float] = defaultdict(float)
    for p in procs:
        out[kind_of(p)] += p.cpu_s
    return dict(out)


def main(argv: list[str]) -> int:
    by_comm = "--by" in argv and argv[argv.index("--by") + 1] == "comm"
    paths = [a for a in argv if not a.startswith("--") and a != "comm"]
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    procs = [p for path in paths for p in read(Path(path))]
    if not procs:
        print(f"{', '.join(paths)}: no process accounting records", file=sys.stderr)
        return 2
    if by_comm:
        table: dict[str, float] = defaultdict(float)
        for p in procs:
            table[p.comm] += p.cpu_s
    else:
        table = kinds(procs)
    total = sum(table.values())
    span = (max(p.btime for p in procs) - min(p.btime for p in procs)) / 60
    print(f"{len(procs)} processes, {total / 60:.1f} core-minutes ({span:.0f} min of starts)")
    for name, s in sorted(table.items(), key=lambda kv: -kv[1])[:40]:
        print(f"  {s / 60:7.2f} core-min  {100 * s / total:5.1f} %  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
