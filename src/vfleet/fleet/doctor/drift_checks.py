"""Drift: the running instance (or its installed files) against the rendered release."""

from __future__ import annotations

import json
import os
import shlex
from typing import Any

import yaml

from vfleet.fleet.doctor.common import (
    CLOCK_SLACK_S,
    Finding,
    make_deploy,
    ok,
    restart_command,
    warn,
)
from vfleet.hostside.hostfacts import is_secret, sha256
from vfleet.render.plan import Plan

_UNSET = object()


def _show(value: Any) -> str:
    return "unset" if value is _UNSET else json.dumps(value, default=str)


def _drift_config(plan: Plan, text: str | None, path: str, fix: str) -> list[Finding]:
    """The rendered vllm.yaml vs ``text``: the running server's --config file, else current's."""
    if text is None:
        return [
            warn(
                "drift:vllm.yaml",
                f"cannot read {path}",
                "run the doctor as root or as the service user",
            )
        ]
    try:
        running = dict(yaml.safe_load(text) or {})
    except yaml.YAMLError as exc:
        return [warn("drift:vllm.yaml", f"{path}: {exc}", fix)]
    rendered = plan.config()
    out = []
    for key in sorted(set(rendered) | set(running)):
        r, x = rendered.get(key, _UNSET), running.get(key, _UNSET)
        if r != x:
            out.append(
                warn("drift:vllm.yaml", f"{key}: rendered {_show(r)}, {path} has {_show(x)}", fix)
            )
    return out


def _drift_env(plan: Plan, inst: dict[str, Any], fix: str) -> list[Finding]:
    running = inst["environ"]
    if running is None:
        return [
            warn(
                "drift:env",
                f"cannot read the environment of pid {inst['pid']}",
                "run the doctor as root or as the service user",
            )
        ]
    secrets = plan.secret_keys()
    rendered = plan.env()
    out = []
    for key in sorted(set(rendered) | set(running)):
        secret = is_secret(key, secrets)
        r: Any = rendered.get(key, _UNSET)
        x: Any = running.get(key, _UNSET)
        if secret and r is not _UNSET:
            r = sha256(r)  # hostfacts sends secrets as their sha256
        if r == x:
            continue
        if secret:
            what = (
                "rendered but not set in the process"
                if x is _UNSET
                else "set in the process but not rendered"
                if r is _UNSET
                else "differs from the rendered value"
            )
            msg = f"{key}: {what} (a secret: compared by sha256, not shown)"
        else:
            msg = f"{key}: rendered {_show(r)}, running {_show(x)}"
        out.append(warn("drift:env", msg, fix))
    return out


def _drift_served(plan: Plan, http: dict[str, Any] | None, fix: str) -> list[Finding]:
    if not http or http["models"] is None:
        return []
    cfg = plan.config()
    out = []
    names = cfg.get("served-model-name", cfg.get("model"))
    want = {str(n) for n in (names if isinstance(names, list) else [names])}
    have = {str(m["id"]) for m in http["models"]}
    if have != want:
        out.append(
            warn(
                "drift:served-model",
                f"/v1/models serves {sorted(have)}, rendered served-model-name {sorted(want)}",
                fix,
            )
        )
    max_len = cfg.get("max-model-len")
    for m in http["models"]:
        if max_len is not None and m["max_model_len"] != max_len:
            out.append(
                warn(
                    "drift:served-model",
                    f"{m['id']}: max_model_len {m['max_model_len']}, rendered {max_len}",
                    fix,
                )
            )
    return out


def _drift_cache(plan: Plan, http: dict[str, Any] | None, fix: str) -> list[Finding]:
    labels = (http or {}).get("cache_config")
    if not labels:
        return []
    cfg = plan.config()
    expected: dict[str, str] = {}
    if "block-size" in cfg:
        expected["block_size"] = str(cfg["block-size"])
    if "kv-cache-dtype" in cfg:
        expected["cache_dtype"] = str(cfg["kv-cache-dtype"])
    if cfg.get("enable-prefix-caching"):
        expected["enable_prefix_caching"] = "True"
    if cfg.get("no-enable-prefix-caching"):
        expected["enable_prefix_caching"] = "False"
    if "kv-cache-memory-bytes" in cfg:
        expected["kv_cache_memory_bytes"] = str(cfg["kv-cache-memory-bytes"])
    out = [
        warn(
            "drift:cache",
            f"vllm:cache_config_info {label}={labels.get(label)!r}, rendered {want!r}",
            fix,
        )
        for label, want in expected.items()
        if labels.get(label) != want
    ]
    util = cfg.get("gpu-memory-utilization")
    running_util = labels.get("gpu_memory_utilization")
    if util is not None and running_util is not None and float(running_util) != float(util):
        out.append(
            warn(
                "drift:cache",
                f"vllm:cache_config_info gpu_memory_utilization={running_util}, rendered {util}",
                fix,
            )
        )
    return out


def launch_argv(plan: Plan) -> list[str]:
    """How launch.sh (templates/launch.sh.j2) starts vLLM: `exec python -m MODULE --config`."""
    return [
        f"{plan.dirs.venv}/bin/python",
        "-m",
        plan.service.server_module,
        "--config",
        f"{plan.dirs.current}/vllm.yaml",
    ]


def drift(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    """The running instance vs this plan's rendered release. Nothing when not deployed."""
    out: list[Finding] = []
    release = facts.get("release") or {}
    current = release.get("current")
    inst = facts.get("instance")
    redeploy = f"{make_deploy(plan)} (re-renders and restarts; change settings with SET=...)"
    if current and os.path.basename(current) != plan.release_id:
        out.append(
            warn(
                "drift:release",
                f"current -> release {os.path.basename(current)}, this plan renders "
                f"{plan.release_id}: the host has other settings (or the doctor was given "
                "different ones than the deploy)",
                f"deploy this plan: {redeploy}; or run the doctor with the deploy's -p/-m/--set",
            )
        )
    if inst:
        restart = f"restart it through its process manager: {restart_command(plan, facts)}"
        switched, started = release.get("switched_at"), inst.get("started_at")
        if switched and started and switched > started + CLOCK_SLACK_S:
            out.append(
                warn(
                    "drift:restart",
                    f"pid {inst['pid']} started before `current` moved to "
                    f"{os.path.basename(current or '')}: it still runs the previous release",
                    restart,
                )
            )
        if inst["argv"] != launch_argv(plan):
            out.append(
                warn(
                    "drift:argv",
                    f"pid {inst['pid']} runs `{shlex.join(inst['argv'])}`, launch.sh runs "
                    f"`{shlex.join(launch_argv(plan))}`",
                    f"stop pid {inst['pid']} and start the instance through its process "
                    f"manager: {redeploy}",
                )
            )
        out += _drift_config(plan, inst["config_text"], inst["config_realpath"], redeploy)
        out += _drift_env(plan, inst, restart)
        out += _drift_served(plan, facts.get("http"), restart)
        out += _drift_cache(plan, facts.get("http"), restart)
    elif current:
        # Not running: what the next start would read.
        out += _drift_config(plan, release.get("config_text"), f"{current}/vllm.yaml", redeploy)
    if not out and (inst or current):
        what = "the running instance matches" if inst else "not running; its files match"
        out.append(ok("drift", f"{what} the rendered release {plan.release_id}"))
    return out
