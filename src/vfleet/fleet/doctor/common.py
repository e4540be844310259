"""Findings and what every doctor check shares: plan-derived numbers and the fix commands."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

from vfleet.config.defaults import BASE_DIR, USER_BASE_DIR
from vfleet.config.schema import Quantization
from vfleet.engine.planner import weight_bytes
from vfleet.fleet.inventory import DEFAULTS
from vfleet.hostside.hostfacts import is_secret
from vfleet.render.plan import Plan

Status = Literal["ok", "warn", "fail"]
GIB = 1 << 30
# A process started this long before `current` moved still runs the previous release.
CLOCK_SLACK_S = 2.0


@dataclass(frozen=True)
class Finding:
    check: str
    status: Status
    message: str
    fix: str = ""


def ok(check: str, message: str) -> Finding:
    return Finding(check, "ok", message)


def warn(check: str, message: str, fix: str) -> Finding:
    return Finding(check, "warn", message, fix)


def fail(check: str, message: str, fix: str) -> Finding:
    return Finding(check, "fail", message, fix)


def weights_bytes(plan: Plan) -> int:
    """The preset's weights as the planner estimates them (what is on disk and in memory)."""
    parts = weight_bytes(
        plan.model.arch, Quantization.model_validate({"method": plan.model.quantization})
    )
    return sum(parts.values()) + int(plan.model.unmodelled_weights_gib * GIB)


def make_deploy(plan: Plan, change: str = "") -> str:
    """The `make deploy` that deploys this plan again, with ``change`` (key=value) on top.

    Variables at the Makefile's defaults are left out; secrets in SET show as <secret>."""
    # The Makefile's BASE_DIR: /opt/vfleet as root, else under the operator's home.
    base = BASE_DIR if os.geteuid() == 0 else os.path.expanduser(USER_BASE_DIR)
    words = ["make deploy"]
    for var, value, default in (
        ("HOST", plan.monitoring["labels"]["host"], "localhost"),
        ("PROFILE", plan.profile, DEFAULTS["profile"]),
        ("MODEL", plan.model.name, DEFAULTS["model"]),
        ("INSTANCE", plan.instance, "main"),
        ("BASE_DIR", plan.dirs.base, base),
    ):
        if value != default:
            words.append(f"{var}={value}")
    changed = change.split("=", 1)[0] + "=" if change else None
    sets = []
    for item in plan.sets:
        key = item.split("=", 1)[0]
        if key == "instance" or (changed and item.startswith(changed)):
            continue  # INSTANCE= says it; the change replaces the old value
        sets.append(f"{key}=<secret>" if is_secret(key, []) else item)
    sets += [change] if change else []
    if sets:
        words.append(f"SET='{' '.join(sets)}'")
    return " ".join(words)


def restart_command(plan: Plan, facts: dict[str, Any]) -> str:
    if (facts.get("pm2") or {}).get("app"):
        pm2 = plan.pm2
        return f"PM2_HOME={pm2.home} {pm2.bin} restart {plan.service.pm2_name}"
    if (facts.get("systemd") or {}).get("LoadState") == "loaded":
        return f"systemctl restart {plan.service.unit_name}"
    return make_deploy(plan)


def unknown(check: str, facts: dict[str, Any], name: str, fix: str) -> list[Finding]:
    """A check whose facts hostfacts could not gather: a warning that says why."""
    return [warn(check, f"unknown: {gather_error(facts, name)}", fix)]


def gather_error(facts: dict[str, Any], name: str) -> str:
    """Why hostfacts could not gather `name` (its line in facts['errors'])."""
    for line in facts.get("errors") or []:
        if line.startswith(f"{name}:"):
            return str(line.split(":", 1)[1].strip())
    return "not gathered"


def proc_tree(proc: dict[str, Any] | None) -> set[int]:
    if not proc:
        return set()
    return {proc["pid"], *(c["pid"] for c in proc["children"])}
