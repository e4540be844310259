"""Rules: all-reduce over the host's GPU links, and multimodal profiling."""

from __future__ import annotations

from vfleet.engine.rules.core import (
    COMMUNITY,
    SEED_BOOST,
    SEED_SYSTEMD,
    SEED_TURBO3,
    Ctx,
    rule,
)
from vfleet.engine.topology import group_links


@rule(
    "all-reduce",
    SEED_SYSTEMD + "; " + SEED_TURBO3 + "; " + COMMUNITY,
    "custom all-reduce over NVLink, NCCL otherwise, from the host's real topology",
)
def all_reduce(c: Ctx) -> None:
    tp = c.d.tp
    if c.is_cpu or tp < 2:
        return
    if c.s.custom_all_reduce is True:
        c.info("custom all-reduce left on (operator setting)")
        return
    if c.s.custom_all_reduce is False:
        c.arg("disable-custom-all-reduce", True, "operator setting")
        return
    gpus = c.s.gpus or list(range(tp))
    links = group_links(c.host.gpu_topology, gpus[:tp])
    if links == "nvlink":
        c.info(
            f"custom all-reduce left on: GPUs {gpus[:tp]} are NVLink-connected on every pair "
            "(nvidia-smi topo -m on the host), as on seed 002's box"
        )
    elif links == "pcie":
        c.arg(
            "disable-custom-all-reduce",
            True,
            f"GPUs {gpus[:tp]} are not NVLink-connected on every pair (nvidia-smi topo -m on the "
            "host): NCCL; custom all-reduce over PCIe was unstable on these cards (seed 004)",
        )
    else:
        c.arg(
            "disable-custom-all-reduce",
            True,
            "the GPU topology is not known here (a deploy reads nvidia-smi topo -m on the host "
            "and leaves custom all-reduce on over NVLink); NCCL is safe on any link. "
            "custom_all_reduce: true forces it on",
        )


@rule(
    "multimodal-profiling", SEED_SYSTEMD, "do not reserve VRAM for image profiling on 22 GB cards"
)
def multimodal_profiling(c: Ctx) -> None:
    if c.s.language_model_only:
        c.arg("language-model-only", True, "text only: the vision tower is not loaded", SEED_BOOST)
    elif c.model.arch.multimodal and c.is_sm75:
        c.arg(
            "skip-mm-profiling",
            True,
            "the vision tower's profiling run costs KV capacity on 22 GB cards",
        )
