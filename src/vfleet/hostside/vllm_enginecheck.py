"""Run a rendered vLLM config through the pinned vLLM's own engine code, GPU presented. Standalone.

Run it with the python of a virtualenv that has vLLM's dependencies (no GPU needed):

    VENV/bin/python vllm_enginecheck.py JOBS.json [--source-dir DIR --source-version X.Y.Z]

JOBS.json is a list of jobs: {"config": vllm.yaml, "model_dir": a folder with the model's
config.json, "env": {...}, "paths": [...], "device": {"name", "capability": [7, 5],
"memory_bytes", "count", "cuda"}}. For each job, in a forked child of one process that
imported vLLM once (importing it takes ~10 s):

1. the render's environment (VLLM_*, VFLEET_*) is set and `paths` (the stack's FlashInfer, the
   SM75 plugin's distribution) go first on sys.path;
2. the profile's GPU is presented to vLLM's platform layer: vLLM's own CUDA platform class with
   only get_device_capability / get_device_name / get_device_total_memory / device_count
   (and is_fully_connected, the device UUID) answered from the job, not from NVML/torch.cuda;
3. vLLM's general plugins are loaded as vLLM loads them (`load_general_plugins`);
4. vLLM's parser reads the config (vllm_argcheck.parse), `AsyncEngineArgs.create_engine_config`
   builds the VllmConfig (model, cache, parallel, scheduler, speculative and compilation
   configs, the platform's check_and_update_config, the model's verify_and_update_config);
5. the attention backend is selected by `vllm.v1.attention.selector.get_attn_backend` as an
   attention layer does (validate_configuration: compute capability, head size, dtype, KV-cache
   dtype, block size), then the platform's `update_block_size_for_backend` (the backend's block
   size; hybrid models: aligned with the Mamba page), and, with a speculative draft, the
   selection for the draft's config as the proposer derives it (`_create_draft_vllm_config`).

It prints one JSON object per job, one per line: {"config", "ok", "vllm", "stage", "error",
"facts": {...}, "patched": [...], "plugin_log": [...]}. Stdlib-only at import.

GPU-only extension modules (vllm._C and friends, absent from a CPU build and from an extracted
GPU wheel) are replaced by empty modules only when the import would otherwise fail; the result
names each one that was replaced in its process (jobs with the same device and paths share the
fork they start from, and what it imported: the first job's modules, imported once, cost the
others nothing; docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.abc
import importlib.machinery
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import types
from typing import Any

# What the presented GPU answers; set in each child before vLLM asks.
_DEVICE: dict[str, Any] = {}
# GPU-only extension modules replaced by empty ones (only those that failed to import).
_STUBBED: list[str] = []
_GPU_ONLY = re.compile(
    r"^vllm\.(_[A-Za-z0-9_]*C[A-Za-z0-9_]*|cumem_allocator|vllm_flash_attn\._\w+)$"
)


class _GpuOnlyStubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: reached only when no real module of that name exists."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if _GPU_ONLY.match(name):
            return importlib.machinery.ModuleSpec(name, self)
        return None

    def create_module(self, spec: Any) -> types.ModuleType:
        _STUBBED.append(spec.name)
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _present_version(version: str) -> None:
    # A source tree has no distribution metadata; give it the GPU wheel's name and version.
    meta = tempfile.mkdtemp(prefix="vfleet-enginecheck-")
    info = os.path.join(meta, f"vllm-{version}.dist-info")
    os.makedirs(info)
    with open(os.path.join(info, "METADATA"), "w", encoding="utf-8") as fh:
        fh.write(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    sys.path.insert(1, meta)


def _presented_platform() -> Any:
    """vLLM's own CUDA platform class, answering device facts from the job."""
    from vllm.platforms import cuda
    from vllm.platforms.interface import DeviceCapability

    # The non-NVML variant: on a machine with an NVIDIA driver, NVML would describe that GPU.
    class PresentedCudaPlatform(cuda.NonNvmlCudaPlatform):  # type: ignore[misc]
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> Any:
            major, minor = _DEVICE["capability"]
            return DeviceCapability(major=major, minor=minor)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return str(_DEVICE["name"])

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return int(_DEVICE["memory_bytes"])

        @classmethod
        def device_count(cls) -> int:
            return int(_DEVICE["count"])

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            # NVLink is a fact of the host, not of the profile; vLLM asks only when it starts
            # custom all-reduce, which this check does not reach.
            return False

        @classmethod
        def get_device_uuid(cls, device_id: int = 0) -> str:
            return f"GPU-vfleet-presented-{device_id}"

    return PresentedCudaPlatform()


