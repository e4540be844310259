"""Which checks run for a plan: the doctor's verdict, the deploy's preflight."""

from __future__ import annotations

from typing import Any

from vfleet.fleet.doctor.common import Finding
from vfleet.fleet.doctor.drift_checks import drift
from vfleet.fleet.doctor.gpus import check_gpus
from vfleet.fleet.doctor.host_checks import (
    check_cpu,
    check_disk,
    check_memory,
    check_model,
    check_packages,
    check_plugin,
    check_ports,
    check_python,
    check_threads,
    check_time,
)
from vfleet.fleet.doctor.service import check_copies, check_http, check_service
from vfleet.render.plan import Plan


def judge(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    """Preflight: is this host fit for the plan, and is the instance healthy?"""
    checks = [check_python, check_packages, check_time]
    checks += [check_gpus] if plan.accelerator.kind == "cuda" else [check_cpu, check_memory]
    checks += [check_threads, check_disk, check_model, check_plugin, check_ports, check_service]
    checks += [check_copies]
    checks += [check_http]
    return [finding for check in checks for finding in check(plan, facts)]


def findings_from(plan: Plan, facts: dict[str, Any], drift: bool = True) -> list[Finding]:
    """Everything the doctor says about one host (the Ansible lookup's entry point)."""
    return judge(plan, facts) + (_drift(plan, facts) if drift else [])


_drift = drift  # findings_from's `drift` flag shadows the function inside it

# What a deploy is there to change: a failed or duplicated service, a server not answering.
# Ports too: the role's own preflight tells this instance's listener from a stranger's
# (pm2 or systemd state), which the doctor's process matching missed on a pm2 redeploy in CI.
RUNTIME_CHECKS = {"service", "copies", "http", "port", "sidecar-port"}


def preflight(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    """The deploy's gate (the role's first step): the host checks, not the running state."""
    return [f for f in judge(plan, facts) if f.check not in RUNTIME_CHECKS]
