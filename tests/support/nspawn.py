"""Real systemd test hosts: a debootstrap root booted with systemd-nspawn, reached over SSH.

The root is built once and cached (`.cache/nspawn/`); each host is a copy with its own sshd
port on 127.0.0.1 (the hosts share this machine's network, so every port a test uses is
distinct) and its own host keys. The Debian mirror is read from this machine's apt sources,
never written into the project. See docs/SOURCES.md ("Hosts and process managers").
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from vfleet.paths import tools_dir

REPO = Path(__file__).resolve().parents[2]
CACHE = tools_dir() / "nspawn"
SUITE = "bookworm"
# What the CPU profile needs on a host (profiles/hardware/cpu.yaml os_packages), plus sshd,
# systemd and Python for Ansible, installed with apt inside a copy of the shared minbase root.
PACKAGES = [
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "python3-venv",
    "python3-dev",
    "libnuma1",
    "g++",
    "procps",
    "iproute2",
]
APT_PACKAGES = ["nodejs", "npm"]
# PATH inside the root. Ours may lack the sbin folders (a non-login root shell), where
# debootstrap and chroot live.
ROOT_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
SBIN_PATH = f"/usr/local/sbin:/usr/sbin:/sbin:{os.environ.get('PATH', '')}"
CHROOT = shutil.which("chroot", path=SBIN_PATH) or "/usr/sbin/chroot"


def which(tool: str) -> str | None:
    return shutil.which(tool, path=SBIN_PATH)


def debian_mirror() -> str:
    """The first Debian mirror this machine's apt uses (deb822 or one-line format)."""
    sources = sorted(Path("/etc/apt").glob("sources.list.d/*.sources"))
    for path in sources:
        m = re.search(r"^URIs:\s*(\S+/debian)/?\s*$", path.read_text(), re.M)
        if m:
            return m.group(1)
    for path in [Path("/etc/apt/sources.list"), *Path("/etc/apt").glob("sources.list.d/*.list")]:
        if path.exists():
            m = re.search(r"^deb\s+(?:\[[^]]*\]\s+)?(\S+/debian)/?\s+\S+", path.read_text(), re.M)
            if m:
                return m.group(1)
    raise RuntimeError("no Debian mirror found in /etc/apt sources")


def debootstrap(root: Path, packages: list[str], log: Path) -> None:
    """A Debian minbase root of SUITE (plus packages) from this machine's mirror."""
    include = [f"--include={','.join(packages)}"] if packages else []
    with log.open("a") as out:
        subprocess.run(
            [
                which("debootstrap") or "debootstrap",
                "--variant=minbase",
                *include,
                SUITE,
                str(root),
                debian_mirror(),
            ],
            env=dict(os.environ, PATH=SBIN_PATH),
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
        )


def minbase(log: Path) -> Path:
    """A plain Debian minbase root of SUITE, debootstrapped once (~100 s) and shared: the test
    hosts' root and the compose test's base image both start from a copy of it."""
    root = CACHE / f"{SUITE}-minbase"
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".minbase.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # both pytest workers may want it at once
        if not (root / ".done").exists():
            shutil.rmtree(root, ignore_errors=True)
            debootstrap(root, [], log)
            (root / ".done").touch()
    return root


def copy_root(src: Path, dest: Path) -> None:
    """A copy of a cached root to build on (reflinked where the filesystem can)."""
    subprocess.run(["cp", "-a", "--reflink=auto", str(src), str(dest)], check=True)
    (dest / ".done").unlink(missing_ok=True)


def base_root(log: Path, npm_seed: list[str]) -> Path:
    """The cached root (built on first use from the shared minbase: apt ~60 s, npm ~25 s).

    `npm_seed` packages are installed once with the root's own npm (through this machine's
    network and CA bundle, which is not kept), which leaves them in root's npm cache: hosts
    then install them with `npm install --offline`, needing no network or CA inside.
    """
    parts = [SUITE, *PACKAGES, *APT_PACKAGES, *npm_seed]
    key = hashlib.sha256(" ".join(parts).encode()).hexdigest()[:10]
    root = CACHE / f"{SUITE}-{key}"
    if (root / ".done").exists():
        return root
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    copy_root(minbase(log), root)
    with log.open("a") as out:
        # The shared minbase may be older than the mirror's current lists.
        subprocess.run(
            [CHROOT, str(root), "apt-get", "update", "-qq"],
            env={"PATH": ROOT_PATH, "DEBIAN_FRONTEND": "noninteractive"},
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
        )
        subprocess.run(
            [
                CHROOT,
                str(root),
                "apt-get",
                "install",
                "-y",
                "-qq",
                "--no-install-recommends",
                *PACKAGES,
                *APT_PACKAGES,
            ],
            env={"PATH": ROOT_PATH, "DEBIAN_FRONTEND": "noninteractive"},
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
        )
        subprocess.run([CHROOT, str(root), "apt-get", "clean"], check=True)
        ca = Path(os.environ.get("SSL_CERT_FILE", "/etc/ssl/certs/ca-certificates.crt"))
        shutil.copy(ca, root / "tmp/ca.crt")
        for spec in npm_seed:
            subprocess.run(
                [
                    CHROOT,
                    str(root),
                    "npm",
                    "install",
                    "--no-audit",
                    "--no-fund",
                    "--prefix",
                    "/tmp/npm-seed",
                    spec,
                ],
                env={
                    "PATH": ROOT_PATH,
                    "HOME": "/root",
                    "NODE_EXTRA_CA_CERTS": "/tmp/ca.crt",
                },
                stdout=out,
                stderr=subprocess.STDOUT,
                check=True,
            )
        shutil.rmtree(root / "tmp/npm-seed", ignore_errors=True)
        (root / "tmp/ca.crt").unlink()
    (root / ".done").touch()
    return root