def _inspect_in_process() -> None:
    """vLLM inspects model classes in a fresh `python -m ...registry` so that the parent never
    initialises CUDA; that process would have neither the presented GPU nor the source tree.
    Here there is no CUDA to protect: run the same inspection in this (forked) process."""
    from vllm.model_executor.models import registry

    def run_here(fn: Any) -> Any:
        return fn()

    registry._run_in_subprocess = run_here
    _STUBBED.append("vllm.model_executor.models.registry._run_in_subprocess (in-process)")


# CUTLASS capability queries that vLLM calls at import time (w8a8_utils). Their C++ (vLLM's
# csrc/quantization/w8a8/cutlass/scaled_mm_entry.cu) answers from the capability and the CUDA
# version the wheel was built with: (capability floor, CUDA floor) pairs, highest first; no
# pair, or a CUDA below the floor: False. The CUDA version is the stack's.
_KERNEL_QUERIES: dict[str, tuple[tuple[int, int], ...]] = {
    "cutlass_scaled_mm_supports_fp8": ((90, 12000), (89, 12040)),
    "cutlass_scaled_mm_supports_block_fp8": ((100, 12080), (90, 12000)),
    "cutlass_group_gemm_supported": ((100, 12080), (90, 12030)),
}
_LIBS: list[Any] = []


def _cuda_version() -> int:
    """The stack's CUDA as the C macro CUDA_VERSION writes it: 12.9 -> 12090, 13.0 -> 13000."""
    major, _, minor = str(_DEVICE.get("cuda") or "0.0").partition(".")
    return int(major) * 1000 + int(minor or 0) * 10


def _answer_kernel_queries() -> None:
    import torch

    lib = torch.library.Library("_C", "FRAGMENT")  # kept alive in _LIBS
    _LIBS.append(lib)
    for name, floors in _KERNEL_QUERIES.items():
        if hasattr(torch.ops._C, name):
            continue

        def answer(
            cuda_device_capability: int, _floors: tuple[tuple[int, int], ...] = floors
        ) -> bool:
            for capability, cuda in _floors:
                if cuda_device_capability >= capability:
                    return _cuda_version() >= cuda
            return False

        lib.define(f"{name}(int cuda_device_capability) -> bool")
        lib.impl(name, answer, "CompositeExplicitAutograd")
        _STUBBED.append(f"torch.ops._C.{name} (its C++ rule, the stack's CUDA)")


def _torchvision_schemas() -> None:
    """torchvision from PyPI is a CUDA build whose operator library cannot load on the CPU torch;
    its Python part (image transforms, imported by the multimodal Qwen models) still can, once
    the two operators it registers fake kernels for are declared. No kernel is provided."""
    import importlib.util

    import torch

    if importlib.util.find_spec("torchvision") is None:
        return
    lib = torch.library.Library("torchvision", "FRAGMENT")
    _LIBS.append(lib)
    for name in ("nms", "qnms"):
        try:
            getattr(torch.ops.torchvision, name)
        except (AttributeError, RuntimeError):
            lib.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _STUBBED.append(f"torchvision::{name} (schema only)")


def _stand_in_tokenizer() -> str:
    """The model's own tokenizer is not here (weights you provide): vLLM's engine config only
    tokenizes the reasoning markers, so the tiny models' byte-level BPE (which has Qwen's
    <think> and </think>) stands in for it."""
    from pathlib import Path

    tinymodels = importlib.import_module("tinymodels")  # beside this file; stdlib at import
    out = tempfile.mkdtemp(prefix="vfleet-tokenizer-")
    tinymodels._save_tokenizer(tinymodels._train_tokenizer(1024), Path(out), 4096)
    return out


