"""Fleet deploy over real SSH to two real systemd hosts (debootstrap + systemd-nspawn).

node1 runs the instance under systemd, node2 under pm2 (npm inside the host). Both are
deployed in one `make deploy HOST=cpu_fleet` with the inventory's variables. Then, on node1:
idempotence, `--check --diff`, the API key nowhere but the 0600 env file (every process's
command line and environment on the control machine during each make, and on both hosts after
the deploy; pm2's stored environment, logs, released files, metrics), drift, kill -9 of
the engine, a bad model path stopped in preflight, and a crash loop stopped by the start limit.
Then the rolling model swap (issue 7): behind nginx, a broken canary, a single box, a host lost
mid-rollout.

`make test` (CI) runs the tests marked ci: what the fleet-deploy issue, the swap issue and
issue 20 (the performance gate, `vfleet tune` and the sidecar's recommended depth) ask to prove
(CI's tune test measures two depths, about 3.5 minutes; its climb against the exhaustive table,
seven vLLM starts, is make test-fleet's); `make test-fleet` runs them all.
The crash loop, the rollback under systemd and the two-replica swap stay out of CI, which must
stay under 45 minutes.

The hosts share this machine's network: every port below is on 127.0.0.1 and distinct. The
vLLM wheels come from a wheelhouse bound read-only into the hosts (no index inside), pm2 from
the root's npm cache (seeded once, `--offline` inside). Timings go to build/fleet-timings.json
for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import http.client
import json
import math
import os
import re
import shlex
import shutil
import socket
import subprocess
import tarfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, ansible_task_times, playbook_failure, require_tools
from tests.support import loadgen, nspawn
from tests.support.cases import HOSTILE
from tests.support.tune_replay import replay_climb
from tests.support.vllm_server import vllm_python, vllm_venv
from vfleet.config.escape import systemd_command
from vfleet.engine.rules import CACHE_ENV
from vfleet.fleet.tune_measure import NO_DECODE, BenchPlan, measure, until_decoded
from vfleet.hostside.logwhy import LAUNCH_MARK, last_error
from vfleet.paths import tools_dir
from vfleet.render.cache_seed import read_manifest
from vfleet.render.plan import plan

pytestmark = pytest.mark.hosts

# A marker string: it must never show up in clear. Fresh per run: other checkouts' fleet runs on
# this machine (whose processes KeyWatch sees too) must not be taken for a leak of this one.
API_KEY = f"vfleet-test-key-{os.urandom(4).hex()}"
# How it could show up in a published hash: the key's own sha256.
API_KEY_SHA256 = hashlib.sha256(API_KEY.encode()).hexdigest()
MODEL = "tiny-hybrid-mtp"
TIMINGS = REPO / "build" / "fleet-timings.json"
VFLEET = str(REPO / ".venv" / "bin" / "vfleet")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    host: nspawn.Host
    port: int
    sets: list[str]


@dataclass
class Fleet:
    inventory: Path
    nodes: dict[str, Node]
    logs: Path
    twin: Node  # inventory host node2b: instance b on node2's box
    key_file: Path  # the API key (0600) on the control machine: vfleet_api_key_file


def _tools_ok() -> str | None:
    for tool in ("debootstrap", "systemd-nspawn", "ssh", "ssh-keygen", "npm"):
        if nspawn.which(tool) is None:
            return f"{tool} not installed (make deps installs it)"
    if os.geteuid() != 0:
        return "systemd-nspawn test hosts need root"
    return None


def wheelhouse(packages: list[str], log: Path) -> Path:
    """The pinned vLLM and its dependencies as wheels, downloaded once (cached)."""
    name = "-".join(p.replace("==", "-") for p in packages)
    where = tools_dir() / "wheelhouse" / name
    if (where / ".done").exists():
        return where
    pip = vllm_venv() / "bin" / "pip"
    with log.open("a") as out:
        subprocess.run(
            [str(pip if pip.exists() else "pip"), "download", "-q", "-d", str(where), *packages],
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
        )
    (where / ".done").touch()
    return where


def record(key: str, value: Any) -> None:
    TIMINGS.parent.mkdir(exist_ok=True)
    data = json.loads(TIMINGS.read_text()) if TIMINGS.exists() else {}
    data[key] = value
    TIMINGS.write_text(json.dumps(data, indent=2) + "\n")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    why = _tools_ok()
    if why:
        if require_tools():
            pytest.fail(why)
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("fleet")
    log = tmp / "setup.log"
    t0 = time.monotonic()
    defaults = yaml.safe_load((REPO / "ansible/roles/vfleet/defaults/main.yml").read_text())
    base = nspawn.base_root(log, npm_seed=[f"pm2@{defaults['vfleet_pm2_version']}"])
    packages = plan("cpu", MODEL).software.packages
    wheels = wheelhouse(packages, log)
    record("setup_root_and_wheels_s", round(time.monotonic() - t0, 1))
    key = nspawn.make_key(tmp)
    nodes: dict[str, Node] = {}
    for core, name in enumerate(("node1", "node2")):
        host = nspawn.make_host(base, tmp, name, free_port(), key, binds=[f"{wheels}:/wh"])
        port = free_port()
        # The API key comes from a file (vfleet_api_key_file below), never a setting: every
        # SET=... of the tests below is echoed by make and reaches ansible-playbook's argv.
        sets = [f"port={port}", f"sidecar_port={free_port()}"]
        # The two hosts share this machine's cores. vLLM's CPU worker binds core 0 by default
        # and spins while it serves: a second host's new server bound there too starved (seen:
        # a swap's engine made no progress for 300 s beside the other host under load). Two
        # instances on one real box need the same (rule devices).
        sets.append(f"cpu_cores={core}")
        # Eager: torch.compile and its cache are exercised by the local deploy
        # (test_e2e_deploy); here each cold start (the first deploy, every swap to another
        # model) would cost ~45 s more of compiling on the shared cores.
        sets.append("extra_args.enforce-eager=true")
        nodes[name] = Node(host, port, sets)
    # node2b: a second instance on node2's box (same address and port), for the two-replica
    # swap on one box; not in cpu_fleet, so deploys of the group never take both at once.
    node2 = nodes["node2"]
    twin_port = free_port()
    twin_sets = [
        f"port={twin_port}",
        f"sidecar_port={free_port()}",
        f"served_model_name={MODEL}",
        "cpu_cores=0",
        "extra_args.enforce-eager=true",
    ]
    twin = Node(node2.host, twin_port, twin_sets)
    key_file = tmp / "api.key"
    key_file.write_text(API_KEY + "\n")
    key_file.chmod(0o600)
    common = {
        "ansible_host": "127.0.0.1",
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(key),
        "ansible_ssh_common_args": " ".join(nspawn.SSH_OPTIONS),
        "ansible_python_interpreter": "/usr/bin/python3",
        "vfleet_profile": "cpu",
        "vfleet_model": MODEL,
        "vfleet_pip_extra_args": "--no-index --find-links /wh",
        "vfleet_npm_extra_args": ["--offline"],
        "vfleet_api_key_file": str(key_file),
    }
    hosts = {
        name: {
            "ansible_port": n.host.ssh_port,
            "vfleet_process_manager": manager,
            "vfleet_set": n.sets,
        }
        for (name, n), manager in zip(nodes.items(), ("systemd", "pm2"), strict=True)
    }
    node2b = {
        "ansible_port": node2.host.ssh_port,
        "vfleet_process_manager": "pm2",
        "vfleet_instance": "b",
        "vfleet_model": "tiny-dense",
        "vfleet_set": twin_sets,
    }
    inventory = tmp / "inventory.yml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "vars": common,
                    "children": {
                        "cpu_fleet": {"hosts": hosts},
                        "node2_replicas": {"hosts": {"node2": {}, "node2b": node2b}},
                    },
                }
            },
            sort_keys=False,
        )
    )
    try:
        for n in nodes.values():
            n.host.boot(tmp / f"{n.host.name}.console.log")
        yield Fleet(inventory, nodes, tmp, twin, key_file)
    finally:
        # Every host is stopped even when stopping one is interrupted.
        for n in nodes.values():
            try:
                n.host.shutdown()
            except BaseException:  # a ^C during one host's stop must not leave it up
                n.host.shutdown(timeout=1)
        # Each host's vLLM logs stay with the fleet's logs: a worker that died in a swap left its
        # Python stack only there (docs/ARCHITECTURE.md), and the roots go below.
        for n in nodes.values():
            for log in sorted((n.host.root / "opt/vfleet/logs").glob("*.log")):
                with contextlib.suppress(OSError):
                    shutil.copyfile(log, tmp / f"{n.host.name}-{log.name}")
        # The roots (a venv of ~4 GB each) go in the background: the worker's next test file
        # need not wait the half minute that takes.
        subprocess.Popen(
            ["rm", "-rf", *(str(n.host.root) for n in nodes.values())],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )


def make(
    fleet: Fleet, target: str, *make_vars: str, ansible_args: str = "", timeout: int = 900
) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", **ansible_task_times(fleet.logs)
    )
    with KeyWatch() as watch:
        proc = _make(fleet, target, make_vars, ansible_args, env, timeout)
    # While it ran: no process of this machine held the key in its command line or
    # environment (ansible-playbook's argv was readable by every local user, issue 22).
    assert not watch.seen, watch.seen
    with (fleet.logs / "make.log").open("a") as out:
        # All of it, make's echo of the command line included: it must hold no key either.
        out.write(f"\n$ make {target} ...\n{proc.stdout}{proc.stderr}\n")
    return proc


def make_argv(
    fleet: Fleet, target: str, make_vars: tuple[str, ...], ansible_args: str = ""
) -> list[str]:
    """make's argv for a target on this fleet. Run it with stdin=subprocess.DEVNULL: an
    inherited stdin is shared with every other child of this worker, and one of them (a Node.js
    pm2) may set it non-blocking, which ansible-playbook refuses ("Ansible requires blocking IO
    on stdin/stdout/stderr"): the project's CI met exactly that."""
    return [
        "make",
        "--no-print-directory",
        target,
        f"INVENTORY={fleet.inventory}",
        *make_vars,
        f"ANSIBLE_ARGS=-e vfleet_prometheus_enabled=false {ansible_args}",
    ]


def _make(
    fleet: Fleet,
    target: str,
    make_vars: tuple[str, ...],
    ansible_args: str,
    env: dict[str, str],
    timeout: int,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        make_argv(fleet, target, make_vars, ansible_args),
        cwd=REPO,
        stdin=subprocess.DEVNULL,  # ansible-playbook refuses a non-blocking one (see make_argv)
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


class KeyWatch:
    """Reads /proc/*/cmdline and /proc/*/environ of this machine's processes (this PID
    namespace: the hosts' own processes are scanned inside them) every 0.2 s while a make
    runs, and keeps each process that held API_KEY: what any local user could read there."""

    def __init__(self) -> None:
        self.seen: list[str] = []
        self._stop = threading.Event()
        self._ns = os.readlink("/proc/self/ns/pid")
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> KeyWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        key = API_KEY.encode()
        while not self._stop.wait(0.2):
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    if os.readlink(f"/proc/{pid}/ns/pid") != self._ns:
                        continue
                    for what in ("cmdline", "environ"):
                        with open(f"/proc/{pid}/{what}", "rb") as fh:
                            data = fh.read()
                        if key in data:
                            cmd = data if what == "cmdline" else b""
                            head = cmd.replace(b"\0", b" ")[:120].replace(key, b"<KEY>")
                            self.seen.append(f"pid {pid} {what}: {head.decode(errors='replace')}")
                except OSError:  # gone, or a kernel thread
                    continue


def recap(out: str, host: str) -> dict[str, int]:
    m = re.search(rf"^{host}\s+:\s+(.*)$", out.split("PLAY RECAP")[-1], re.M)
    assert m, out[-3000:]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}


def chat(port: int, key: str | None = API_KEY) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers=headers,
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), {}


