"""Host targeting: which inventory hosts, their variables, how to reach them, their plan.

Every fleet command (doctor, releases, rollback, status, swap, balancer, tune, bench) names
its hosts the way Ansible does: an inventory host or pattern, resolved with `ansible` and
`ansible-inventory`, so that they reach the same machine, as the same user, that
`make deploy` does. This module owns that: the host's variables (`host_vars`), the ssh argv
and `sudo` its inventory asks for, running hostfacts.py there (`run_hostfacts`), and the deploy
plan of the host's instance built as the deploy builds it (`host_plan`), with the command-line
options every such command shares (`host_args`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from vfleet.config.escape import host_name
from vfleet.config.schema import HostVars
from vfleet.engine.compile import Launch, resolve
from vfleet.errors import VfleetError
from vfleet.hostside.hostfacts import Request
from vfleet.paths import ANSIBLE_DIR, DEFAULT_INVENTORY, hostside_script
from vfleet.render.plan import Plan
from vfleet.render.plan import plan as deploy_plan

ANSIBLE_CFG = ANSIBLE_DIR / "ansible.cfg"
# What `make deploy` deploys when nothing says otherwise (Makefile, role defaults).
DEFAULTS = {"profile": "cpu", "model": "tiny-hybrid-mtp"}
# Environment of the running server compared with vllm.env: the rendered keys, and every key
# with one of these prefixes (set by whoever started the process manager, i.e. drift).
ENV_PREFIXES = ["VLLM_", "CUDA_", "NCCL_", "PYTORCH_", "TORCH", "OMP_", "HF_"]
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
    host_name(host, inventory)
    if not Path(inventory).exists():
        raise VfleetError(
            "inventory not found",
            where=inventory,
            fix="pass -i INVENTORY (a YAML or INI file, or a folder with hosts and group_vars)",
        )
    try:
        r = subprocess.run(
            [_ansible_inventory(), "-i", inventory, "--host", host],
            stdin=subprocess.DEVNULL,  # see ansible_bin: Ansible refuses a non-blocking one
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


def is_local(hv: dict[str, Any], host: str) -> bool:
    """The inventory runs this host's tasks on this machine (ansible_connection: local)."""
    return str(literal(hv, "ansible_connection", host)) == "local"


def address(hv: dict[str, Any], host: str) -> str:
    """The address ssh and HTTP reach the host at: ansible_host, else its inventory name."""
    return str(literal(hv, "ansible_host", host) or host)


def ssh_argv(host: str, hv: dict[str, Any]) -> list[str]:
    v = {key: literal(hv, key, host) for key in SSH_KEYS}
    argv = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    if v["ansible_port"]:
        argv += ["-p", str(v["ansible_port"])]
    if v["ansible_ssh_private_key_file"]:
        argv += ["-i", os.path.expanduser(str(v["ansible_ssh_private_key_file"]))]
    for key in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        argv += shlex.split(str(v[key] or ""))
    at = address(hv, host)
    argv.append(f"{v['ansible_user']}@{at}" if v["ansible_user"] else at)
    return argv


def become(hv: dict[str, Any], host: str) -> list[str]:
    """`sudo -n [-u USER]` where the inventory says ansible_become, as the deploy runs."""
    flag = literal(hv, "ansible_become", host)
    if str(flag).lower() not in ("true", "yes", "1"):
        return []
    user = literal(hv, "ansible_become_user", host)
    # Root can read every process's environment and sockets; -n: never wait for a password.
    return ["sudo", "-n", *(["-u", str(user)] if user and user != "root" else [])]


def script_argv(
    host: str, hv: dict[str, Any], python: str, script: Path, args: list[str]
) -> tuple[list[str], str | None, str]:
    """How to run a host-side script on ``host`` with ``args``: argv, what goes on its stdin
    (the script itself, over ssh) and how to name the target in messages."""
    connection = literal(hv, "ansible_connection", host) or "ssh"
    sudo = become(hv, host)
    if connection == "local":
        return [*sudo, python, str(script), *args], None, "this machine"
    if connection in ("ssh", "smart"):
        # The script travels on stdin: nothing is copied to or left on the host.
        argv = [*ssh_argv(host, hv), shlex.join([*sudo, python, "-", *args])]
        return argv, script.read_text(encoding="utf-8"), argv[-2]
    raise VfleetError(
        f"ansible_connection {connection!r} is not supported",
        where=f"inventory host {host}",
        fix="vfleet reaches hosts over ssh or locally (ansible_connection: ssh or local)",
    )