def _first_attr(modules: tuple[str, ...], name: str) -> Any:
    # One implementation, in the parser check beside this file (both run in vLLM venvs).
    return importlib.import_module("vllm_argcheck")._first_attr(modules, name)


def _select_backend(vllm_config: Any, model_config: Any) -> Any:
    """The attention backend an attention layer of `model_config` gets, as vLLM selects it."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    with set_current_vllm_config(vllm_config):
        backend = get_attn_backend(
            head_size=model_config.get_head_size(),
            dtype=model_config.dtype,
            kv_cache_dtype=vllm_config.cache_config.cache_dtype,
            use_mla=bool(getattr(model_config, "use_mla", False)),
            num_heads=model_config.get_num_attention_heads(vllm_config.parallel_config),
        )
    return backend


def _align_block_size(vllm_config: Any, backend: Any) -> None:
    """vLLM's worker runs Platform.update_block_size_for_backend once the model's layers exist:
    the backend's preferred block size, then (hybrid models) the attention block size aligned
    with the Mamba page. No layers are built here, so the platform is told the backend that the
    selection above chose; the rest is vLLM's own code."""
    from vllm.platforms import current_platform

    platform = type(current_platform)
    if not hasattr(platform, "update_block_size_for_backend"):
        return
    for name, answer in (("_find_non_ssm_backend", backend), ("_find_non_ssm_backends", [backend])):
        if hasattr(platform, name):
            setattr(platform, name, classmethod(lambda cls, config, a=answer: a))
            _STUBBED.append(f"Platform.{name} (the selected backend; no layers are built)")
    current_platform.update_block_size_for_backend(vllm_config)


def _draft_config(vllm_config: Any) -> Any:
    """The VllmConfig the speculative proposer builds its draft layers under (its own code)."""
    proposer = _first_attr(
        ("vllm.v1.spec_decode.eagle", "vllm.v1.spec_decode.llm_base_proposer"), "EagleProposer"
    )
    derive = getattr(proposer, "_create_draft_vllm_config", None)
    if derive is None:  # older proposers build the draft under the target's config
        return vllm_config
    holder = types.SimpleNamespace(
        speculative_config=vllm_config.speculative_config, vllm_config=vllm_config
    )
    return derive(holder)


def _message(exc: Exception) -> str:
    """vLLM's message; pydantic's echo of every input value and its help link are left out."""
    lines = [f"{type(exc).__name__}: {exc}".splitlines()[0]]
    for line in str(exc).splitlines()[1:]:
        if "errors.pydantic.dev" in line:
            continue
        lines.append(re.sub(r"\s*\[type=.*$", "", line).strip())
    return " ".join(x for x in lines if x)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _facts(vllm_config: Any) -> dict[str, Any]:
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    comp = vllm_config.compilation_config
    spec = vllm_config.speculative_config
    return {
        "dtype": str(mc.dtype).replace("torch.", ""),
        "kv_cache_dtype": str(cc.cache_dtype),
        "block_size": cc.block_size,
        "mamba_cache_mode": str(getattr(cc, "mamba_cache_mode", "")),
        "cudagraph_mode": str(getattr(comp, "cudagraph_mode", "")),
        "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
        "distributed_executor_backend": str(
            vllm_config.parallel_config.distributed_executor_backend
        ),
        "speculative": None
        if spec is None
        else {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens},
        "quantization": mc.quantization,
    }