def _health(port: int) -> int | None:
    """vLLM's /health status from here (the hosts' ports are this machine's), None if none."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, http.client.HTTPException):
        return None


def unit_show(node: Node, unit: str = "vfleet-vllm@main.service") -> dict[str, str]:
    out = node.host.run(
        f"systemctl show {unit} -p ActiveState -p SubState -p Result -p NRestarts -p MainPID"
    ).stdout
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


def assert_swapped(fleet: Fleet, host: dict[str, Any], want: str) -> None:
    """The swap report's outcome for one host: swapped to ``want``, or the same after restarts
    systemd made by itself (the role waits for one where vLLM's engine died after the new start
    served: the CI's worker death, docs/ARCHITECTURE.md). Then that host's vLLM log is kept in
    the fleet's logs: the dead start's Python stack is in it."""
    n = host.get("self_restarts", 0)
    said = f"swapped to {want}"
    if n:
        said += f" (after {n} restart(s) systemd made by itself: see why)"
        node = fleet.nodes.get(host["host"])
        log = node.host.root / "opt/vfleet/logs/vllm-main.log" if node else None
        if log is not None and log.is_file():
            shutil.copyfile(
                log, fleet.logs / f"{host['host']}-vllm-main-restarted-{time.time():.0f}.log"
            )
    assert host["outcome"] == said, host


def unit_journals(fleet: Fleet, lines: int = 25) -> str:
    """systemd's own account of each host's vLLM unit (how its main process ended, and who
    stopped or restarted it): for a failed swap's message, beside the role's report."""
    out = []
    for name, n in fleet.nodes.items():
        j = n.host.run(
            f"journalctl -u vfleet-vllm@main.service --no-pager -o short-precise -n {lines}",
            check=False,
        )
        out.append(f"--- {name}: journalctl -u vfleet-vllm@main.service\n{j.stdout}")
    return "\n".join(out)


# ------------------------------------------------------------------------------------ tests


@pytest.mark.ci
def test_fleet_deploy_serves_on_both_hosts(fleet: Fleet) -> None:
    t0 = time.monotonic()
    proc = make(fleet, "deploy", "HOST=cpu_fleet")
    record("fleet_deploy_first_s", round(time.monotonic() - t0, 1))
    assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
    node1, node2 = fleet.nodes["node1"], fleet.nodes["node2"]
    # node1: systemd; the installed unit verifies clean on the host itself.
    assert unit_show(node1)["ActiveState"] == "active"
    verify = node1.host.run(
        "SYSTEMD_LOG_LEVEL=notice systemd-analyze verify --man=no "
        "/etc/systemd/system/vfleet-vllm@main.service 2>&1",
        check=False,
    )
    assert verify.returncode == 0 and verify.stdout == "", verify.stdout
    # node2: pm2 from npm inside the host.
    jlist = (
        node2.host.run("PM2_HOME=/opt/vfleet/pm2/home /opt/vfleet/pm2/node_modules/.bin/pm2 jlist")
        .stdout.strip()
        .splitlines()[-1]
    )
    states = {p["name"]: p["pm2_env"]["status"] for p in json.loads(jlist)}
    assert states == {"vfleet-vllm-main": "online", "vfleet-sidecar-main": "online"}
    # pm2 hands its daemon's environment on: the env file's empty PYTHONDONTWRITEBYTECODE
    # reaches vLLM, so a daemon started where it is set still lets bytecode be written.
    pid = {p["name"]: p["pid"] for p in json.loads(jlist)}["vfleet-vllm-main"]
    environ = node2.host.run(f"tr '\\0' '\\n' < /proc/{pid}/environ").stdout.splitlines()
    assert "PYTHONDONTWRITEBYTECODE=" in environ, environ
    for node in (node1, node2):
        status, body = chat(node.port)
        # A real generation (random weights: the text may land in reasoning_content).
        assert status == 200 and body["usage"]["completion_tokens"] > 0, body
        assert chat(node.port, key=None)[0] == 401  # the API key is enforced
    # Bytecode (rule "caches"): vLLM's goes to the instance's cache, also under systemd's
    # ProtectSystem=strict, and the venv has none (the role installs with --no-compile). Without
    # it every start compiled torch and vLLM from source (docs/BENCHMARKS.md).
    dirs = plan("cpu", MODEL).dirs
    pycache = f"{dirs.cache}/{CACHE_ENV['PYTHONPYCACHEPREFIX']}"
    for node in (node1, node2):
        cached = node.host.run(f"find {pycache} -path '*/vllm/*.pyc' | head -n 1").stdout
        assert cached.strip(), f"{node.host.name}: no vLLM bytecode under {pycache}"
        in_venv = node.host.run(f"find {dirs.venv}/lib -path '*/vllm/*.pyc' | head -n 1")
        assert in_venv.stdout.strip() == "", in_venv.stdout


@pytest.mark.ci
def test_second_deploy_changes_nothing(fleet: Fleet) -> None:
    """Nothing changes, and nothing outside the service user's folders either (issue 29): before
    the deploy the service user plants links in each folder it owns (HOME, state, cache) to
    root's files and folders; a scan of the whole host's metadata (owner, group, mode, size,
    mtime, link target of every path but the volatile ones and vfleet's base folder, where
    the sentinels stand in) reads the same afterwards."""
    before = {}
    for name, n in fleet.nodes.items():
        plant_links(n)
        before[name] = host_scan(n)
    try:
        t0 = time.monotonic()
        proc = make(fleet, "deploy", "HOST=cpu_fleet")
        record("fleet_deploy_again_s", round(time.monotonic() - t0, 1))
        assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
        for name, n in fleet.nodes.items():
            r = recap(proc.stdout, name)
            assert r["changed"] == 0 and r["failed"] == 0, (name, r, changed_tasks(proc.stdout))
            after = host_scan(n)
            assert after == before[name], (name, sorted(set(after) ^ set(before[name]))[:20])
    finally:
        for n in fleet.nodes.values():
            remove_links(n)


# What a root step must never change (issue 29): root's 0600 file, root's 0700 folder with a file,
# and a file of the release (root's, in vfleet's base folder, which host_scan leaves out).
SENTINELS = ("/etc/vfleet-sentinel", "/etc/vfleet-sentinel.d", "/etc/vfleet-sentinel.d/key")
RELEASE_FILE = "/opt/vfleet/instances/main/current/vllm.yaml"
SERVICE_FOLDERS = ("/opt/vfleet/instances/main/home", "/opt/vfleet/instances/main/state",
                   "/opt/vfleet/cache/main")  # fmt: skip
# Left out of the host scan: what the kernel, systemd, sshd, Ansible's remote temp files and
# the deploys themselves write (vfleet's base folder holds releases, logs, venvs).
VOLATILE = ("/proc", "/sys", "/dev", "/run", "/tmp", "/var/tmp", "/var/log", "/var/cache",
            "/var/lib/systemd", "/root/.ansible", "/opt/vfleet")  # fmt: skip


def plant_links(n: Node, folders: tuple[str, ...] = SERVICE_FOLDERS) -> None:
    """As the service user, links in each of its folders to root's sentinels and to a release
    file: the red team's payload against a root step that follows links."""
    n.host.run(
        "set -e; umask 077; printf 'root-only\\n' > /etc/vfleet-sentinel; "
        "mkdir -p /etc/vfleet-sentinel.d; printf 'k\\n' > /etc/vfleet-sentinel.d/key; "
        "chmod 600 /etc/vfleet-sentinel; chmod 700 /etc/vfleet-sentinel.d"
    )
    for folder in folders:
        user = n.host.run(f"stat -c %U {folder}").stdout.strip()
        assert user not in ("", "root"), (folder, user)
        for link, target in (("x", SENTINELS[0]), ("d", SENTINELS[1]), ("r", RELEASE_FILE)):
            n.host.run(
                f"rm -f {folder}/{link} && setpriv --reuid={user} --regid={user} "
                f"--clear-groups ln -s {target} {folder}/{link}"
            )


def remove_links(n: Node) -> None:
    n.host.run(" ".join(["rm -f", *(f"{d}/{x}" for d in SERVICE_FOLDERS for x in "xdr")]))


def sentinels(n: Node) -> list[str]:
    """The sentinels' and the release file's owner, mode and content."""
    named = " ".join([*SENTINELS, RELEASE_FILE])
    return n.host.run(
        f"find {named} -maxdepth 0 -printf '%p %U %G %m %s\\n'; "
        f"sha256sum {SENTINELS[0]} {SENTINELS[2]}"
    ).stdout.splitlines()


# What a swap rewrites as root outside vfleet's folder, in root's own folders: the units (they
# name the release) and the release file the scan names. /etc/logrotate.d/vfleet is not one of
# them: it is the host's, the same for every model (its header named the model until 2026-12).
SWAP_WRITES = ("/etc/systemd/system", RELEASE_FILE)


def outside_swap_writes(scan: list[str]) -> list[str]:
    """A host scan without what a swap rewrites (SWAP_WRITES)."""
    return [x for x in scan if not any(x.startswith((w + " ", w + "/vfleet")) for w in SWAP_WRITES)]


def host_scan(n: Node) -> list[str]:
    """Owner, group, mode, size, mtime and link target of every path on the host but the
    volatile ones, plus the sentinels and the release file by name."""
    prune = " -o ".join(f"-path {p}" for p in VOLATILE)
    fmt = "'%p %U %G %m %s %T@ %l\\n'"
    named = " ".join([*SENTINELS, RELEASE_FILE])
    out = n.host.run(
        f"find / -xdev \\( {prune} \\) -prune -o -printf {fmt} | sort; "
        f"find {named} -maxdepth 0 -printf {fmt}; sha256sum {SENTINELS[0]} {SENTINELS[2]}",
        timeout=300,
    ).stdout
    return out.splitlines()


def changed_tasks(out: str) -> list[str]:
    """The TASK headers of the tasks that reported changed (for an idempotence failure)."""
    tasks, task = [], ""
    for line in out.splitlines():
        if line.startswith("TASK ["):
            task = line.split("]", 1)[0] + "]"
        elif line.startswith("changed:"):
            tasks.append(f"{task} {line[:120]}")
    return tasks


def _snapshot(node: Node) -> str:
    return node.host.run(
        "cd / && find /opt/vfleet/instances /etc/systemd/system -xdev \\( -type f -o -type l \\) "
        "-printf '%p %l %m\\n' | sort && sha256sum $(find /opt/vfleet/instances "
        "/etc/systemd/system -xdev -type f | sort)"
    ).stdout


@pytest.mark.ci
def test_check_diff_shows_exactly_the_change_and_changes_nothing(fleet: Fleet) -> None:
    node1 = fleet.nodes["node1"]
    before, pid = _snapshot(node1), unit_show(node1)["MainPID"]
    sets = " ".join([*node1.sets, "max_num_seqs=3", "restart_sec=5"])
    # The key file given to make too (as an operator would), in place of the inventory's.
    proc = make(
        fleet,
        "deploy",
        "HOST=node1",
        f"SET={sets}",
        f"API_KEY_FILE={fleet.key_file}",
        ansible_args="--check --diff",
    )
    assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
    out = proc.stdout
    changed = [line for line in out.splitlines() if re.match(r"^[+-](?![+-])", line)]
    # vllm.yaml: exactly the one setting; the unit: exactly RestartSec.
    assert "-max-num-seqs: 4" in changed and "+max-num-seqs: 3" in changed, out[-4000:]
    assert "-RestartSec=10" in changed and "+RestartSec=5" in changed, out[-4000:]
    yaml_lines = [c for c in changed if re.match(r"^[+-][a-z-]+: ", c)]
    assert sorted(yaml_lines) == ["+max-num-seqs: 3", "-max-num-seqs: 4"], yaml_lines
    # The unit twice: in the release, and where systemd reads it (/etc/systemd/system).
    unit_lines = [c for c in changed if re.match(r"^[+-][A-Z][A-Za-z]+=", c)]
    assert sorted(unit_lines) == sorted(["+RestartSec=5", "-RestartSec=10"] * 2), unit_lines
    assert API_KEY not in proc.stdout + proc.stderr
    assert _snapshot(node1) == before
    assert unit_show(node1)["MainPID"] == pid


# Every process of a host: pid -> (parent pid, command line, environment), read inside it by a
# script whose own command line holds no key; the search happens here.
PROC_DUMP = r"""
import json, os
out = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/cgroup") as f:
            cgroup = f.read()
    except OSError:
        continue
    out[pid] = [ppid, cmd.replace("\0", " "), env, cgroup]
print(json.dumps(out))
"""


@dataclass
class Proc:
    ppid: int
    cmdline: str
    environ: str
    cgroup: str


def processes(node: Node) -> dict[int, Proc]:
    dump = json.loads(node.host.run(f"python3 -c {shlex.quote(PROC_DUMP)}").stdout)
    return {int(pid): Proc(int(v[0]), str(v[1]), str(v[2]), str(v[3])) for pid, v in dump.items()}


def vllm_processes(procs: dict[int, Proc], main_pid: int, venv: str) -> set[int]:
    """vLLM's own processes: the main process and its descendants, and its multiprocessing
    helpers (resource tracker) that outlived their parent: under systemd every process of the
    unit's cgroup, under pm2 (no cgroup per app) the venv's Python running multiprocessing."""
    tree, grew = {main_pid}, True
    while grew:
        more = {pid for pid, p in procs.items() if p.ppid in tree} - tree
        tree |= more
        grew = bool(more)
    unit = "/vfleet-vllm@main.service"
    tree |= {pid for pid, p in procs.items() if unit in p.cgroup}
    helper = f"{venv}/bin/python -c from multiprocessing"
    return tree | {pid for pid, p in procs.items() if p.cmdline.startswith(helper)}


def pm2_apps(node: Node) -> dict[str, Any]:
    out = node.host.run(
        "PM2_HOME=/opt/vfleet/pm2/home /opt/vfleet/pm2/node_modules/.bin/pm2 jlist"
    ).stdout
    return {p["name"]: p for p in json.loads(out.strip().splitlines()[-1])}


def http_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return str(resp.read().decode())


@pytest.mark.ci
def test_api_key_is_nowhere_but_the_0600_env_file(fleet: Fleet) -> None:
    """Issue 22, findings 2 and 3, on both hosts after the deploys above (systemd on node1, pm2
    on node2); the control machine's processes were watched during each make (KeyWatch)."""
    assert API_KEY not in (fleet.logs / "make.log").read_text()  # make's echo included
    venv = plan("cpu", MODEL).dirs.venv
    problems: list[str] = []  # every host checked in full, then one report
    for name, node in fleet.nodes.items():
        procs = processes(node)
        if name == "node1":
            main_pid = int(unit_show(node)["MainPID"])
        else:
            apps = pm2_apps(node)
            main_pid = int(apps["vfleet-vllm-main"]["pid"])
            # pm2 stores each app's environment: the key, make's MAKEFLAGS and SET stay out.
            for app in ("vfleet-vllm-main", "vfleet-sidecar-main"):
                stored = apps[app]["pm2_env"]
                if API_KEY in json.dumps(stored):
                    problems.append(f"{name}: pm2 stored the key for {app}")
                for var in ("MAKEFLAGS", "SET", "VLLM_API_KEY"):
                    if var in stored or var in stored.get("env", {}):
                        problems.append(f"{name}: pm2 stored {var} for {app}")
        vllm = vllm_processes(procs, main_pid, venv)
        assert any("vllm" in procs[p].cmdline for p in vllm), procs[main_pid]
        # vLLM's processes hold the key in their environment, read from the env file; no other
        # process does, and no command line holds it.
        for pid, proc in procs.items():
            where = f"{name}: pid {pid} (parent {proc.ppid}) {proc.cmdline[:150]}"
            if API_KEY in proc.cmdline:
                problems.append(f"{where}: key in its command line")
            if pid not in vllm and API_KEY in proc.environ:
                problems.append(f"{where}: key in its environment")
        if not any(API_KEY in procs[p].environ for p in vllm):
            problems.append(f"{name}: vLLM runs without the key")
        # Files: on the host's disk only in the 0600 env files of the instance's releases; and
        # no published hash of it (release.json held the env file's sha256, the release id was
        # a hash over it).
        holders, env_hashes, texts = [], set(), []
        for top in ("opt/vfleet/instances", "opt/vfleet/logs", "opt/vfleet/pm2/home",
                    "etc/systemd/system", "var/log"):  # fmt: skip
            for path in (node.host.root / top).rglob("*"):
                if not path.is_file() or path.is_symlink() or path.stat().st_size > 64 << 20:
                    continue
                data = path.read_bytes()
                texts.append(data)
                if API_KEY.encode() in data:
                    holders.append(path)
                    env_hashes.add(hashlib.sha256(data).hexdigest())
        if not holders:
            problems.append(f"{name}: no env file holds the key")
        for path in holders:
            mode = path.stat().st_mode & 0o777
            if path.name != "vllm.env" or mode != 0o600 or "/releases/" not in str(path):
                problems.append(f"{name}: key in {path} (mode {mode:o})")
        sidecar_port = next(x.split("=")[1] for x in node.sets if x.startswith("sidecar_port="))
        published = [
            http_text(f"http://127.0.0.1:{node.port}/metrics"),
            http_text(f"http://127.0.0.1:{sidecar_port}/metrics"),
        ]
        if any(API_KEY in t for t in published):
            problems.append(f"{name}: key in a /metrics")
        for digest in {API_KEY_SHA256, *env_hashes}:
            if any(digest.encode() in t for t in texts) or any(digest in t for t in published):
                problems.append(f"{name}: a sha256 of the key or env file is published")
        # The journal (the other logs are files, read above).
        journal = node.host.run(
            "journalctl --no-pager -o cat > /tmp/journal.txt; cat /tmp/journal.txt", check=False
        ).stdout
        if API_KEY in journal:
            problems.append(f"{name}: key in the journal")
    assert not problems, "\n".join(problems)
    units = fleet.nodes["node1"].host.run("cat /etc/systemd/system/vfleet-*@main.service").stdout
    assert "EnvironmentFile=" in units
    node1 = fleet.nodes["node1"]
    mode = node1.host.run("stat -c '%a %U' /opt/vfleet/instances/main/current/vllm.env").stdout
    # Owned by the service user, which launch.sh runs as; readable by no one else.
    assert mode.split() == ["600", plan("cpu", MODEL).service.user]


def doctor(fleet: Fleet, host: str, *args: str) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        [
            str(REPO / ".venv/bin/vfleet"),
            "doctor",
            host,
            "-i",
            str(fleet.inventory),
            "--json",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.stdout.strip(), proc.stderr
    return proc.returncode, json.loads(proc.stdout)


@pytest.mark.ci
def test_doctor_over_ssh_sees_no_drift_then_names_a_pending_change(fleet: Fleet) -> None:
    node1 = fleet.nodes["node1"]
    rc, report = doctor(fleet, "node1")
    failed = [f for f in report["findings"] if f["status"] == "fail"]
    assert rc in (0, 1) and not failed, failed
    drift = [f for f in report["findings"] if f["check"].startswith("drift")]
    assert drift and all(f["status"] == "ok" for f in drift), drift
    service = [f for f in report["findings"] if f["check"] == "service"]
    assert service[0]["status"] == "ok" and "active" in service[0]["message"]
    assert API_KEY not in json.dumps(report)
    # The inventory now asks for max_num_seqs=3; the running server still has 4.
    sets = [a for s in [*node1.sets, "max_num_seqs=3"] for a in ("--set", s)]
    rc, report = doctor(fleet, "node1", *sets)
    drifted = [
        f for f in report["findings"] if f["check"].startswith("drift") and f["status"] != "ok"
    ]
    assert drifted and any("max-num-seqs" in f["message"] for f in drifted), drifted
    assert rc in (1, 2)
    # pm2 host: the same doctor, pm2's view of the service.
    rc, report = doctor(fleet, "node2")
    service = [f for f in report["findings"] if f["check"] == "service"]
    assert service and service[0]["status"] == "ok" and "pm2" in service[0]["message"], service


@pytest.mark.ci
def test_status_per_host_names_model_release_and_since_when(fleet: Fleet) -> None:
    """`vfleet status --hosts cpu_fleet`: each host's instance over ssh (vLLM through a tunnel)."""
    proc = subprocess.run(
        [VFLEET, "status", "--hosts", "cpu_fleet", "-i", str(fleet.inventory), "--json",
         "--interval", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = {o["target"]: o for o in json.loads(proc.stdout)}
    assert set(rows) == set(fleet.nodes)
    for name, node in fleet.nodes.items():
        o = rows[name]
        current = node.host.run("readlink /opt/vfleet/instances/main/current").stdout.strip()
        switched = int(node.host.run("stat -c %Y /opt/vfleet/instances/main/current").stdout)
        assert o["up"] and o["model_name"] == MODEL, o
        assert o["release"] == Path(current).name, (o, current)
        assert o["release_since"] == datetime.fromtimestamp(switched, UTC).isoformat(), o
        assert o["url"].startswith("http://127.0.0.1:") and o["vllm_version"] == "0.32.0", o


@pytest.mark.ci
def test_bench_by_host_goes_through_an_ssh_tunnel(fleet: Fleet, tmp_path: Path) -> None:
    """`vfleet bench run --host node1`: vLLM listens on the host's loopback, so the bench
    reaches it through an ssh tunnel with the inventory's user, port and key."""
    proc = subprocess.run(
        [
            str(REPO / ".venv/bin/vfleet"),
            "bench",
            "run",
            "--host",
            "node1",
            "-i",
            str(fleet.inventory),
            "--scenario",
            "decode",
            "--decode-tokens",
            "16",
            "--repeats",
            "1",
            "--no-plots",
            "--time-limit",
            "120",
            "--api-key-env",
            "VFLEET_TEST_API_KEY",
            "--out",
            str(tmp_path / "bench"),
        ],
        env=dict(os.environ, VFLEET_TEST_API_KEY=API_KEY),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
    assert "inventory host node1, instance main" in proc.stderr
    assert "through an ssh tunnel" in proc.stderr
    result = json.loads((tmp_path / "bench" / "result.json").read_text())
    assert result["deployment"]["release"]["instance"] == "main"
    assert result["runs"][0]["completion_tokens"] == 16


@pytest.mark.ci
def test_services_run_unprivileged_and_units_read_back_exactly(fleet: Fleet) -> None:
    """Issue 22: the units' hardening on a real systemd, and systemd's own reading of values."""
    node1, node2 = fleet.nodes["node1"], fleet.nodes["node2"]
    user = plan("cpu", MODEL).service.user
    limits = {"vfleet-vllm@main.service": 3.5, "vfleet-sidecar@main.service": 2.0}
    for unit, limit in limits.items():
        pid = unit_show(node1, unit)["MainPID"]
        # The main process and its children (vLLM's engine core) run as the service user.
        users = node1.host.run(f"ps -o user= -p {pid} --ppid {pid}").stdout.split()
        assert users and set(users) == {user}, (unit, users)
        # The loaded unit as the running manager scores it (not the file: what systemd parsed).
        out = node1.host.run(f"systemd-analyze security --no-pager {unit} 2>&1").stdout
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d+)", out)
        assert found and float(found.group(1)) <= limit, out
    # pm2 runs as root on node2 and starts both apps as the service user.
    pm2 = "PM2_HOME=/opt/vfleet/pm2/home /opt/vfleet/pm2/node_modules/.bin/pm2"
    apps = json.loads(node2.host.run(f"{pm2} jlist").stdout.strip().splitlines()[-1])
    for app in apps:
        who = node2.host.run(f"ps -o user= -p {app['pid']}").stdout.strip()
        assert who == user, (app["name"], who)
    # torch.compile (inductor: C++ generated, compiled by g++, loaded) under the vLLM unit's own
    # user, environment and sandbox: the fleet serves eager, the filter must still allow JIT.
    installed = node1.host.run("cat /etc/systemd/system/vfleet-vllm@main.service").stdout
    service = installed.split("[Service]\n", 1)[1].split("\n[", 1)[0].split("\n")
    how_it_starts = ("Type", "Exec", "Restart", "Timeout", "Kill", "SendSIGKILL", "Standard")
    props = [p for p in service if re.match(r"[A-Z]\w+=", p) and not p.startswith(how_it_starts)]
    jit = (
        "import torch; f = torch.compile(lambda x: (x * 2).sin().sum()); "
        "print(float(f(torch.ones(8))))"
    )
    run = node1.host.run(
        "systemd-run --wait --pipe --quiet "
        + " ".join(shlex.quote(f"--property={p}") for p in props)
        + f" -- {plan('cpu', MODEL).dirs.venv}/bin/python -c {shlex.quote(jit)}",
        timeout=600,
    )
    assert abs(float(run.stdout.strip().splitlines()[-1]) - 8 * math.sin(2)) < 1e-4, run.stdout
    # Every hostile word comes back from systemd as one argument, unchanged (escape.py).
    script = "import json, sys; open('/run/vfleet-rt.json', 'w').write(json.dumps(sys.argv[1:]))"
    unit = (
        "[Service]\nType=oneshot\n"
        f"ExecStart={systemd_command(['/usr/bin/python3', '-c', script, *HOSTILE])}\n"
    )
    encoded = base64.b64encode(unit.encode()).decode()
    node1.host.run(
        f"echo {encoded} | base64 -d > /run/systemd/system/vfleet-rt.service && "
        "systemctl daemon-reload && systemctl start vfleet-rt.service"
    )
    assert json.loads(node1.host.run("cat /run/vfleet-rt.json").stdout) == HOSTILE
    node1.host.run("rm /run/systemd/system/vfleet-rt.service && systemctl daemon-reload")


def _kill_the_worker_while_it_warms_up(
    fleet: Fleet, node: Node, target: str, make_vars: tuple[str, ...], log_name: str
) -> tuple[int, str]:
    """`make TARGET` on ``node``, and a real SIGILL to vLLM's worker once the new start serves
    while ExecStartPost's warmup runs (unit `start-post`, /health 200, one worker): make's exit
    status and output. Asserts that the kill happened."""
    before = unit_show(node)
    env = dict(
        os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", **ansible_task_times(fleet.logs)
    )
    killed = ""
    seen: list[str] = []  # what the loop saw: main pid, sub-state, /health, workers
    # Its output to a file: a pipe nobody reads while the loop below polls would fill and stall it.
    out_file = fleet.logs / log_name
    with KeyWatch() as watch, out_file.open("w") as sink:
        proc = subprocess.Popen(
            make_argv(fleet, target, make_vars),
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            deadline = time.monotonic() + 900  # bounded: the start comes within make's time
            while not killed and proc.poll() is None and time.monotonic() < deadline:
                # One ssh round: the unit's main pid and state, the worker's pid.
                state = node.host.run(
                    "systemctl show vfleet-vllm@main.service -p MainPID --value; "
                    "systemctl show vfleet-vllm@main.service -p SubState --value; "
                    "pgrep -x VLLM::Worker | xargs",
                    check=False,
                ).stdout.splitlines()
                main_pid, sub, workers = [*state, "", "", ""][:3]
                health = _health(node.port)
                seen.append(f"{main_pid} {sub} {health} [{workers}]")
                # The new start's main process serves while its warmup runs (start-post).
                new_start = main_pid not in ("0", before["MainPID"]) and sub == "start-post"
                if new_start and health == 200 and len(workers.split()) == 1:
                    node.host.run(f"kill -ILL {workers}")
                    killed = workers
                time.sleep(0.5)
            proc.wait(timeout=1500)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert not watch.seen, watch.seen
    out = out_file.read_text()
    assert killed, (
        "the new start never served with its one worker while it warmed up\n"
        + "\n".join(seen[-40:])
        + out[-1500:]
    )
    return proc.returncode, out


@pytest.mark.ci
def test_a_worker_killed_during_the_warmup_costs_a_restart_not_the_deploy(fleet: Fleet) -> None:
    """A real SIGILL to vLLM's worker once a deploy's new start serves, while ExecStartPost's
    warmup runs: what CI met by itself, at random, in runs of this file (a good release's
    worker "died unexpectedly (exit code: -4)", docs/ARCHITECTURE.md), made to happen. The API
    server exits 0, systemd restarts it, the role waits for that one restart (vfleet_start_retries)
    and the deploy succeeds, saying so and why; the log holds the worker's own Python stack
    (PYTHONFAULTHANDLER) and logwhy's reading of it names the signal. node1 is left on this
    release (max_num_seqs 2); the tests after it deploy their own."""
    node1 = fleet.nodes["node1"]
    sets = " ".join([*node1.sets, "max_num_seqs=2"])
    rc, out = _kill_the_worker_while_it_warms_up(
        fleet, node1, "deploy", ("HOST=node1", f"SET={sets}"), "deploy-worker-killed.log"
    )
    assert rc == 0, out[-5000:]
    said = " ".join(out.split())
    assert "systemd restarted it 1 time(s) by itself" in said, out[-3000:]
    assert "Fatal Python error: Illegal instruction in " in said, out[-3000:]  # logwhy --previous
    after = unit_show(node1)
    assert after["ActiveState"] == "active" and after["NRestarts"] == "1", after
    assert chat(node1.port)[0] == 200
    # The start that died: its lines end where launch.sh marks the next one.
    log = node1.host.run(f"cat {plan('cpu', MODEL).service.log_file}").stdout
    died = log.split(LAUNCH_MARK)[-2]
    assert "Fatal Python error: Illegal instruction" in died, died[-3000:]
    dead = re.search(r"Worker proc \S+ died unexpectedly \(exit code: (-4|None)\)", died)
    assert dead, died[-3000:]
    why = last_error((LAUNCH_MARK + died).splitlines())
    assert why is not None and "Fatal Python error: Illegal instruction in " in why, why
    record("worker_sigill_during_warmup", {"why": why})


# In make test-fleet (two vLLM starts CI's time does not hold, docs/BENCHMARKS.md): the deploy
# above runs the same wait (tasks/wait_unit.yml) in CI.
def test_a_worker_killed_during_a_rollbacks_start_costs_a_restart(fleet: Fleet) -> None:
    """The same death during a rollback's start: rollback.yml waits as a deploy does
    (wait_unit.yml), where a blocking restart once failed at that death and left the host
    rolled back to nothing. node1 first gets a release to roll back from (the deploy above's,
    or one made here when this test runs alone)."""
    node1 = fleet.nodes["node1"]
    inst = "/opt/vfleet/instances/main"
    proc = make(fleet, "deploy", "HOST=node1", f"SET={' '.join([*node1.sets, 'max_num_seqs=2'])}")
    assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
    previous = node1.host.run(f"readlink {inst}/previous").stdout.strip()
    assert previous, "node1 has no previous release to roll back to"
    rc, out = _kill_the_worker_while_it_warms_up(
        fleet, node1, "rollback", ("HOST=node1",), "rollback-worker-killed.log"
    )
    assert rc == 0, out[-5000:]
    said = " ".join(out.split())
    assert f"rolled back to release {Path(previous).name}" in said, out[-3000:]
    assert "systemd restarted it 1 time(s) by itself" in said, out[-3000:]
    assert "Fatal Python error: Illegal instruction in " in said, out[-3000:]
    assert node1.host.run(f"readlink {inst}/current").stdout.strip() == previous
    after = unit_show(node1)
    assert after["ActiveState"] == "active" and after["NRestarts"] == "1", after
    assert chat(node1.port)[0] == 200


# In make test-fleet: the death above covers systemd bringing a dead engine back in CI.
def test_kill9_of_the_engine_comes_back_ready(fleet: Fleet) -> None:
    node1 = fleet.nodes["node1"]
    before = unit_show(node1)
    engine = node1.host.run(f"pgrep -P {before['MainPID']} -f VLLM::EngineCore").stdout.split()
    assert len(engine) == 1, engine
    t0 = time.monotonic()
    node1.host.run(f"kill -9 {engine[0]}")
    # Bounded: the restart budget is RestartSec + the profile's start timeout.
    deadline = t0 + 10 + plan("cpu", MODEL).service.start_timeout_s
    seen_down = False
    while time.monotonic() < deadline:
        st = unit_show(node1)
        seen_down = seen_down or st["MainPID"] != before["MainPID"] or st["ActiveState"] != "active"
        if seen_down and st["ActiveState"] == "active" and chat(node1.port)[0] == 200:
            break
        time.sleep(1)
    ready_s = round(time.monotonic() - t0, 1)
    record("kill9_engine_to_ready_s", ready_s)
    after = unit_show(node1)
    assert after["ActiveState"] == "active", after
    assert int(after["NRestarts"]) == int(before["NRestarts"]) + 1
    assert after["MainPID"] != before["MainPID"]
    assert chat(node1.port)[0] == 200


@pytest.mark.ci
def test_bad_model_path_fails_in_preflight_and_keeps_serving(fleet: Fleet) -> None:
    node1 = fleet.nodes["node1"]
    before = _snapshot(node1), unit_show(node1)["MainPID"]
    sets = " ".join([*node1.sets, "model_dir=/srv/models/not-there"])
    proc = make(fleet, "deploy", "HOST=node1", f"SET={sets}")
    assert proc.returncode != 0
    assert "/srv/models/not-there has no config.json" in proc.stdout, proc.stdout[-3000:]
    failed_task = proc.stdout.split("fatal:")[0].rsplit("TASK [", 1)[-1].split("]")[0]
    assert failed_task == "vfleet : Require the model directory", failed_task
    assert (_snapshot(node1), unit_show(node1)["MainPID"]) == before
    assert chat(node1.port)[0] == 200


def test_rollback_on_systemd_restores_the_previous_release(fleet: Fleet) -> None:
    """A changed deploy, then `make rollback HOST=node1`: current and previous swap, the
    release's own unit is installed again, and the unit restarts ready and warm."""
    node1 = fleet.nodes["node1"]
    inst = "/opt/vfleet/instances/main"
    first = node1.host.run(f"readlink {inst}/current").stdout.strip()
    proc = make(fleet, "deploy", "HOST=node1", f"SET={' '.join([*node1.sets, 'max_num_seqs=3'])}")
    assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
    second = node1.host.run(f"readlink {inst}/current").stdout.strip()
    assert second != first
    t0 = time.monotonic()
    proc = make(fleet, "rollback", "HOST=node1")
    record("rollback_systemd_s", round(time.monotonic() - t0, 1))
    assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
    assert f"rolled back to release {Path(first).name}" in proc.stdout
    assert node1.host.run(f"readlink {inst}/current").stdout.strip() == first
    assert node1.host.run(f"readlink {inst}/previous").stdout.strip() == second
    same = node1.host.run(
        f"cmp {inst}/current/vfleet-vllm@main.service /etc/systemd/system/vfleet-vllm@main.service",
        check=False,
    )
    assert same.returncode == 0, same.stdout
    assert unit_show(node1)["ActiveState"] == "active"
    assert chat(node1.port)[0] == 200


def test_a_rollback_whose_release_fails_says_why(fleet: Fleet) -> None:
    """`make rollback` to a release that no longer starts (its weights were cut after it served):
    the rollback fails and says why from the log, as a failed deploy does, instead of only
    "the control process exited with error code". Then node1 is deployed back and serves."""
    node1 = fleet.nodes["node1"]
    models = "/opt/vfleet/models"
    copy = f"{models}/rollback-copy"
    node1.host.run(f"rm -rf {copy} && cp -a {models}/{MODEL} {copy}")
    proc = make(
        fleet, "deploy", "HOST=node1", f"SET={' '.join([*node1.sets, f'model_dir={copy}'])}"
    )
    assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
    proc = make(fleet, "deploy", "HOST=node1", f"SET={' '.join(node1.sets)}")
    assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
    # previous is now the copy's release: its weights are cut short.
    node1.host.run(f"for f in {copy}/*.safetensors; do truncate -s 4096 $f; done")
    try:
        proc = make(fleet, "rollback", "HOST=node1")
        assert proc.returncode != 0
        assert re.search(
            r"instance main rolled back to release \w+ did\s+not become ready", proc.stdout
        ), proc.stdout[-3000:]
        assert re.search(r"last error in the log: .*(safetensors|Error)", proc.stdout, re.I), (
            proc.stdout[-3000:]
        )
    finally:
        proc = make(fleet, "deploy", "HOST=node1", f"SET={' '.join(node1.sets)}")
        node1.host.run(f"rm -rf {copy}")
    assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
    assert chat(node1.port)[0] == 200


def test_crash_loop_stops_at_the_start_limit_and_doctor_says_why(fleet: Fleet) -> None:
    node1 = fleet.nodes["node1"]
    models = "/opt/vfleet/models"
    # A model that fails to load: the tiny model with its weights cut short.
    node1.host.run(
        f"rm -rf {models}/broken && cp -a {models}/{MODEL} {models}/broken && "
        f"for f in {models}/broken/*.safetensors; do truncate -s 4096 $f; done"
    )
    sets = [
        f"port={free_port()}",
        f"sidecar_port={free_port()}",
        f"model_dir={models}/broken",
        "restart_sec=1",
        "start_limit_burst=2",
    ]
    inst = ["INSTANCE=broken", f"SET={' '.join(sets)}"]
    proc = make(fleet, "deploy", "HOST=node1", *inst)
    assert proc.returncode != 0
    assert "instance broken did not become ready" in proc.stdout, proc.stdout[-3000:]
    assert re.search(r"its main process exited [1-9]", proc.stdout), proc.stdout[-3000:]
    assert re.search(r"last error in the log: .*(safetensors|Error)", proc.stdout, re.I)
    unit = "vfleet-vllm@broken.service"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        st = unit_show(node1, unit)
        if st["ActiveState"] == "failed":
            break
        time.sleep(3)
    # No more automatic restarts (systemd 252 keeps Result=exit-code; its journal names the
    # start limit, and so does the doctor below).
    assert st["ActiveState"] == "failed" and st["SubState"] == "failed", st
    journal = node1.host.run(f"journalctl -u {unit} --no-pager -o cat").stdout
    assert "Start request repeated too quickly" in journal
    rc, report = doctor(
        fleet, "node1", "--instance", "broken", *[a for s in sets for a in ("--set", s)]
    )
    assert rc == 2, report
    service = [f for f in report["findings"] if f["check"] == "service"]
    assert service and service[0]["status"] == "fail", report
    assert "start limit" in service[0]["message"], service
    assert "safetensors" in service[0]["message"].lower() or "Error" in service[0]["message"]
    stop = make(fleet, "stop", "HOST=node1", "INSTANCE=broken")
    assert stop.returncode == 0, playbook_failure(stop.stdout, stop.stderr)
    # The other instance on the host never noticed.
    assert unit_show(node1)["ActiveState"] == "active"
    assert chat(node1.port)[0] == 200


# The performance gate's bench runs 4 requests at a time (the cpu profile's max_num_seqs):
# every swap here stores figures at that shape, so a later swap of the same weights compares.
PERF_CONCURRENCY = "4"
# The gate's tolerances for these hosts: measured under a fleet run's load on the shared 2-core
# machine (tests/data/perfgate-noise-cpu.json "loaded_*", docs/BENCHMARKS.md), where an unchanged
# release's output tok/s fell by up to 78 % and its TTFT p95 rose by up to 1.31 s between benches.
# The defaults are for a box that only serves; here the timing figures cannot tell a slower
# release from the neighbours, and the decision rests on tokens per step (load-free).
PERF_TOLERANCES = [
    f"--perf-tolerance={k}={v}"
    for k, v in json.loads((REPO / "tests/data/perfgate-noise-cpu.json").read_text())[
        "fleet_load_tolerances"
    ].items()
]


def swap(
    fleet: Fleet, *args: str, timeout: int = 1200, inventory: Path | None = None
) -> tuple[int, dict[str, Any], str]:
    # The hosts share this machine's two cores: one load request and one watch generation per
    # host every two seconds leave room for the new server's start (its compile is CPU-bound).
    inv = str(inventory or fleet.inventory)
    argv = [VFLEET, "swap", *args, "-i", inv, "--json", "--interval", "2"]
    proc = subprocess.run(
        [*argv, "--perf-concurrency", PERF_CONCURRENCY, *PERF_TOLERANCES],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env=dict(os.environ, **ansible_task_times(fleet.logs)),
    )
    with (fleet.logs / "swap.log").open("a") as out:
        out.write(f"\n$ vfleet swap {' '.join(args)}\n{proc.stderr}\n{proc.stdout}\n")
    report = json.loads(proc.stdout) if proc.stdout.strip().startswith("{") else {}
    return proc.returncode, report, proc.stderr


BROKEN = "/opt/vfleet/models/broken"


def broken_model(node: Node) -> None:
    """A model that fails to load: the tiny model with its weights cut short."""
    models = "/opt/vfleet/models"
    node.host.run(
        f"rm -rf {BROKEN} && cp -a {models}/{MODEL} {BROKEN} && "
        f"for f in {BROKEN}/*.safetensors; do truncate -s 4096 $f; done"
    )


@contextlib.contextmanager
def balancer(fleet: Fleet, group: str, name: str) -> Iterator[tuple[Path, str]]:
    """`vfleet balancer` for an inventory group, on loopback; stopped at the end."""
    prefix = fleet.logs / name
    listen = f"127.0.0.1:{free_port()}"
    proc = subprocess.run(
        [VFLEET, "balancer", "render", group, "-i", str(fleet.inventory),
         "--dir", str(prefix), "--listen", listen],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    start = subprocess.run(
        [VFLEET, "balancer", "start", str(prefix)], capture_output=True, text=True, check=False
    )
    assert start.returncode == 0, start.stderr
    try:
        yield prefix, f"http://{listen}"
    finally:
        subprocess.run(
            [VFLEET, "balancer", "stop", str(prefix)], capture_output=True, timeout=120, check=False
        )


@pytest.fixture(scope="module")
def lb(fleet: Fleet) -> Iterator[tuple[Path, str]]:
    with balancer(fleet, "cpu_fleet", "balancer") as front:
        yield front


@pytest.mark.ci
def test_fleet_swap_behind_nginx_loses_no_request(fleet: Fleet, lb: tuple[Path, str]) -> None:
    """Both hosts to another model, one at a time, behind nginx, with load throughout. Clients
    keep the name they use (the alias is the name they called before): 0 failed requests."""
    prefix, url = lb
    # The red team's links in every service-user folder: the swap's root steps follow none.
    for n in fleet.nodes.values():
        plant_links(n)
    planted = {name: sentinels(n) for name, n in fleet.nodes.items()}
    scans = {name: outside_swap_writes(host_scan(n)) for name, n in fleet.nodes.items()}
    load = loadgen.Load(url, API_KEY, rate=1.0, max_requests=3000, limit_s=1500).start()
    try:
        # Windows by count, not fixed sleeps (issue 30): 6 answers before, and the first 6
        # after the swap returned (the old 10 s pause before that window went unchecked).
        steady = load.summary(load.answered(0, 6))
        t0 = load.now()
        rc, report, err = swap(
            fleet, "cpu_fleet", "--model", "tiny-dense", "--set", f"served_model_name={MODEL}",
            "--balancer", str(prefix), "--serial", "1,1",
        )  # fmt: skip
        t1 = load.now()
        during = load.summary(load.window(t0, t1))
        after = load.summary(load.answered(t1, 6))
    finally:
        load.stop()
        after_swap = {name: sentinels(n) for name, n in fleet.nodes.items()}
        rescans = {name: outside_swap_writes(host_scan(n)) for name, n in fleet.nodes.items()}
        for n in fleet.nodes.values():
            remove_links(n)
    # Every request, those in flight across a window's edge included (the windows count
    # requests by when they started, and one in flight at an edge is in neither).
    total = load.summary(load.requests)
    record("swap_fleet_behind_nginx", {"swap": report, "load_steady": steady,
                                       "load_during": during, "load_after": after,
                                       "load": total})  # fmt: skip
    assert rc == 0, err[-5000:] + "\n" + unit_journals(fleet)
    # Nothing outside vfleet's folder changed owner, mode, size, mtime or link target on
    # either host, but what the swap rewrites in root's own folders (SWAP_WRITES).
    changed = {n: sorted(set(scans[n]) ^ set(rescans[n])) for n in scans}
    assert not any(changed.values()), {n: c[:40] for n, c in changed.items()}
    # The release file changed with the swap (a new release); root's sentinels did not.
    for name in fleet.nodes:
        keep = [x for x in planted[name] if "vllm.yaml" not in x]
        assert [x for x in after_swap[name] if "vllm.yaml" not in x] == keep, name
        release = next(x.split() for x in after_swap[name] if x.startswith(RELEASE_FILE + " "))
        assert release[1:3] == ["0", "0"], (name, release)  # the new release's: root's too
    hosts = {h["host"]: h for h in report["hosts"]}
    for name in ("node1", "node2"):
        assert_swapped(fleet, hosts[name], f"tiny-dense as {MODEL}")
        assert hosts[name]["downtime_s"] > 0  # each host was down while it swapped...
    assert hosts["(balancer)"]["downtime_s"] == 0, hosts["(balancer)"]  # ...clients were not
    assert steady["failed"] == 0 and steady["ok"] >= 5, steady
    assert during["failed"] == 0 and during["ok"] >= 10, during
    assert after["failed"] == 0 and after["ok"] >= 5, after
    assert total["failed"] == 0, total
    state = json.loads((prefix / "balancer.json").read_text())
    assert [r["down"] for r in state["replicas"]] == [False, False]


@pytest.mark.ci
def test_broken_canary_is_rolled_back_and_the_rest_is_never_touched(
    fleet: Fleet, lb: tuple[Path, str]
) -> None:
    prefix, url = lb
    node1, node2 = fleet.nodes["node1"], fleet.nodes["node2"]
    broken_model(node1)
    node2_release = _snapshot(node2)
    load = loadgen.Load(url, API_KEY, rate=1.0, max_requests=3000, limit_s=1500).start()
    try:
        rc, report, err = swap(
            fleet, "cpu_fleet", "--model", MODEL, "--set", f"model_dir={BROKEN}",
            "--set", f"served_model_name={MODEL}", "--balancer", str(prefix),
        )  # fmt: skip
    finally:
        load.stop()
    total = load.summary(load.requests)
    record("swap_fleet_broken_canary", {"swap": report, "load": total})
    assert rc == 1, err[-3000:]
    assert "swap of node1 to tiny-hybrid-mtp failed at" in err
    # Why, as the operator reads it: how systemd saw the server end, and the log's error lines
    # (the loader's complaint about the cut weights), not the tail of an exit's leak report.
    assert re.search(r"its main process exited [1-9]", err), err[-3000:]
    assert re.search(r"last error in the log: .*(safetensors|Error)", err, re.I), err[-3000:]
    hosts = {h["host"]: h for h in report["hosts"]}
    assert f"back on tiny-dense as {MODEL} (previous release), serving" in hosts["node1"]["outcome"]
    assert hosts["node2"]["recap"] is None and "not touched" in hosts["node2"]["outcome"]
    assert hosts["node2"]["downtime_s"] == 0 and hosts["(balancer)"]["downtime_s"] == 0
    assert _snapshot(node2) == node2_release
    assert total["failed"] == 0 and total["ok"] >= 10, total
    state = json.loads((prefix / "balancer.json").read_text())
    assert [r["down"] for r in state["replicas"]] == [False, False]  # node1 re-admitted


@pytest.mark.ci
def test_single_box_swap_reports_downtime(fleet: Fleet) -> None:
    """One box, no spare capacity: stop -> start -> gate. Load runs throughout (bounded); the
    swap's own watcher and the load both measure the downtime. (node1 serves tiny-dense under
    the alias tiny-hybrid-mtp after the fleet swap above.)"""
    node1 = fleet.nodes["node1"]
    with _steady_load(node1) as (load, steady):
        t0 = load.now()
        rc, report, err = swap(fleet, "node1", "--model", MODEL)
        swapped = report.get("hosts", [{}])[0]
        assert rc == 0, err[-5000:] + "\n" + unit_journals(fleet)
        assert (swapped["weights_before"], swapped["weights_after"]) == ("tiny-dense", MODEL)
        assert_swapped(fleet, swapped, MODEL)
        # A single box has no spare capacity: the swap costs downtime, and says how much.
        assert swapped["downtime_s"] > 0 and len(swapped["outages"]) >= 1, swapped
        during = load.summary(load.window(t0, load.now()))
        record("swap_single_box", {"swap": report, "load_steady": steady, "load_during": during,
                                   "load_longest_gap_s": round(load.downtime(), 1)})  # fmt: skip
        assert during["ok"] >= 1 and during["failed"] >= 1, during  # down, then up again


# In make test-fleet (two vLLM starts CI's time does not hold, docs/BENCHMARKS.md): the broken
# canary above runs the same failed start and rollback in CI, behind the balancer.
def test_single_box_swap_rolls_back_a_broken_model(fleet: Fleet) -> None:
    """One box: a model whose weights fail to load. The gate fails, the host goes back to the
    previous release and serves; the broken start cost downtime too, then the old model serves
    every request."""
    node1 = fleet.nodes["node1"]
    with _steady_load(node1) as (load, _steady):
        broken_model(node1)
        t1 = load.now()
        # Weights of the same architecture (else preflight stops it and nothing changes).
        to_broken = ["--model", MODEL, "--set", f"model_dir={BROKEN}"]
        rc, report, err = swap(fleet, "node1", *to_broken)
        back = report.get("hosts", [{}])[0]
        assert rc == 1, err[-3000:]
        assert f'swap of node1 to {MODEL} failed at "' in err, err[-3000:]
        assert "The previous release was restored" in err
        weights = back["weights_before"]
        assert weights and back["weights_after"] == weights, back  # what it served before
        assert f"back on {weights}" in back["outcome"], back
        assert "(previous release), serving" in back["outcome"], back
        t2 = load.now()
        rolled = load.summary(load.window(t1, t2))
        restored = load.summary(load.answered(t2, 6))
        record("swap_single_box_broken", {"swap": report, "load": rolled,
                                          "load_after": restored})  # fmt: skip
        assert unit_show(node1)["ActiveState"] == "active"
    assert rolled["failed"] >= 1 and restored["failed"] == 0 and restored["ok"] >= 5, restored


@contextlib.contextmanager
def _steady_load(node: Node) -> Iterator[tuple[loadgen.Load, dict[str, Any]]]:
    """Load on node's own port (one request a second, bounded) once it served 4 without a
    failure, and the summary of those 4; stopped at the end of the block."""
    load = loadgen.Load(
        f"http://127.0.0.1:{node.port}", API_KEY, rate=1.0, max_requests=3000, limit_s=1500
    ).start()
    try:
        steady = load.summary(load.answered(0, 4))
        assert steady["ok"] >= 3 and steady["failed"] == 0, steady
        yield load, steady
    finally:
        load.stop()


def _perf_reference(fleet: Fleet, node: Node, current: str) -> str:
    """node's perf.json of the wired model at the gate's concurrency. After the single-box
    swap (make test's order) it is there; run alone (-k), one swap of the same weights from a
    release without figures makes it (the gate is off then: nothing to compare)."""
    got = node.host.run(f"cat {current}/perf.json", check=False)
    if got.returncode == 0:
        rec = json.loads(got.stdout)
        if rec["model"] == MODEL and rec["shape"]["concurrency"] == int(PERF_CONCURRENCY):
            return got.stdout
    rc, report, err = swap(
        fleet, node.host.name, "--model", MODEL, "--set", f"served_model_name={MODEL}",
        "--set", "shutdown_timeout_s=35",
    )  # fmt: skip
    assert rc == 0, err[-5000:] + "\n" + unit_journals(fleet)
    assert report["hosts"][0]["perf"]["state"] == "off", report["hosts"][0]
    return node.host.run(f"cat {current}/perf.json").stdout


# In CI (marked ci). On 42f9dca and 35473a3 it failed there: the slower release was rolled back
# both times, but the as-fast one failed on TTFT p95 (0.09 -> 1.41 s once; 0.21 -> 0.47 s twice
# in a row) while the other pytest worker started vLLM servers. Since then a failed bench is
# measured again (up to 3 benches, 20 s apart) and the swaps here pass the tolerances measured
# under a fleet run's load (PERF_TOLERANCES); the slower release fails on tokens per step, which
# load does not move (docs/SWAP.md, docs/BENCHMARKS.md: passed here under load 7-35).
@pytest.mark.ci
def test_performance_gate_rolls_back_a_slower_release_and_keeps_an_as_fast_one(
    fleet: Fleet, lb: tuple[Path, str]
) -> None:
    """Issue 20. node1 serves the wired tiny MTP model (release R1, measured at its rollout in
    the single-box swap above). A release that serves one request at a time (max_num_seqs 1,
    healthy: every health gate passes) is benched at the operator's concurrency of 4 while
    drained, found slower than R1 and rolled back; then a release whose only change cannot
    touch speed (the drain timeout) passes the gate and stays. Load through nginx throughout:
    no request fails."""
    prefix, url = lb
    node1 = fleet.nodes["node1"]
    current = "/opt/vfleet/instances/main/current"
    r1_perf = _perf_reference(fleet, node1, current)
    before = json.loads(r1_perf)
    assert before["model"] == MODEL and before["shape"]["concurrency"] == int(PERF_CONCURRENCY)
    common = ["--model", MODEL, "--set", f"served_model_name={MODEL}", "--balancer", str(prefix)]
    load = loadgen.Load(url, API_KEY, rate=1.0, max_requests=3000, limit_s=1500).start()
    t0 = time.monotonic()
    try:
        rc, slow, err = swap(fleet, "node1", *common, "--set", "max_num_seqs=1")
        t_slow = time.monotonic() - t0
        during_slow = load.summary(load.requests)
        serving = node1.host.run(f"basename $(readlink {current})").stdout.strip()
        serving_perf = node1.host.run(f"cat {current}/perf.json").stdout
        rc2, same, err2 = swap(fleet, "node1", *common, "--set", "shutdown_timeout_s=25")
        time.sleep(5)
    finally:
        load.stop()
    total = load.summary(load.requests)
    record("perf_gate", {"slow": slow, "as_fast": same, "load": total, "reference": before,
                         "seconds": {"slow": round(t_slow, 1),
                                     "both": round(time.monotonic() - t0, 1)}})  # fmt: skip
    # The slower release: healthy, but the performance gate failed it and it went back.
    assert rc == 1, err[-3000:]
    assert 'swap of node1 to tiny-hybrid-mtp failed at "Performance gate"' in err, err[-3000:]
    host = {h["host"]: h for h in slow["hosts"]}["node1"]
    assert f"back on {MODEL} (previous release), serving" in host["outcome"], host
    perf = host["perf"]
    assert perf["state"] == "fail" and perf["reference"].startswith("release "), perf
    worse = {c["figure"]: c for c in perf["checks"] if c["result"] == "worse"}
    assert worse, perf  # before/after of each failing figure are in the report
    for c in worse.values():
        assert c["before"] is not None and c["after"] is not None, c
    assert during_slow["failed"] == 0 and during_slow["ok"] >= 10, during_slow
    # R1 served again; it was not measured again (its perf.json was as it was).
    assert serving == before["release"] and serving_perf == r1_perf
    # The as-fast release passes the gate and stays; its figures are stored with it.
    assert rc2 == 0, err2[-3000:]
    host2 = {h["host"]: h for h in same["hosts"]}["node1"]
    assert_swapped(fleet, host2, MODEL)
    assert host2["perf"]["state"] == "pass", host2["perf"]
    after = json.loads(node1.host.run(f"cat {current}/perf.json").stdout)
    assert after["release"] != before["release"] and after["figures"]["output_tps"] > 0
    # The sidecar exports what this release measured (vfleet_release_*).
    sidecar = next(x.split("=", 1)[1] for x in node1.sets if x.startswith("sidecar_port="))
    exported = node1.host.run(
        'python3 -c "import urllib.request as u; '
        f"print(u.urlopen('http://127.0.0.1:{sidecar}/metrics', timeout=30).read().decode())\""
    ).stdout
    speed = re.search(
        r'^vfleet_release_output_tokens_per_second\{[^}]*release="(\w+)"[^}]*\} (\S+)$',
        exported,
        re.M,
    )
    assert speed, exported[-2000:]
    assert speed.group(1) == after["release"]
    assert float(speed.group(2)) == after["figures"]["output_tps"]
    assert total["failed"] == 0 and total["ok"] >= 20, total


def test_two_replicas_on_one_box_swap_one_at_a_time_without_downtime(fleet: Fleet) -> None:
    """The 4-GPU two-replica layout, on the CPU: node2's box runs instance main and instance b
    (inventory hosts node2 and node2b: one address, each its own core and port) behind a
    balancer; the swap takes one replica at a time and clients lose nothing."""
    node2, twin = fleet.nodes["node2"], fleet.twin
    # Both of one box in one batch: refused before anything changes on it.
    proc = make(fleet, "deploy", "HOST=node2_replicas")
    assert proc.returncode != 0
    assert "node2 and node2b are the same machine" in " ".join(proc.stdout.split())
    assert all(recap(proc.stdout, h)["changed"] == 0 for h in ("node2", "node2b"))
    proc = make(fleet, "deploy", "HOST=node2b")
    assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
    with balancer(fleet, "node2_replicas", "balancer-box") as (prefix, url):
        load = loadgen.Load(url, API_KEY, rate=1.0, max_requests=3000, limit_s=900).start()
        try:
            time.sleep(10)
            rc, report, err = swap(
                fleet, "node2_replicas", "--model", MODEL, "--set", f"served_model_name={MODEL}",
                "--balancer", str(prefix),
            )  # fmt: skip
            time.sleep(5)
        finally:
            load.stop()
    total = load.summary(load.requests)
    record("swap_two_replicas_one_box", {"swap": report, "load": total})
    try:
        assert rc == 0, err[-5000:] + "\n" + unit_journals(fleet)
        hosts = {h["host"]: h for h in report["hosts"]}
        for name in ("node2", "node2b"):
            assert_swapped(fleet, hosts[name], MODEL)
            assert hosts[name]["weights_before"] == "tiny-dense", hosts[name]
            assert hosts[name]["downtime_s"] > 0, hosts[name]  # each replica restarted...
        assert hosts["(balancer)"]["downtime_s"] == 0, hosts["(balancer)"]  # ...the box did not
        assert total["failed"] == 0 and total["ok"] >= 10, total
        pm2 = "PM2_HOME=/opt/vfleet/pm2/home /opt/vfleet/pm2/node_modules/.bin/pm2 jlist"
        apps = json.loads(node2.host.run(pm2).stdout.strip().splitlines()[-1])
        online = {p["name"] for p in apps if p["pm2_env"]["status"] == "online"}
        assert {"vfleet-vllm-main", "vfleet-vllm-b"} <= online, online
        assert chat(twin.port)[0] == 200
    finally:
        stop = make(fleet, "stop", "HOST=node2b")
        assert stop.returncode == 0, playbook_failure(stop.stdout, stop.stderr)


# The position-falling test model (vfleet model make --draft-acceptance, docs/TUNE.md "The test
# model"): unconditional acceptance per draft position. Steep, because on these hosts (eager,
# one core) a draft position costs about 0.3 of a target step (6.8 ms at depth 0, 10.8 ms at
# depth 2, measured by tune on node1): expected tokens/step 1, 1.9, 2.05, 2.1, 2.12 over step
# costs 1, 1.3, 1.6, 1.9, 2.2 make depth 1 the best by ~14% (docs/TUNE.md).
FALLING_RATES = "0.9,0.15,0.05,0.02"
FALLING = "/opt/vfleet/models/tiny-falling"


def tune(
    fleet: Fleet, inventory: Path, out: Path, *args: str
) -> tuple[int, dict[str, Any], str, float]:
    """`vfleet tune` with its report in `out`: (exit status, tune.json, its output, seconds).
    Its swaps' Ansible task times go to the fleet's logs (where a swap's minute goes)."""
    t0 = time.monotonic()
    proc = subprocess.run(
        [VFLEET, "tune", "-i", str(inventory), "--out", str(out), *args],
        capture_output=True, text=True, timeout=2400, check=False,
        env=dict(os.environ, **ansible_task_times(fleet.logs)),
    )  # fmt: skip
    seconds = round(time.monotonic() - t0, 1)
    report_file = out / "tune.json"
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    return proc.returncode, report, proc.stderr + proc.stdout, seconds


def best_depth(report: dict[str, Any]) -> str:
    return str(report["winner"]["picks"]["depth"])


# The tune tests are in this file so that they reuse the fleet's hosts (a file of its own would
# deploy a fleet again, minutes of worker time CI does not have). The exhaustive one was in CI
# from run 4 (docs/TUNE.md) to 2026-12-07. Earlier runs failed on the ranking under load (tune
# now takes the fastest repeat; the ranking is asserted up to the climb's margin), on systemd's
# start limit (reset before a deliberate start since), and on the gate's task for a release
# without speculative decoding (fixed in swap.yml); the sidecar's stale depth is fixed in the
# exporter.
def _tune_setup(fleet: Fleet, tmp_path: Path, model_dir: str) -> tuple[Path, Path]:
    """node1 in an inventory of its own, serving the position-falling model (built here and
    copied onto the host at ``model_dir``): tune writes its overrides beside it
    (host_vars/node1/), and the fleet's inventory stays as it was. Each test gives its own
    folder: its releases (named by their files) and its model's name are then its own, so the
    performance gate of one test's rollout never reads the figures another test's rollout left
    in a release folder. Returns (that inventory, tune's --out)."""
    node1 = fleet.nodes["node1"]
    built = tmp_path / "tiny-falling"
    python = vllm_python()
    make_model = subprocess.run(
        [VFLEET, "model", "make", MODEL, str(built), "--python", str(python),
         "--draft-acceptance", FALLING_RATES],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert make_model.returncode == 0, make_model.stderr[-3000:]
    shutil.copytree(built, node1.host.root / model_dir.lstrip("/"), dirs_exist_ok=True)
    doc = yaml.safe_load(fleet.inventory.read_text())
    doc["all"]["children"]["cpu_fleet"]["hosts"]["node1"]["vfleet_set"] = [
        *node1.sets,
        f"model_dir={model_dir}",
    ]
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    return inventory, tmp_path / "tune-node1"


def _tune_args(prefix: Path) -> list[str]:
    # Short benches (5 x 128 tokens per depth: seconds, beside minutes of swap); the shared
    # cores are the noise (docs/TUNE.md). --margin 0.1, as docs/TUNE.md advises on a shared
    # CPU: at 0.05 a 7 % dip of depth 2 under load turned the climb back (run 4); the
    # recorded runs' depth 4 was still 11-20 % below the best, so the climb leaves it out.
    return ["--sweep", "depth", "--repeats", "5", "--decode-tokens", "128",
            "--prompt-tokens", "64", "--budget", "40", "--margin", "0.1",
            "--balancer", str(prefix)]  # fmt: skip


def _assert_rolled_out(
    fleet: Fleet, prefix: Path, inventory: Path, report: dict[str, Any]
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """The winner of ``report`` rolled out: the inventory holds the depth, the host serves it,
    back in the balancer; tune's step times (and acceptance) per measured depth where the
    sidecar reads them; and the sidecar, given traffic, reports the depth as running and
    recommends it. Returns (the depth, step-times.json, the sidecar's advice)."""
    node1 = fleet.nodes["node1"]
    measured = {r["picks"]["depth"] for r in report["results"] if r["status"] == "measured"}
    tuned = yaml.safe_load((inventory.parent / "host_vars/node1/vfleet_tuned.yml").read_text())
    assert report["winner"]["sets"][-1] in tuned["vfleet_tuned_set"], tuned
    assert (inventory.parent / "host_vars/node1/vfleet_tuned.md").exists()
    served = node1.host.run("cat /opt/vfleet/instances/main/current/vllm.yaml").stdout
    depth = best_depth(report)
    if depth == "0":
        assert "speculative-config" not in served, served
    else:
        assert f"num_speculative_tokens: {depth}" in served, served
    state = json.loads((prefix / "balancer.json").read_text())
    assert [r["down"] for r in state["replicas"]] == [False, False]
    assert chat(node1.port)[0] == 200
    times = json.loads(node1.host.run("cat /opt/vfleet/instances/main/step-times.json").stdout)
    assert times["kind"] == "vfleet-step-times" and set(times["seconds_per_step"]) == measured
    assert set(times["accepted_per_draft"]) == measured - {"0"}, times
    # The sidecar was not restarted by the swaps (its unit did not change): it must see each
    # release's depth.
    at_winner = advice_after_traffic(node1)
    assert at_winner["running"] == float(depth), at_winner  # not the depth it started with
    if depth == "0":
        # Nothing is drafted: no acceptance to judge depths by (docs/TUNE.md).
        assert at_winner["state"] == "speculation_off", at_winner
    else:
        assert at_winner["state"] == "ok" and names_best(at_winner, depth), at_winner
    return depth, times, at_winner


@pytest.mark.ci
def test_tune_measures_two_depths_and_rolls_out_the_faster(
    fleet: Fleet, lb: tuple[Path, str], tmp_path: Path
) -> None:
    """CI's tune: `vfleet tune node1 --sweep depth --depths 0,2 --search grid` on the
    position-falling model, drained from the balancer. Each depth is deployed through the swap
    (without the performance gate: a candidate is measured, not judged) and measured,
    speculation off (0) among them; the faster is written into the inventory's
    host_vars/node1/vfleet_tuned.yml with the table and rolled out through the gated swap, the
    host is admitted again, and the sidecar, given traffic, reports the rolled-out depth as
    running and recommends it from tune's step times. Two or three vLLM starts: the rollout
    restarts vLLM only where the winner is not the release already running (depth 2, measured
    last). The climb against the exhaustive table over 0..4 (seven starts) is the next test,
    in `make test-fleet` (CI time; the climb's walk and a resumed run are also unit-tested:
    tests/unit/test_tune.py)."""
    prefix, _url = lb
    node1 = fleet.nodes["node1"]
    t0 = time.monotonic()
    sidecar_pid = unit_show(node1, "vfleet-sidecar@main.service")["MainPID"]
    inventory, out = _tune_setup(fleet, tmp_path, FALLING + "-ci")
    rc, grid, said, secs = tune(
        fleet, inventory, out, "node1", *_tune_args(prefix), "--depths", "0,2", "--search", "grid"
    )
    table_md = (out / "tune.md").read_text() if (out / "tune.md").exists() else ""
    with (fleet.logs / "tune.log").open("a") as log:
        log.write(f"{said}\n{table_md}\n")
    assert rc == 0, said[-4000:]
    measured = {r["picks"]["depth"] for r in grid["results"] if r["status"] == "measured"}
    assert measured == {"0", "2"}, grid["results"]
    assert grid["rollout"]["rc"] == 0 and grid["rollout"]["what"] != "putting the host back", grid[
        "rollout"
    ]
    depth, _times, at_winner = _assert_rolled_out(fleet, prefix, inventory, grid)
    pids = [sidecar_pid, unit_show(node1, "vfleet-sidecar@main.service")["MainPID"]]
    record("tune_two_depths", {"grid": grid, "seconds": secs, "winner": depth,
                               "at_winner": at_winner, "sidecar_pids": pids,
                               "total_s": round(time.monotonic() - t0, 1)})  # fmt: skip


def test_tune_finds_the_best_depth_of_an_exhaustive_measurement_and_rolls_it_out(
    fleet: Fleet, lb: tuple[Path, str], tmp_path: Path
) -> None:
    """`vfleet tune node1 --sweep depth` on the position-falling model, drained from the
    balancer: the climb starts at the depth node1 runs (3) and stops past the peak; a second
    run with --search grid (same --out: it resumes, measuring only the depths the climb left
    out, and any that failed) is the exhaustive table of every depth 0..4. Both pick the same
    depth; the host serves it, admitted to the balancer again, and the inventory's
    host_vars/node1/vfleet_tuned.yml says so, with the table beside it. The sidecar, given
    traffic, reports the rolled-out depth as running and recommends it (from live acceptance
    and tune's step times). Seven vLLM starts: `make test-fleet` (CI runs the test above)."""
    node1 = fleet.nodes["node1"]
    prefix, _url = lb
    t0 = time.monotonic()
    sidecar_pid = unit_show(node1, "vfleet-sidecar@main.service")["MainPID"]
    inventory, out = _tune_setup(fleet, tmp_path, FALLING)
    common = _tune_args(prefix)
    rc1, climb, said1, s1 = tune(fleet, inventory, out, "node1", *common)
    assert rc1 == 0, said1[-4000:]
    climb_md = (out / "tune.md").read_text()
    rc2, grid, said2, s2 = tune(fleet, inventory, out, "node1", *common, "--search", "grid")
    assert rc2 == 0, said2[-4000:]
    grid_md = (out / "tune.md").read_text()
    record("tune_depth", {"climb": climb, "grid": grid, "climb_s": s1, "grid_s": s2,
                          "total_s": round(time.monotonic() - t0, 1),
                          "climb_md": climb_md, "grid_md": grid_md})  # fmt: skip
    with (fleet.logs / "tune.log").open("a") as log:
        log.write(f"{said1}\n{climb_md}\n{said2}\n{grid_md}\n")
    measured = {r["picks"]["depth"] for r in grid["results"] if r["status"] == "measured"}
    assert measured == {"0", "1", "2", "3", "4"}, grid["results"]  # every depth, exhaustive
    # The second run measured only what the climb had left: the rest came from the state file.
    climb_keys = {r["key"] for r in climb["results"] if r["status"] == "measured"}
    assert {r["key"] for r in grid["results"] if r["run"] == 2} == (
        {f"depth={k}" for k in range(5)} - climb_keys
    )
    # Whether the climb left a depth out is the load's call on 2 shared cores (9116ef8's CI run:
    # depth 1 measured 3.1 % below depth 3, so the climb went on, correctly, through all
    # five); that it followed its rule on what it measured is the replay below.
    depth, times, at_winner = _assert_rolled_out(fleet, prefix, inventory, grid)
    # Recorded: whether the sidecar process lived through the tune's swaps (docs/TUNE.md).
    # The recommendation made from another depth than the best (live acceptance of the running
    # depth, the table's beyond it) is tests/unit/test_depth.py's: a swap to that depth here
    # cost a vLLM start (~75 s of CI) for logic the unit test fails on (docs/BENCHMARKS.md).
    pids = [sidecar_pid, unit_show(node1, "vfleet-sidecar@main.service")["MainPID"]]
    record("tune_depth_advice", {"winner": depth, "at_winner": at_winner,
                                 "sidecar_pids": pids})  # fmt: skip
    # Climb against exhaustive, on the table both read (the state file), not on the machine's
    # load: on 2 shared cores a depth's speed moved by up to 3x between candidates measured
    # minutes apart (docs/TUNE.md), so whether a depth the climb left out would win when
    # measured later is the load's call. What load cannot move: replayed over the measured
    # table, the climb's rule (tune_space.next_candidate, a pure function of the scores) visits
    # exactly the depths the climb measured and picks its winner; and where the two winners
    # differ, the exhaustive one is a depth the climb left out (of the depths both read, both
    # must pick the same). Whether they agreed is recorded (docs/TUNE.md).
    table = {r["key"]: r["objective"] for r in grid["results"]}
    visited, replayed = replay_climb(table, start=3, margin=0.1)
    assert visited == climb_keys and replayed == best_depth(climb), (visited, climb_md, grid_md)
    if best_depth(climb) != best_depth(grid):
        assert f"depth={best_depth(grid)}" not in climb_keys, (climb_md, grid_md)
    # The model's acceptance falls with position (what makes an interior depth the best on a
    # quiet machine): tune's measured acceptance per depth, A(k) accepted drafts per draft, has
    # falling increments. Acceptance is greedy decoding's, not a speed: load does not move it.
    a = {int(k): v for k, v in times["accepted_per_draft"].items()}
    gains = [a[1]] + [a[k] - a[k - 1] for k in (2, 3, 4)]
    assert gains[0] > gains[1] > gains[2] and gains[3] <= gains[2] + 0.02, a
    score = {r["picks"]["depth"]: r["objective"] for r in grid["results"]}
    inner, ends = max(score[d] for d in "123"), max(score["0"], score["4"])
    record("tune_depth_agreement", {"climb": best_depth(climb), "grid": best_depth(grid),
                                    "interior_best_vs_ends": inner / ends})  # fmt: skip


def advice_after_traffic(node: Node) -> dict[str, Any]:
    """The sidecar's depth advice once its window holds traffic like the tuner's bench (its
    client, its workload) at the depth the host runs now: read before and after it. Tried
    again (3 times at most) only where the second read found no drafts in the window or no
    advice at all: the deployed sidecar empties its window when one read of vLLM outlasts its
    3 s timeout, and keeps 60 s, so on starved cores the first read can be gone by the second."""
    for attempt in range(1, 4):
        sidecar_metrics(node)
        # As tune benches (until_decoded): where every stream was read late on starved cores,
        # no decode speed came out (CI, ac1c33a); the bench is then run again, 3 times at most.
        bench = functools.partial(
            measure, f"http://127.0.0.1:{node.port}", API_KEY, BenchPlan(1, 128, 64, 3)
        )
        traffic = until_decoded(bench, print)
        # Served but read late three times over (this session's fresh-clone CI on a slow
        # 2-core machine): its requests still put drafts in the sidecar's window, which is all
        # this needs; a bench whose requests failed says why after NO_DECODE and fails here.
        assert not isinstance(traffic, str) or traffic == NO_DECODE, traffic
        advice = depth_advice(sidecar_metrics(node))
        advice["traffic_acceptance"] = None if isinstance(traffic, str) else traffic.acceptance_rate
        advice["tries"] = attempt
        if advice["state"] not in (None, "no_drafts"):
            break
    return advice


def names_best(advice: dict[str, Any], depth: str) -> bool:
    """The sidecar recommends ``depth``, or a depth it expects less than 2 % faster. The step
    times are tune's and the acceptance is the same client's, so the expected tok/s are tune's
    measured ones up to the window's counts: where tune's best two were that close, either."""
    expected = {d: v for d, (v, _unmeasured) in advice["expected"].items()}
    best = str(int(advice["recommended"]))
    return best == depth or expected[depth] >= 0.98 * expected[best]


def sidecar_metrics(node: Node) -> str:
    """The sidecar's /metrics, read on the host (each read is a scrape: a sample of its window)."""
    port = next(x.split("=", 1)[1] for x in node.sets if x.startswith("sidecar_port="))
    return node.host.run(
        'python3 -c "import urllib.request as u; '
        f"print(u.urlopen('http://127.0.0.1:{port}/metrics', timeout=30).read().decode())\""
    ).stdout


def depth_advice(exported: str) -> dict[str, Any]:
    """The depth gauges of one sidecar read: running, recommended, gain, state, and the
    expected tok/s per depth (with how many positions were not measured live)."""

    def one(name: str) -> float | None:
        got = re.search(rf"^vfleet_spec_decode_{name}\{{[^}}]*\}} (\S+)$", exported, re.M)
        return float(got.group(1)) if got else None

    state = re.search(
        r'^vfleet_spec_decode_recommendation_state\{[^}]*state="(\w+)"[^}]*\} 1\.0$',
        exported,
        re.M,
    )
    expected = re.findall(
        r'^vfleet_spec_decode_expected_tokens_per_second\{[^}]*depth="(\d)",'
        r'extrapolated="(\d)"[^}]*\} (\S+)$',
        exported,
        re.M,
    )
    return {
        "state": state.group(1) if state else None,
        "running": one("running_depth"),
        "recommended": one("recommended_depth"),
        "gain": one("recommended_gain_ratio"),
        "expected": {d: [float(v), int(x)] for d, x, v in expected},
    }


def _probe_seconds(fleet: Fleet, test: str, host: str) -> list[float]:
    """How long each deploy's "Probe until ready" took on host in this test (the start, ready
    and warm: under pm2 the start task returns at once and this wait is the start)."""
    rows = [
        json.loads(line)
        for f in sorted(fleet.logs.glob(f"task-times-{test}.jsonl"))
        for line in f.read_text().splitlines()
        if line.strip()
    ]
    return [
        round(r["end"] - r["start"], 1)
        for r in rows
        if r["host"] == host and r["task"].endswith("Probe until ready")
    ]


def test_a_cache_seed_from_node1_makes_node2s_first_start_faster(
    fleet: Fleet, tmp_path: Path
) -> None:
    """`vfleet caches pack node1`, then node2's first start from empty caches twice: once
    without a seed (cold), once deployed with vfleet_cache_seed. The seed lands (owned by the
    service user), its bytecode is read as it is (not compiled again: pip gave node2's venv
    other mtimes, and the packed pycs are hash-checked) and the start to ready and warm is
    faster than the cold one. Both starts come after node2's earlier starts, so the page cache
    holds its venv in both. Eager mode here (fixture): torch.compile is not part of it.
    Before the host-loss test (it leaves node1 down); it needs the fleet deployed
    (test_fleet_deploy_serves_on_both_hosts)."""
    node2 = fleet.nodes["node2"]
    dirs = plan("cpu", MODEL).dirs
    seed = tmp_path / "node1-caches.tar"
    # The operator's key, made here: the seed is signed with it and node2 trusts its public key.
    key, signers = tmp_path / "operator", tmp_path / "allowed_signers"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "ops@fleet", "-f", str(key)],
        check=True, timeout=60,
    )  # fmt: skip
    pub = (tmp_path / "operator.pub").read_text().strip()
    signers.write_text(f'ops@fleet namespaces="vfleet-cache-seed" {pub}\n')
    seeded_args = ("-e", f"vfleet_cache_seed={seed}", "-e",
                   f"vfleet_cache_seed_allowed_signers={signers}")  # fmt: skip
    inv = str(fleet.inventory)
    # The red team's links in node1's folders, its cache included, before the pack (issue 29):
    # root's pack follows none (nothing of root's in the seed), and changes nothing on node1.
    node1 = fleet.nodes["node1"]
    plant_links(node1)
    scan1 = host_scan(node1)
    t0 = time.monotonic()
    packed = subprocess.run(
        [VFLEET, "caches", "pack", "node1", "-i", inv, "--key", str(key), "--out", str(seed)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    pack_s = round(time.monotonic() - t0, 1)
    try:
        assert packed.returncode == 0, packed.stderr[-3000:]
        assert host_scan(node1) == scan1  # owner, mode, size, mtime of every path on node1
        with tarfile.open(seed) as tar:
            for m in tar.getmembers():
                assert m.isfile() or m.isdir(), (m.name, m.type)  # no link travels
                if m.isfile() and m.size < 64:
                    fh = tar.extractfile(m)
                    assert fh is not None and b"root-only" not in fh.read(), m.name
    finally:
        remove_links(node1)
    manifest = read_manifest(str(seed))
    assert manifest["source_host"] == "node1" and manifest["accelerator"] == "cpu", manifest
    assert manifest["pyc"]["compiled"] > 1000, manifest["pyc"]  # the venv's bytecode
    # Bytecode node2's start reads for sure: torch's and vLLM's package modules.
    with tarfile.open(seed) as tar:
        members = [
            m
            for m in tar.getmembers()
            if re.search(r"/site-packages/(torch|vllm)/__init__\.cpython-\d+\.pyc$", m.name)
        ]
        assert len(members) == 2, [m.name for m in members]
        want = {}
        for m in members:
            fh = tar.extractfile(m)
            assert fh is not None
            want[dirs.cache + m.name.removeprefix("cache")] = hashlib.sha256(fh.read()).hexdigest()
    test = "test_a_cache_seed_from_node1_makes_node2s_first_start_faster"

    def first_start(*ansible_args: str, planted: bool = False) -> subprocess.CompletedProcess[str]:
        proc = make(fleet, "stop", "HOST=node2")
        assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
        caches = f"{dirs.cache} {dirs.home}/.cache"
        node2.host.run(f"find {caches} -mindepth 1 -delete", check=False)
        left = node2.host.run(f"find {caches} -type f 2>/dev/null | wc -l").stdout
        assert int(left) == 0, left
        # Links in the service user's HOME and state before the unpack (the cache roots stay
        # empty, else the seed is skipped): the deploy's root steps, the unpack among them,
        # follow none. A link at or inside a cache root is tests/unit/test_cache_seed.py's.
        if planted:
            plant_links(node2, SERVICE_FOLDERS[:2])
        before = host_scan(node2) if planted else []
        try:
            proc = make(fleet, "deploy", "HOST=node2", ansible_args=" ".join(ansible_args))
            assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
            if planted:
                assert host_scan(node2) == before
        finally:
            if planted:
                remove_links(node2)
        assert chat(node2.port)[0] == 200
        return proc

    first_start()
    seeded = first_start(*seeded_args, planted=True)
    cold_s, seeded_s = _probe_seconds(fleet, test, "node2")[-2:]
    record(
        "cache_seed_node2_first_start",
        {"cold_s": cold_s, "seeded_s": seeded_s, "pack_s": pack_s,
         "seed_mib": round(seed.stat().st_size / 2**20, 1), "pyc": manifest["pyc"]},
    )  # fmt: skip
    out = seeded.stdout.replace('\\"', '"')
    assert '"unpacked": true' in out and '"signed_by": "ops@fleet"' in out, out[-3000:]
    # The seed's bytecode is on node2, the service user's, and the start read it unchanged
    # (a stale pyc would have been written again).
    got = node2.host.run("sha256sum " + " ".join(want)).stdout.split()
    assert dict(zip(got[1::2], got[0::2], strict=True)) == want
    owners = node2.host.run("stat -c %U " + " ".join(want)).stdout.split()
    assert owners == ["vfleet"] * len(want), owners
    assert seeded_s < 0.9 * cold_s, (cold_s, seeded_s)
    # The venv's non-Python files carry the pinned time (FlashInfer's ninja inputs on a GPU
    # host), its Python sources their own (timestamp pycs check them).
    pinned = plan("cpu", MODEL).software.file_time
    times = node2.host.run(
        f"stat -c %Y {dirs.venv}/pyvenv.cfg {dirs.venv}/lib/python3*/site-packages/vllm/__init__.py"
    ).stdout.split()
    assert int(times[0]) == pinned and int(times[1]) > pinned, times
    # A redeploy: the caches hold files now; the seed is not unpacked again.
    proc = make(fleet, "deploy", "HOST=node2", ansible_args=" ".join(seeded_args))
    assert proc.returncode == 0, playbook_failure(proc.stdout, proc.stderr)
    assert recap(proc.stdout, "node2")["changed"] == 0, proc.stdout[-3000:]


@pytest.mark.ci
def test_losing_a_host_mid_rollout_stops_it_and_says_which(
    fleet: Fleet, lb: tuple[Path, str]
) -> None:
    """The canary's container stops while its swap runs (it was drained in the balancer):
    the rollout stops, node2 is never touched, clients lose nothing, and the report names the
    lost host and why. Last in the file: node1 stays down."""
    prefix, url = lb
    node1, node2 = fleet.nodes["node1"], fleet.nodes["node2"]
    node2_release = _snapshot(node2)
    load = loadgen.Load(url, API_KEY, rate=1.0, max_requests=3000, limit_s=900).start()
    swap_argv = [
        VFLEET, "swap", "cpu_fleet", "--model", MODEL, "--set", f"served_model_name={MODEL}",
        "--balancer", str(prefix), "-i", str(fleet.inventory), "--json", "--interval", "2",
    ]  # fmt: skip
    proc = subprocess.Popen(swap_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # The swap has begun on node1 once the balancer drained it: then the box "dies".
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            state = json.loads((prefix / "balancer.json").read_text())
            if any(r["host"] == "node1" and r["down"] for r in state["replicas"]):
                break
            time.sleep(0.2)
        else:
            pytest.fail("the swap never drained node1")
        lost_at = load.now()
        # A power cut, not a poweroff: a box shutting down still answers ssh for a moment, and
        # the swap then fails a gate there instead (seen: "port in use" while vLLM drained;
        # the rescue's serving check then keeps it drained).
        node1.host.kill()
        out, err = proc.communicate(timeout=900)
        time.sleep(5)
    finally:
        if proc.poll() is None:
            proc.kill()
        load.stop()
    with (fleet.logs / "swap.log").open("a") as log:
        log.write(f"\n$ {' '.join(swap_argv[1:])}  (node1 lost)\n{err}\n{out}\n")
    report = json.loads(out)
    total = load.summary(load.requests)
    record("swap_fleet_host_lost", {"swap": report, "load": total,
                                    "lost_after_s": round(lost_at, 1)})  # fmt: skip
    assert proc.returncode == 1, err[-3000:]
    hosts = {h["host"]: h for h in report["hosts"]}
    lost = hosts["node1"]
    assert lost["recap"] and lost["recap"]["unreachable"] >= 1, lost
    assert "lost (unreachable)" in lost["outcome"], lost
    assert "left drained in the balancer" in lost["outcome"], lost
    # Ansible's words depend on when the box died: mid-task ("Data could not be sent to
    # remote host ... over ssh") or between tasks ("Failed to connect to the host via ssh").
    assert lost["why"].startswith("unreachable: ") and "ssh" in lost["why"], lost["why"]
    assert lost["model_after"] is None  # not serving: its box is gone
    assert hosts["node2"]["recap"] is None and "not touched" in hosts["node2"]["outcome"]
    assert hosts["node2"]["downtime_s"] == 0 and hosts["(balancer)"]["downtime_s"] == 0
    assert _snapshot(node2) == node2_release
    # Clients were served by node2 throughout: the balancer had drained node1 before it died.
    assert total["failed"] == 0 and total["ok"] >= 5, total
    text = subprocess.run(
        [VFLEET, "balancer", "show", str(prefix)], capture_output=True, text=True, check=True
    ).stdout
    assert re.search(r"node1\s.*drained", text) and re.search(r"node2\s.*\bin$", text, re.M)
