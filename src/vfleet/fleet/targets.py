"""Which server `vfleet bench run --host HOST` measures: an inventory host's instance.

The instance is found the way `vfleet doctor` and `make deploy` find it (the host's vfleet_*
inventory vars, else the options, else the defaults), so its URL and its release manifest
are the deploy's. vLLM listens on loopback by default: for a remote host the bench then
reaches it through an SSH tunnel with the inventory's user, port and key, open only while
the bench runs.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from vfleet.errors import VfleetError

LOOPBACK = ("127.0.0.1", "localhost", "::1")
TUNNEL_TIMEOUT_S = 20


@dataclass
class HostTarget:
    url: str
    release: dict[str, Any]
    source: str
    # What the host is (OS, CPU, memory, GPUs and driver, the venv's Python), from hostfacts.
    host: dict[str, Any] = field(default_factory=dict)
    tunnel: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def close(self) -> None:
        if self.tunnel is not None and self.tunnel.poll() is None:
            self.tunnel.terminate()
            try:
                self.tunnel.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.tunnel.kill()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _open_tunnel(
    ssh: list[str], remote_host: str, remote_port: int, host: str
) -> tuple[str, subprocess.Popen[bytes]]:
    local = _free_port()
    argv = [
        *ssh[:-1],
        "-N",
        "-o",
        "ExitOnForwardFailure=yes",
        "-L",
        f"127.0.0.1:{local}:{remote_host}:{remote_port}",
        ssh[-1],
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + TUNNEL_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            err = (proc.stderr.read() if proc.stderr else b"").decode(errors="replace").strip()
            raise VfleetError(
                f"ssh tunnel failed (exit {proc.returncode}): {err}",
                where=host,
                fix="check that `ssh` to the host works with the inventory's user, port and key",
            )
        with socket.socket() as s:
            s.settimeout(1)
            if s.connect_ex(("127.0.0.1", local)) == 0:
                return f"http://127.0.0.1:{local}", proc
        time.sleep(0.2)
    proc.kill()
    raise VfleetError(f"ssh tunnel not up in {TUNNEL_TIMEOUT_S} s", where=host)


def host_summary(facts: dict[str, Any]) -> dict[str, Any]:
    """The facts a benchmark result keeps about the machine it measured."""
    from vfleet.fleet.doctor import parse_cuda_version, parse_gpus

    gpus = facts.get("gpus") or {}
    return {
        "os": facts.get("os"),
        "cpu": facts.get("cpu"),
        "memory": facts.get("memory"),
        "gpus": parse_gpus(gpus["query"]) if gpus.get("query") else None,
        "driver_cuda": parse_cuda_version(gpus["header"]) if gpus.get("header") else None,
        "venv": facts.get("venv"),
        "gathered_at": facts.get("gathered_at"),
    }


def resolve(a: argparse.Namespace) -> HostTarget:
    """The URL (tunnelled if needed) and release manifest of the host's instance."""
    from vfleet.fleet.doctor import host_plan, request
    from vfleet.fleet.remote import host_vars, run_hostfacts

    hv = host_vars(a.inventory, a.host)
    plan, python = host_plan(a, hv)
    host = host_summary(run_hostfacts(a.host, hv, request(plan), python))
    manifest = next(f["content"] for f in plan["files"] if f["name"] == "release.json")
    release: dict[str, Any] = json.loads(manifest)
    source = f"inventory host {a.host}, instance {plan['instance']} (release {plan['release_id']})"
    url, tunnel, how = endpoint(a.host, hv, plan)
    return HostTarget(url, release, source + how, host, tunnel)


def endpoint(
    host: str, hv: dict[str, Any], plan: dict[str, Any]
) -> tuple[str, subprocess.Popen[bytes] | None, str]:
    """Where this machine reaches the instance: (url, the ssh tunnel if one was opened, how).

    vLLM listens on loopback by default: a remote host's instance is then reached through an
    SSH tunnel (the inventory's user, port and key), which the caller closes.
    """
    from vfleet.fleet.remote import literal, ssh_argv

    if str(literal(hv, "ansible_connection", host)) == "local":
        return str(plan["url"]), None, ""
    address = str(literal(hv, "ansible_host", host) or host)
    if str(plan["listen_host"]) in LOOPBACK:
        url, proc = _open_tunnel(ssh_argv(host, hv), "127.0.0.1", int(plan["port"]), host)
        return url, proc, ", through an ssh tunnel"
    return f"http://{address}:{plan['port']}", None, ""
