"""A private Docker engine for the container tests, and a Debian base image without a registry.

Debian's dockerd runs with its own socket, data root and exec root (so it never meets another
engine on the machine), without a bridge or iptables rules: containers use host networking and
all test traffic stays on loopback. No registry can be reached, so the base image is imported
from a debootstrap root (docs/SOURCES.md, "Observed on vfleet's machines"). See docs/IMAGES.md.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from vfleet.paths import tools_dir

from .nspawn import CHROOT, ROOT_PATH, SBIN_PATH, SUITE, copy_root, minbase, which

REPO = Path(__file__).resolve().parents[2]
# Resolved: dockerd refuses a data root whose path goes through a symlink (a worktree's .cache
# links to the main checkout's: "invalid rootfs: not an absolute path, or a symlink").
CACHE = tools_dir().resolve() / "docker"
# The exec root holds sockets whose paths must stay under 108 bytes: keep it short.
EXEC_ROOT = Path("/run/vfleet-test-docker")


@dataclass
class Engine:
    socket: Path
    proc: subprocess.Popen[bytes] | None

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, DOCKER_HOST=f"unix://{self.socket}", DOCKER_BUILDKIT="0")

    def docker(
        self, *args: str, check: bool = True, timeout: float = 600
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["docker", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)}: exit {proc.returncode}\n{proc.stderr}")
        return proc

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def start(log: Path, timeout: float = 120) -> Engine:
    dockerd = which("dockerd")
    if dockerd is None:
        raise RuntimeError("dockerd not found: make deps installs Debian's docker.io")
    CACHE.mkdir(parents=True, exist_ok=True)
    sock = CACHE / "docker.sock"
    pidfile = CACHE / "dockerd.pid"
    if pidfile.exists():  # an engine left behind by an interrupted run: stop it
        try:
            pid = int(pidfile.read_text().strip())
            # Only if that number is still our dockerd: pids are handed out again (pid_max
            # 32768 here), and a stale file must not stop whatever holds the number now.
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if argv0[0].endswith(b"dockerd") and f"--pidfile={pidfile}".encode() in argv0:
                os.kill(pid, signal.SIGTERM)
                time.sleep(3)
        except (ValueError, OSError):
            pass
    argv = [
        dockerd,
        f"--data-root={CACHE / 'root'}",
        f"--exec-root={EXEC_ROOT}",
        f"--pidfile={pidfile}",
        f"--host=unix://{sock}",
        "--bridge=none",
        "--iptables=false",
        "--ip6tables=false",
        "--storage-driver=overlay2",
    ]
    proc = subprocess.Popen(
        argv,
        stdout=log.open("ab"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env=dict(os.environ, PATH=SBIN_PATH),
    )
    engine = Engine(sock, proc)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"dockerd exited {proc.returncode}: see {log}")
        if engine.docker("info", check=False, timeout=30).returncode == 0:
            return engine
        time.sleep(1)
    engine.stop()
    raise RuntimeError(f"dockerd not ready in {timeout} s: see {log}")


def debian_base(engine: Engine, log: Path) -> str:
    """A Debian bookworm minbase image (what debian:bookworm-slim is), imported from a root.

    Like Debian's official image it carries a policy-rc.d that stops package scripts from
    starting services during a build, and no apt lists.
    """
    key = hashlib.sha256(f"{SUITE} minbase policy-rc.d".encode()).hexdigest()[:10]
    tag = f"vfleet-base:{SUITE}-{key}"
    if engine.docker("image", "inspect", tag, check=False).returncode == 0:
        return tag
    root = CACHE / f"base-{SUITE}-{key}"
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    copy_root(minbase(log), root)
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\n# no service starts inside an image build\nexit 101\n")
    policy.chmod(0o755)
    subprocess.run([CHROOT, str(root), "apt-get", "clean"], env={"PATH": ROOT_PATH}, check=True)
    shutil.rmtree(root / "var/lib/apt/lists", ignore_errors=True)
    (root / "var/lib/apt/lists/partial").mkdir(parents=True)
    tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
    imp = subprocess.run(
        ["docker", "import", "-", tag],
        stdin=tar.stdout,
        env=engine.env,
        capture_output=True,
        text=True,
        check=False,
    )
    tar.wait()
    if imp.returncode != 0 or tar.returncode != 0:
        raise RuntimeError(f"docker import failed: {imp.stderr}")
    shutil.rmtree(root, ignore_errors=True)
    return tag