def run_job(job: dict[str, Any], parse: Any, tokenizer: str) -> dict[str, Any]:
    import vllm

    result: dict[str, Any] = {
        "ok": False,
        "vllm": getattr(vllm, "__version__", "?"),
        "stage": "parse",
        "error": None,
        "facts": {},
        "plugin_log": [],
    }
    start = time.monotonic()
    capture = _Capture()
    plugin_logger = logging.getLogger("vllm.vfleet_sm75")
    plugin_logger.addHandler(capture)
    plugin_logger.setLevel(logging.INFO)
    try:
        os.environ.update(job["env"])
        sys.path[:0] = job["paths"]
        importlib.invalidate_caches()
        _DEVICE.clear()
        _DEVICE.update(job["device"] or {})
        result["stage"] = "plugins"
        from vllm.plugins import load_general_plugins

        load_general_plugins()
        result["stage"] = "parse"
        parsed, ns = parse(job["config"])
        if ns is None:
            result["error"] = parsed["error"]
            return result
        # The model folder on the serving host is not here: its config.json is. Beside it go
        # the stand-in tokenizer's files, as a model folder holds both: vLLM 0.32 reads the
        # tokenizer folder's config.json too, and without one it retried after a 2 s sleep in
        # every job (repo_utils.with_retry), half of each job's time.
        if getattr(ns, "tokenizer", None) in (None, ns.model):
            for name in os.listdir(tokenizer):
                shutil.copy(os.path.join(tokenizer, name), job["model_dir"])
            ns.tokenizer = job["model_dir"]
        ns.model = job["model_dir"]
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext

        result["stage"] = "engine-config"
        engine_args = AsyncEngineArgs.from_cli_args(ns)
        vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        result["facts"] = _facts(vllm_config)
        result["stage"] = "attention-target"
        backend = _select_backend(vllm_config, vllm_config.model_config)
        result["facts"]["attention_backend"] = str(backend.get_name())
        result["stage"] = "block-size"
        _align_block_size(vllm_config, backend)
        result["facts"]["block_size"] = vllm_config.cache_config.block_size
        spec = vllm_config.speculative_config
        if spec is not None and getattr(spec, "draft_model_config", None) is not None:
            result["stage"] = "attention-draft"
            draft = _draft_config(vllm_config)
            result["facts"]["draft_attention_backend"] = str(
                _select_backend(draft, spec.draft_model_config).get_name()
            )
        result["stage"] = "done"
        result["ok"] = True
        result["seconds"] = round(time.monotonic() - start, 1)
    except Exception as exc:  # vLLM's refusal, reported with the stage it came from
        result["error"] = _message(exc)
    finally:
        result["plugin_log"] = capture.lines
        result["patched"] = sorted(set(_STUBBED))
    return result