@dataclass
class Host:
    """One booted test host. Everything inside runs as root, as on a fresh server."""

    name: str
    root: Path
    ssh_port: int
    key: Path
    binds: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None

    def ssh_argv(self, *cmd: str) -> list[str]:
        return [
            "ssh",
            "-p",
            str(self.ssh_port),
            "-i",
            str(self.key),
            *SSH_OPTIONS,
            "root@127.0.0.1",
            *cmd,
        ]

    def run(
        self, cmd: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run a shell command inside the host over SSH."""
        proc = subprocess.run(
            self.ssh_argv(cmd), capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{self.name}: `{cmd}` exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
            )
        return proc

    def boot(self, log: Path, timeout: float = 90) -> None:
        argv = [
            "systemd-nspawn",
            "-D",
            str(self.root),
            "-b",
            "--register=no",
            "--keep-unit",
            "--console=passive",
            "-M",
            self.name,
            *[f"--bind-ro={b}" for b in self.binds],
        ]
        self.proc = subprocess.Popen(
            argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: systemd-nspawn exited {self.proc.returncode}")
            with socket.socket() as s:
                s.settimeout(1)
                listening = s.connect_ex(("127.0.0.1", self.ssh_port)) == 0
            if listening and self.run("true", check=False, timeout=10).returncode == 0:
                return
            time.sleep(1)
        raise RuntimeError(f"{self.name}: no SSH on port {self.ssh_port} after {timeout} s")

    def kill(self) -> None:
        """A power cut: SIGKILL to the container's init and to systemd-nspawn, no shutdown."""
        self.shutdown(timeout=0, signum=signal.SIGKILL)

    def shutdown(self, timeout: float = 5, signum: int = signal.SIGTERM) -> None:
        """Power off; a test host need not drain its vLLM, so SIGKILL follows soon."""
        if self.proc is None or self.proc.poll() is not None:
            return
        # The container's init, in the host's PID numbering: SIGKILL to it ends the container's
        # PID namespace and every process in it. Killing systemd-nspawn alone does not (seen:
        # an interrupted run left a container's systemd and vLLM running under PID 1).
        try:
            init = [
                (int(p), _start_time(int(p)))
                for p in Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
                .read_text()
                .split()
            ]
        except (OSError, ValueError):
            init = []
        if signum == signal.SIGKILL:  # no poweroff: the container's processes die first
            _kill_same(init)
        # systemd-nspawn turns SIGTERM into an orderly poweroff of the container.
        os.killpg(self.proc.pid, signum)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        finally:
            _kill_same(init)


def _start_time(pid: int) -> str | None:
    """A process's start time (field 22 of /proc/PID/stat): with its pid, who it is."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _kill_same(procs: list[tuple[int, str | None]]) -> None:
    """SIGKILL to each process that is still the one seen before. Once the container is gone
    its init's pid is handed out again (pid_max 32768 here): the number alone may name
    another test's server."""
    for pid, started in procs:
        if started is not None and _start_time(pid) == started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


SSH_OPTIONS = [
    "-o",
    "BatchMode=yes",
    "-o",
    "StrictHostKeyChecking=no",
    "-o",
    "UserKnownHostsFile=/dev/null",
    "-o",
    "LogLevel=ERROR",
    "-o",
    # The hosts share two cores with spinning vLLM workers: sshd can take seconds to answer.
    "ConnectTimeout=20",
]


def make_host(
    base: Path, where: Path, name: str, ssh_port: int, key: Path, binds: list[str]
) -> Host:
    """Copy the cached root, give it a name, an sshd port, our key and fresh host keys."""
    root = where / name
    subprocess.run(["cp", "-a", "--reflink=auto", str(base), str(root)], check=True)
    (root / "etc/hostname").write_text(name + "\n")
    conf = root / "etc/ssh/sshd_config.d/vfleet-test.conf"
    conf.write_text(
        f"Port {ssh_port}\nListenAddress 127.0.0.1\nPermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
    )
    ssh_dir = root / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    auth = ssh_dir / "authorized_keys"
    auth.write_text(Path(str(key) + ".pub").read_text())
    auth.chmod(0o600)
    for old in (root / "etc/ssh").glob("ssh_host_*"):
        old.unlink()
    subprocess.run(["ssh-keygen", "-A", "-f", str(root)], check=True, capture_output=True)
    return Host(name, root, ssh_port, key, binds)


def make_key(where: Path) -> Path:
    key = where / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    return key
