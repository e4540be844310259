"""The instance's service: pm2 or systemd state, why it failed (from its log), copies, HTTP."""

from __future__ import annotations

import os
from typing import Any

from vfleet.fleet.doctor.common import Finding, fail, make_deploy, ok, restart_command, warn
from vfleet.hostside.logwhy import last_error, since_last_start
from vfleet.render.plan import Plan


def _why_from_log(plan: Plan, facts: dict[str, Any]) -> str:
    tail = facts.get("log_tail")
    if tail is None:
        return f"; no log at {plan.service.log_file}"
    reason = last_error(since_last_start(tail))
    return f"; last error in {plan.service.log_file}: {reason}" if reason else ""


def _systemd_finding(plan: Plan, facts: dict[str, Any], sd: dict[str, str]) -> Finding:
    unit = plan.service.unit_name
    active, sub, result = sd.get("ActiveState"), sd.get("SubState"), sd.get("Result")
    restarts = sd.get("NRestarts", "?")
    fix = (
        f"read `tail -n 100 {plan.service.log_file}`, fix the cause, then systemctl restart {unit}"
    )
    if active == "active":
        if sd.get("UnitFileState") == "disabled":
            return warn(
                "service",
                f"{unit}: active, but disabled: it will not start at boot",
                f"systemctl enable {unit}",
            )
        return ok(
            "service", f"{unit}: active ({sub}), {restarts} restarts, pid {sd.get('MainPID')}"
        )
    if result == "start-limit-hit" or sd.get("StartLimitHit") == "yes":
        return fail(
            "service",
            f"{unit}: failed: the start limit stopped a crash loop after {restarts} restarts"
            + _why_from_log(plan, facts),
            fix,
        )
    if active == "failed":
        code, status = sd.get("ExecMainCode"), sd.get("ExecMainStatus")
        # systemd's ExecMainCode is the siginfo code: 1 exited, 2 killed, 3 dumped core.
        how = f"exit status {status}" if code == "1" else f"signal {status}"
        return fail(
            "service", f"{unit}: failed ({result}, {how})" + _why_from_log(plan, facts), fix
        )
    if active == "activating" and sub == "auto-restart":
        return fail(
            "service",
            f"{unit}: crash loop, waiting to restart ({restarts} restarts so far)"
            + _why_from_log(plan, facts),
            fix,
        )
    if active == "activating":
        return warn(
            "service",
            f"{unit}: still starting ({sub}: prerequisites, model load or warmup)",
            f"wait, and follow it: tail -f {plan.service.log_file}",
        )
    return warn(
        "service",
        f"{unit}: {active} ({sub}), {sd.get('UnitFileState')}: stopped (`make stop` also "
        "disables it)",
        f"systemctl start {unit}, or {make_deploy(plan)}",
    )


def _pm2_finding(plan: Plan, facts: dict[str, Any], app: dict[str, Any]) -> Finding:
    name, pm2 = plan.service.pm2_name, plan.pm2
    fix = (
        f"read `tail -n 100 {plan.service.log_file}`, fix the cause, then "
        f"PM2_HOME={pm2.home} {pm2.bin} restart {name}"
    )
    if app["status"] != "online":
        return fail(
            "service",
            f"pm2 {name}: {app['status']} after {app['restart_time']} restarts"
            + _why_from_log(plan, facts),
            fix,
        )
    if app.get("unstable_restarts"):
        # Restarts within min_uptime: online now, but only until the next crash.
        return warn(
            "service",
            f"pm2 {name}: online, but restarted {app['unstable_restarts']} times within "
            "min_uptime (a crash loop, until max_restarts stops it)" + _why_from_log(plan, facts),
            fix,
        )
    return ok("service", f"pm2 {name}: online, {app['restart_time']} restarts, pid {app['pid']}")


def check_service(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    inst = facts.get("instance")
    out: list[Finding] = []
    app = (facts.get("pm2") or {}).get("app")
    if app:
        out.append(_pm2_finding(plan, facts, app))
    sd = facts.get("systemd") or {}
    current = (facts.get("release") or {}).get("current")
    # The instance unit loads from its template wherever another instance installed it: an
    # inactive one says nothing beside a pm2 app, or before this instance is deployed.
    idle = sd.get("ActiveState") == "inactive" and (app or not current)
    if sd.get("LoadState") == "loaded" and not idle:
        out.append(_systemd_finding(plan, facts, sd))
    if out:
        return out
    if inst:
        return [
            warn(
                "service",
                f"vLLM runs as pid {inst['pid']}, but neither pm2 nor systemd manages it: "
                "nothing restarts it when it dies",
                f"stop it (kill {inst['pid']}) and deploy: {make_deploy(plan)}",
            )
        ]
    if current:
        # pm2 keeps a crashed app (errored, stopped): no entry means stopped on purpose
        # (`make stop` deletes it) or a pm2 daemon gone with a reboot.
        return [
            warn(
                "service",
                f"deployed (current -> {os.path.basename(current)}) but not running, and "
                "neither pm2 nor systemd has it (stopped by `make stop`, or lost at a reboot)",
                make_deploy(plan),
            )
        ]
    return [ok("service", f"instance {plan.instance} not deployed")]


def check_copies(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    """Two servers of one instance: a leftover holds memory (and GPU memory) beside the new."""
    managed = {
        ((facts.get("pm2") or {}).get("app") or {}).get("pid"),
        int((facts.get("systemd") or {}).get("MainPID") or 0),
    }
    out = []
    for key, what in (("instance", "vLLM server"), ("sidecar", "sidecar")):
        proc = facts.get(key)
        if not proc or not proc["others"]:
            continue
        pids = [proc["pid"], *proc["others"]]
        strays = [p for p in pids if p not in managed] if managed & set(pids) else pids[1:]
        out.append(
            fail(
                "copies",
                f"{len(pids)} copies of instance {plan.instance}'s {what} run: pids "
                f"{', '.join(map(str, pids))}",
                f"stop the one(s) no process manager runs: kill {' '.join(map(str, strays))}",
            )
        )
    return out


def check_http(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    inst, http = facts.get("instance"), facts.get("http")
    if not inst or not http:
        return []
    if http["models"] is None:
        error = http["models_error"]
        if "HTTP 401" in error:
            return [
                warn(
                    "http",
                    f"{error}: the server's API key is not the one in vllm.env (see drift:env)",
                    f"restart it so it reads vllm.env: {restart_command(plan, facts)}",
                )
            ]
        started, now = inst.get("started_at"), facts.get("gathered_at")
        age = f", started {now - started:.0f} s ago," if started and now else ""  # host clock
        return [
            warn(
                "http",
                f"pid {inst['pid']} runs{age} but {error} (still loading, or hung)",
                f"follow the log: tail -f {plan.service.log_file}; "
                f"then `vfleet status {plan.service.url}`",
            )
        ]
    ids = ", ".join(str(m["id"]) for m in http["models"]) or "no models"
    return [ok("http", f"{plan.service.url}/v1/models serves {ids}")]