def _fork(work: Any) -> tuple[int, int]:
    """Run `work()` (which returns text) in a child; (pid, read end of its output)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            text = work()
        except BaseException as exc:  # the parent must get an answer
            text = json.dumps({"ok": False, "stage": "crash", "error": repr(exc)}) + "\n"
        with os.fdopen(write, "w", encoding="utf-8") as fh:
            fh.write(text)
        os._exit(0)
    os.close(write)
    return pid, read


def _collect(pid: int, read: int) -> str:
    with os.fdopen(read, encoding="utf-8") as fh:
        text = fh.read()
    os.waitpid(pid, 0)
    return text


def _common_env(jobs: list[dict[str, Any]]) -> dict[str, str]:
    """The variables every job of a group sets to the same value. The rest (each job's cache,
    state and table paths under its own folder, the plugin's switch) only its own fork sees."""
    first = jobs[0]["env"]
    return {k: v for k, v in first.items() if all(j["env"].get(k) == v for j in jobs)}


def _warm(jobs: list[dict[str, Any]]) -> None:
    """Import what every job of this group imports anyway (their model classes, FlashInfer), under
    the group's device, paths and common environment, so that each job's fork starts warm."""
    first = jobs[0]
    os.environ.update(_common_env(jobs))
    sys.path[:0] = first["paths"]
    importlib.invalidate_caches()
    _DEVICE.clear()
    _DEVICE.update(first["device"] or {})
    from vllm.model_executor.models.registry import ModelRegistry

    for job in jobs:
        with open(os.path.join(job["model_dir"], "config.json"), encoding="utf-8") as fh:
            for arch in json.load(fh).get("architectures", []):
                with contextlib.suppress(Exception):  # the job itself reports it
                    ModelRegistry._try_load_model_cls(arch)


def _job_and_its_imports(job: dict[str, Any], parse: Any, tokenizer: str) -> str:
    """One job's result, and the modules it imported that its parent had not (a JSON line)."""
    before = set(sys.modules)
    item = run_job(job, parse, tokenizer)
    item["_imported"] = [name for name in sys.modules if name not in before]
    return json.dumps(item, default=str)


def _import_quietly(names: list[str]) -> None:
    """Import what a job imported, in its order, so that the next jobs' forks start with it:
    vLLM's argument parser, its reasoning parsers, the pydantic schemas of its configs, the
    plugin's modules (~1 s a job). A module that does not import here, out of its job (one
    that needs the job's own state), is left for the jobs to import themselves."""
    for name in names:
        if name in sys.modules:
            continue
        try:
            with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
                importlib.import_module(name)
        except (Exception, SystemExit):  # the job imports it itself
            continue


def _run_group(jobs: list[dict[str, Any]], parse: Any, tokenizer: str) -> str:
    """In a fork per group (same device and paths; the environment the jobs share): warm up,
    then a fork per job, which adds its own variables.
    The first job also says which modules it imported; they are imported here before the
    other jobs' forks (each job still runs in a fork of its own: nothing it does reaches the
    next)."""
    _warm(jobs)
    gc.freeze()
    lines: list[str] = []
    for n, job in enumerate(jobs):
        if n == 0:
            pid, read = _fork(lambda job=job: _job_and_its_imports(job, parse, tokenizer))
        else:
            pid, read = _fork(
                lambda job=job: json.dumps(run_job(job, parse, tokenizer), default=str)
            )
        text = _collect(pid, read)
        item: dict[str, Any] = json.loads(text) if text.strip() else {"ok": False, "stage": "crash"}
        if n == 0:
            _import_quietly([str(name) for name in item.pop("_imported", [])])
            # The forks then share these objects' pages: the collector does not walk them
            # (and write to them) in every job.
            gc.freeze()
        item.setdefault("error", "check process died")
        item["config"] = job["config"]
        lines.append(json.dumps(item, sort_keys=True, default=str))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("jobs", help="JSON file: a list of jobs")
    ap.add_argument("--source-dir", help="put this vLLM source tree first on sys.path")
    ap.add_argument("--source-version", help="the version of --source-dir")
    ap.add_argument("--path", action="append", default=[], help="also put DIR on sys.path")
    ap.add_argument(
        "--no-gpu", action="store_true", help="CPU profiles: vLLM detects its platform itself"
    )
    args = ap.parse_args(argv)
    with open(args.jobs, encoding="utf-8") as fh:
        jobs = json.load(fh)
    if args.source_dir:
        sys.path.insert(0, args.source_dir)
        _present_version(args.source_version or "0.0.0")
    sys.path[1:1] = args.path
    _torchvision_schemas()  # before transformers looks for torchvision
    sys.meta_path.append(_GpuOnlyStubs())
    parse = importlib.import_module("vllm_argcheck").parse  # beside this file

    import vllm.platforms

    if not args.no_gpu:
        vllm.platforms._current_platform = _presented_platform()
    _inspect_in_process()
    if not args.no_gpu:
        _answer_kernel_queries()
    # Imported once here so that each fork starts warm.
    import vllm.engine.arg_utils
    import vllm.v1.attention.selector

    tokenizer = _stand_in_tokenizer()

    # A group shares a fork that imported what its jobs import: the same presented device and
    # sys.path. Their environments differ (each job's own folders); see _common_env.
    groups: dict[str, list[dict[str, Any]]] = {}
    for job in jobs:
        key = json.dumps([job["device"], job["paths"]], sort_keys=True)
        groups.setdefault(key, []).append(job)
    all_ok = True
    try:
        for group in groups.values():
            pid, read = _fork(lambda group=group: _run_group(group, parse, tokenizer))
            for line in _collect(pid, read).splitlines():
                all_ok = all_ok and bool(json.loads(line).get("ok"))
                print(line, flush=True)
    finally:
        shutil.rmtree(tokenizer, ignore_errors=True)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
