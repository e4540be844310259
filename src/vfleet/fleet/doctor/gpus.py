"""GPU checks on nvidia-smi text as hostfacts.py gathers it: count, model, SM, memory, CUDA."""

from __future__ import annotations

import re
from typing import Any

from vfleet.engine.topology import parse_topology
from vfleet.fleet.doctor.common import Finding, fail, gather_error, make_deploy, ok, proc_tree, warn
from vfleet.render.plan import Plan

# nvidia-smi reports the usable MiB, a little under the marketed size.
VRAM_TOLERANCE = 0.97
# More than this in use on a GPU that vLLM is about to take: something still holds it (the same
# limit as `vfleet-probe --prereqs`).
GPU_BUSY_MIB = 1024


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", text))


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


def tensor_parallel(plan: Plan) -> int:
    return int(plan.config().get("tensor-parallel-size", 1))


def used_cards(plan: Plan, cards: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The GPUs this instance takes: CUDA_VISIBLE_DEVICES if rendered (PCI order, as the
    rendered CUDA_DEVICE_ORDER makes CUDA count), else the first `count`."""
    visible = plan.env().get("CUDA_VISIBLE_DEVICES")
    if visible:
        wanted = [int(x) for x in visible.split(",") if x.strip().isdigit()]
        cards = [c for c in cards if c["index"] in wanted]
    return cards[: plan.accelerator.count]


def check_gpus(plan: Plan, facts: dict[str, Any]) -> list[Finding]:
    acc = plan.accelerator
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
    if len(used) < acc.count:
        out.append(
            fail(
                "gpu",
                f"{len(used)} usable GPU(s) of {len(cards)}, profile {plan.profile} needs "
                f"{acc.count}",
                "use a host with enough GPUs, or a profile for this one (`vfleet profiles`)",
            )
        )
    elif acc.gpu_model and any(acc.gpu_model not in c["name"] for c in used):
        out.append(
            warn(
                "gpu",
                f"GPUs {_indices(used)}: {names}; profile {plan.profile} is for "
                f"{acc.gpu_model} (its memory plan and kernels assume that card)",
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


def _check_sm_vram(plan: Plan, used: list[dict[str, Any]]) -> list[Finding]:
    acc = plan.accelerator
    out: list[Finding] = []
    wrong_sm = [c for c in used if c["compute_cap"] != acc.compute_capability]
    if wrong_sm:
        out.append(
            fail(
                "gpu-sm",
                ", ".join(f"GPU {c['index']} is SM {c['compute_cap']}" for c in wrong_sm)
                + f"; profile {plan.profile} is built for SM {acc.compute_capability} "
                "(attention backend, dtype and kernels are chosen per SM)",
                "use the profile for this card's compute capability (`vfleet profiles`)",
            )
        )
    elif used:
        out.append(ok("gpu-sm", f"SM {acc.compute_capability}"))
    if acc.vram_gib:
        floor_mib = acc.vram_gib * 1024 * VRAM_TOLERANCE
        small = [c for c in used if c["total_mib"] is not None and c["total_mib"] < floor_mib]
        if small:
            out.append(
                fail(
                    "gpu-vram",
                    ", ".join(f"GPU {c['index']} has {c['total_mib']:.0f} MiB" for c in small)
                    + f"; profile {plan.profile} plans for {acc.vram_gib:g} GiB per card",
                    "use the profile for this card, or check the fit: "
                    f"`vfleet plan -p {plan.profile} -m {plan.model.name}`",
                )
            )
        elif used:
            mib = min(c["total_mib"] or 0 for c in used)
            out.append(ok("gpu-vram", f"{mib:.0f} MiB per card (profile: {acc.vram_gib:g} GiB)"))
    return out


def _check_cuda(plan: Plan, gpus: dict[str, Any]) -> list[Finding]:
    want = plan.software.stack.cuda
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
                f"the driver supports CUDA {have}, stack {plan.software.stack_name} installs CUDA "
                f"{want} wheels (torch {plan.software.stack.torch}): kernels will not load",
                f"upgrade the NVIDIA driver until `nvidia-smi` shows CUDA Version >= {want}, or "
                "choose a stack with an older CUDA (`vfleet profiles`, --set stack=...)",
            )
        ]
    return [ok("cuda-driver", f"driver CUDA {have} >= stack CUDA {want}")]


def _check_topology(plan: Plan, gpus: dict[str, Any], group: list[dict[str, Any]]) -> list[Finding]:
    links = parse_topology(gpus["topology"])
    ids = [c["index"] for c in group]
    pairs = {(i, j): links.get((i, j), "?") for n, i in enumerate(ids) for j in ids[n + 1 :]}
    text = ", ".join(f"GPU{i}-GPU{j} {link}" for (i, j), link in pairs.items())
    nvlink = all(link.startswith("NV") for link in pairs.values())
    # The all-reduce rule (engine/rules/multigpu.py): custom all-reduce only when every
    # pair is NVLink.
    custom = not plan.config().get("disable-custom-all-reduce", False)
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
    mine = proc_tree(facts.get("instance"))
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
