"""Can the installed FlashInfer run paged prefill on SM75? Read from its files, not imported.

vLLM 0.24+ refuses FlashInfer on SM75 citing flashinfer issue 3620 and PR 3621. PR 3621 was
closed unmerged; the bug was fixed by PR 3526 (first released in flashinfer-python 0.6.16),
which makes the unused KV scale-factor buffers in ``SharedStorageQKVO`` take no shared memory,
so the head_dim 128/256 prefill tiles fit SM75's 64 KiB again. Its marker in the shipped header
is ``struct KVScaleFactorSmem``. Locally patched trees with PR 3621 are not accepted: its head
still fails fp8-KV, head_dim 256 prefill (Qwen3.x) with "Invalid configuration ... NUM_MMA_KV=1".

FlashInfer 0.6.18 also stopped shipping SM75 kernels in ``flashinfer-jit-cache`` (PR 4757): with
such a jit-cache installed the first prefill on SM75 fails ("no kernel image"); without one,
FlashInfer compiles its kernels at run time and needs nvcc.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

HEADER = Path("data", "include", "flashinfer", "attention", "prefill.cuh")
FIX_MARKER = "struct KVScaleFactorSmem"  # flashinfer PR 3526
FIX_RELEASE = (0, 6, 16)
JIT_CACHE_WITHOUT_SM75 = (0, 6, 18)


@dataclass
class FlashInferFacts:
    version: str | None
    has_fix: bool | None  # the PR 3526 marker in the shipped header (or the release, without one)
    detail: str
    cannot_run: str | None = None  # why SM75 kernels could not be had (jit-cache, nvcc), if so


def _release(version: str) -> tuple[int, ...]:
    """``0.6.16.post3`` -> (0, 6, 16): the leading numeric release, as packaging reads it."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in match.group(0).split(".")) if match else ()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def nvcc() -> str | None:
    """Where FlashInfer's JIT looks: FLASHINFER_NVCC, CUDA_HOME/CUDA_PATH, PATH, /usr/local/cuda."""
    if os.environ.get("FLASHINFER_NVCC"):
        return os.environ["FLASHINFER_NVCC"]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and Path(os.environ[var], "bin", "nvcc").exists():
            return str(Path(os.environ[var], "bin", "nvcc"))
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def flashinfer_facts() -> FlashInferFacts:
    version = _version("flashinfer-python")
    if version is None:
        return FlashInferFacts(None, None, "flashinfer-python is not installed")
    spec = importlib.util.find_spec("flashinfer")  # finds the package without running it
    header = None
    if spec is not None and spec.submodule_search_locations:
        header = next(
            (
                Path(loc) / HEADER
                for loc in spec.submodule_search_locations
                if (Path(loc) / HEADER).is_file()
            ),
            None,
        )
    if header is not None:
        fixed = FIX_MARKER in header.read_text(encoding="utf-8", errors="replace")
        how = f"{header} {'has' if fixed else 'lacks'} {FIX_MARKER!r} (flashinfer PR 3526)"
    else:
        fixed = _release(version) >= FIX_RELEASE
        how = f"no shipped header; version {'>=' if fixed else '<'} 0.6.16 (flashinfer PR 3526)"
    return FlashInferFacts(version, fixed, how, _cannot_run())


def _cannot_run() -> str | None:
    jit_cache = _version("flashinfer-jit-cache")
    if jit_cache is not None and _release(jit_cache) >= JIT_CACHE_WITHOUT_SM75:
        return (
            f"flashinfer-jit-cache {jit_cache} ships no SM75 kernels (flashinfer PR 4757): "
            "uninstall it so that FlashInfer compiles them (needs nvcc)"
        )
    if jit_cache is None and nvcc() is None:
        return (
            "no flashinfer-jit-cache and no nvcc: FlashInfer cannot compile its SM75 kernels "
            "(install the CUDA toolkit or set FLASHINFER_NVCC)"
        )
    return None