def run_hostfacts(host: str, hv: dict[str, Any], req: Request, python: str) -> dict[str, Any]:
    """hostfacts.py's JSON from ``host``. VfleetError (exit 2) when it cannot be had."""
    connection = literal(hv, "ansible_connection", host) or "ssh"
    sudo = become(hv, host)
    argv, stdin, target = script_argv(host, hv, python, HOSTFACTS, [json.dumps(req)])
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


# --------------------------------------------------------------------------- hosts


# Every Ansible command vfleet runs gets a /dev/null stdin of its own. Ansible's
# CLIs refuse to start on a non-blocking stdin ("Ansible requires blocking IO on stdin/stdout/
# stderr"), and an inherited stdin is a file description shared with every other process that
# holds it: a Node.js process beside vfleet (pm2) may set O_NONBLOCK on it. The project's CI
# failed a deploy on exactly that; none of these commands reads its stdin.


def ansible_bin(name: str) -> str:
    beside = Path(sys.executable).parent / name  # the vfleet venv's Ansible
    if beside.exists():
        return str(beside)
    raise VfleetError(f"{name} not found", fix="run vfleet from its virtualenv (`make venv`)")


def hosts_of(inventory: str, pattern: str) -> list[str]:
    """The inventory hosts a pattern names, as Ansible expands it (a group, a host, a:b)."""
    if not Path(inventory).exists():
        raise VfleetError("inventory not found", where=inventory, fix="pass -i INVENTORY")
    r = subprocess.run(
        [ansible_bin("ansible"), "-i", inventory, pattern, "--list-hosts"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=dict(os.environ, ANSIBLE_CONFIG=str(ANSIBLE_CFG)),
    )
    hosts = [line.strip() for line in r.stdout.splitlines()[1:] if line.strip()]
    if r.returncode != 0 or not hosts:
        raise VfleetError(
            f"no inventory host matches {pattern!r}",
            where=inventory,
            fix="name a host or a group of the inventory (ansible-inventory -i INV --graph)",
        )
    return [host_name(h, inventory) for h in hosts]


def host_namespace(
    inventory: str,
    host: str,
    model: str | None,
    instance: str | None,
    base_dir: str | None = None,
    api_key_file: str | None = None,
) -> argparse.Namespace:
    """What `vfleet doctor HOST` would be given: the host's instance as the inventory has it."""
    return argparse.Namespace(
        host=host,
        inventory=inventory,
        profile=None,
        model=model,
        instance=instance,
        deployment=None,
        sets=None,
        base_dir=base_dir,
        profiles_dir=None,
        api_key_file=api_key_file,
    )


# --------------------------------------------------------------------------- the host's plan


def host_settings(a: argparse.Namespace, hv: dict[str, Any]) -> dict[str, Any]:
    """Options, else the host's vfleet_* inventory vars, else what `make deploy` uses."""

    def pick(option: Any, var: str, default: Any) -> Any:
        if option is not None:
            return option
        value = literal(hv, var, a.host)
        return default if value in (None, "") else value

    sets = pick(a.sets, "vfleet_set", [])
    # What `vfleet tune` wrote for the host (host_vars/<host>/vfleet_tuned.yml): the role
    # applies it after vfleet_set. Settings given as options replace both, as they replace
    # vfleet_set.
    tuned = [] if a.sets is not None else pick(None, "vfleet_tuned_set", [])
    deployment = pick(a.deployment, "vfleet_deployment", None)
    # A deployment file names its own profile and model.
    return {
        "profile": pick(a.profile, "vfleet_profile", None if deployment else DEFAULTS["profile"]),
        "model": pick(a.model, "vfleet_model", None if deployment else DEFAULTS["model"]),
        "instance": pick(a.instance, "vfleet_instance", None),
        "base_dir": os.path.expanduser(pick(a.base_dir, "vfleet_base_dir", HostVars().base_dir)),
        "python": pick(None, "vfleet_python", HostVars().python),
        "sets": [
            *(shlex.split(sets) if isinstance(sets, str) else list(sets)),
            *(shlex.split(tuned) if isinstance(tuned, str) else list(tuned)),
        ],
        "deployment": deployment,
        "profiles_dir": pick(a.profiles_dir, "vfleet_profiles_dir", None),
        "api_key_file": pick(getattr(a, "api_key_file", None), "vfleet_api_key_file", None),
    }


def host_plan(
    a: argparse.Namespace, hv: dict[str, Any], gpu_topology: str = ""
) -> tuple[Plan, str]:
    """The deploy plan of a.host's instance, built as `make deploy` builds it; its Python.

    `gpu_topology`: the host's `nvidia-smi topo -m`, which a deploy reads before planning.
    """
    s = host_settings(a, hv)
    plan = deploy_plan(
        s["profile"],
        s["model"],
        instance=s["instance"],
        base_dir=s["base_dir"],
        python=s["python"],
        sets=s["sets"],
        deployment=s["deployment"],
        profiles_dir=s["profiles_dir"],
        host_name=a.host,
        gpu_topology=gpu_topology,
        api_key_file=s["api_key_file"],
    )
    return plan, str(s["python"])


def host_launch(a: argparse.Namespace, hv: dict[str, Any], plan: Plan) -> Launch:
    """The host's instance resolved as the deploy resolves it (the rules' decisions, which the
    planner reads): ``plan`` is its deploy plan (`host_plan`)."""
    s = host_settings(a, hv)
    instance = s["instance"]
    return resolve(
        plan.profile,
        plan.model.name,
        deployment=Path(s["deployment"]) if s["deployment"] else None,
        sets=[*s["sets"], *([f"instance={instance}"] if instance else [])],
        root=Path(s["profiles_dir"]) if s["profiles_dir"] else None,
        host=HostVars(name=a.host, base_dir=s["base_dir"], python=s["python"]),
    )


def request(plan: Plan) -> Request:
    """What hostfacts.py should look at on the host for this plan."""
    dirs = plan.dirs
    secrets = plan.secret_keys()
    req: Request = {
        "base_dir": dirs.base,
        "instance_dir": dirs.instance,
        "current_dir": dirs.current,
        "venv_dir": dirs.venv,
        "model_dir": plan.model.dir,
        "accelerator": plan.accelerator.kind,
        "ports": [plan.service.port, plan.sidecar.port],
        "packages": list(plan.software.os_packages),
        "unit": plan.service.unit_name,
        "pm2": {"bin": plan.pm2.bin, "home": plan.pm2.home, "name": plan.service.pm2_name},
        "log_file": plan.service.log_file,
        "url": plan.service.url,
        "env_file": f"{dirs.current}/vllm.env",
        "env_keys": sorted({*plan.env(), *secrets}),
        "env_prefixes": ENV_PREFIXES,
        "secret_keys": secrets,
    }
    plugin_state = plan.env().get("VFLEET_SM75_STATE")
    if plugin_state:  # the SM75 plugin's runtime decision (check_plugin)
        req["plugin_state_file"] = plugin_state
    return req


# --------------------------------------------------------------------------- command-line options


def inventory_arg(p: argparse.ArgumentParser) -> None:
    """-i INVENTORY, as every command that reads the inventory takes it."""
    p.add_argument(
        "-i",
        "--inventory",
        default=str(DEFAULT_INVENTORY),
        metavar="INVENTORY",
        help="Ansible inventory (default: the repository's ansible/inventory/local.yml)",
    )


def api_key_file_arg(p: argparse.ArgumentParser) -> None:
    """--api-key-file: the key as the deploy had it, from a file, never on the command line."""
    p.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="file holding the API key (one line, mode 0600), as `make deploy API_KEY_FILE=` "
        "gave it (default: vfleet_api_key_file); never --set api_key=, which every local user "
        "reads in ps",
    )


def host_args(p: argparse.ArgumentParser) -> None:
    """HOST and how its instance was deployed: shared by doctor, releases and rollback."""
    p.add_argument("host", metavar="HOST", help="inventory host name (e.g. localhost)")
    inventory_arg(p)
    p.add_argument("-p", "--profile", help="hardware profile (default: vfleet_profile, cpu)")
    p.add_argument("-m", "--model", help="model preset (default: vfleet_model, tiny-hybrid-mtp)")
    p.add_argument("--instance", metavar="NAME", help="instance (default: vfleet_instance, main)")
    p.add_argument(
        "-d", "--deployment", metavar="FILE", help="deployment YAML, as the deploy used it"
    )
    p.add_argument(
        "--set",
        "-s",
        dest="sets",
        action="append",
        metavar="KEY=VALUE",
        help="a setting as the deploy had it (repeatable; replaces the host's vfleet_set)",
    )
    api_key_file_arg(p)
    p.add_argument(
        "--base-dir",
        metavar="DIR",
        help=f"vfleet's folder on the host (default: vfleet_base_dir, {HostVars().base_dir})",
    )
    p.add_argument("--profiles-dir", metavar="DIR", help="profiles folder on this machine")
