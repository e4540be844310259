"""Run hostfacts.py on an inventory host: with the local Python, or over ssh.

The host is resolved the way Ansible resolves it (`ansible-inventory --host`), so the doctor
reaches the same machine, as the same user, that `make deploy` does.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from vfleet.errors import VfleetError
from vfleet.hostside.hostfacts import Request
from vfleet.paths import hostside_script

HOSTFACTS = hostside_script("hostfacts")
# hostfacts bounds each external command itself (15 s); this bounds the whole run.
RUN_TIMEOUT_S = 180
SSH_KEYS = (
    "ansible_host",
    "ansible_port",
    "ansible_user",
    "ansible_ssh_private_key_file",
    "ansible_ssh_common_args",
    "ansible_ssh_extra_args",
)


def _ansible_inventory() -> str:
    beside = Path(sys.executable).parent / "ansible-inventory"  # the vfleet venv's Ansible
    found = str(beside) if beside.exists() else shutil.which("ansible-inventory")
    if not found:
        raise VfleetError(
            "ansible-inventory not found",
            fix="run vfleet from its virtualenv (`make venv` installs Ansible)",
        )
    return found


def host_vars(inventory: str, host: str) -> dict[str, Any]:
    """The host's variables as Ansible sees them (ansible_*, vfleet_*)."""
    if not Path(inventory).exists():
        raise VfleetError(
            "inventory not found",
            where=inventory,
            fix="pass -i INVENTORY (a YAML or INI file, or a folder with hosts and group_vars)",
        )
    try:
        r = subprocess.run(
            [_ansible_inventory(), "-i", inventory, "--host", host],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise VfleetError("ansible-inventory timed out", where=inventory) from None
    if r.returncode != 0:
        said = " ".join(line.strip() for line in r.stderr.strip().splitlines()[-3:])
        raise VfleetError(
            f"host {host!r} is not in the inventory (ansible-inventory: {said})",
            where=inventory,
            fix=f"add {host} under all.hosts in {inventory}, or pass the inventory that has "
            "it with -i",
        )
    return dict(json.loads(r.stdout))


def literal(hv: dict[str, Any], key: str, host: str) -> Any:
    """An inventory value the doctor can use as it is (it does not render Jinja)."""
    value = hv.get(key)
    if isinstance(value, str) and "{{" in value:
        raise VfleetError(
            f"{key} is a template ({value}); the doctor reads inventory values literally",
            where=f"inventory host {host}",
            fix=f"give {key} a plain value for this host",
        )
    return value


def ssh_argv(host: str, hv: dict[str, Any]) -> list[str]:
    v = {key: literal(hv, key, host) for key in SSH_KEYS}
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    if v["ansible_port"]:
        argv += ["-p", str(v["ansible_port"])]
    if v["ansible_ssh_private_key_file"]:
        argv += ["-i", os.path.expanduser(str(v["ansible_ssh_private_key_file"]))]
    for key in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        argv += shlex.split(str(v[key] or ""))
    address = str(v["ansible_host"] or host)
    argv.append(f"{v['ansible_user']}@{address}" if v["ansible_user"] else address)
    return argv


def become(hv: dict[str, Any], host: str) -> list[str]:
    """`sudo -n [-u USER]` where the inventory says ansible_become, as the deploy runs."""
    flag = literal(hv, "ansible_become", host)
    if str(flag).lower() not in ("true", "yes", "1"):
        return []
    user = literal(hv, "ansible_become_user", host)
    # Root can read every process's environment and sockets; -n: never wait for a password.
    return ["sudo", "-n", *(["-u", str(user)] if user and user != "root" else [])]


def run_hostfacts(host: str, hv: dict[str, Any], req: Request, python: str) -> dict[str, Any]:
    """hostfacts.py's JSON from ``host``. VfleetError (exit 2) when it cannot be had."""
    payload = json.dumps(req)
    connection = literal(hv, "ansible_connection", host) or "ssh"
    sudo = become(hv, host)
    if connection == "local":
        argv, stdin = [*sudo, python, str(HOSTFACTS), payload], None
        target = "this machine"
    elif connection in ("ssh", "smart"):
        # The script travels on stdin: nothing is copied to or left on the host.
        remote = shlex.join([*sudo, python, "-", payload])
        argv = [*ssh_argv(host, hv), remote]
        stdin, target = HOSTFACTS.read_text(encoding="utf-8"), argv[-2]
    else:
        raise VfleetError(
            f"ansible_connection {connection!r} is not supported",
            where=f"inventory host {host}",
            fix="the doctor runs over ssh or locally (ansible_connection: ssh or local)",
        )
    try:
        r = subprocess.run(
            argv, input=stdin, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        raise VfleetError(f"{argv[0]} not found", where=f"host {host}") from None
    except subprocess.TimeoutExpired:
        raise VfleetError(
            f"gathering facts on {target} took over {RUN_TIMEOUT_S} s", where=f"host {host}"
        ) from None
    err = r.stderr.strip()
    if r.returncode == 255 and connection != "local":
        raise VfleetError(
            f"ssh to {target} failed: {err}",
            where=f"host {host}",
            fix=f"check that `{shlex.join(argv[:-1])} true` works without a password "
            "(user, port, key and ssh args come from the inventory)",
        )
    if r.returncode != 0:
        raise VfleetError(
            f"hostfacts.py failed on {target} (exit {r.returncode}): {err[-600:]}",
            where=f"host {host}",
            fix=f"the host needs Python >= 3.11 as `{python}` (vfleet_python in the inventory)"
            + (", and `sudo -n` without a password (ansible_become)" if sudo else ""),
        )
    try:
        return dict(json.loads(r.stdout))
    except ValueError:
        raise VfleetError(
            f"hostfacts.py on {target} printed no JSON: {r.stdout[:200]!r} {err[-300:]}",
            where=f"host {host}",
        ) from None
