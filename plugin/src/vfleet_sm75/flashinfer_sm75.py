"""Feature flashinfer-sm75 inside vLLM: accept FLASHINFER attention on compute capability 7.5.

vLLM 0.24+ raised FlashInferBackend's floor to SM80 because FlashInfer's paged prefill failed on
SM75 (flashinfer issue 3620; vLLM cites PR 3621, the fix shipped is PR 3526, in FlashInfer
0.6.16: flashinfer_fix.py). With a FlashInfer that carries the fix (checked
by decide.py before this is installed), the wrapper answers yes for (7, 5) only while the
configured attention backend is FLASHINFER, so auto-selection on SM75 is unchanged: a profile
that does not ask for FLASHINFER keeps getting TRITON_ATTN, exactly as without the plugin.
"""

from __future__ import annotations

from typing import Any


def flashinfer_configured() -> bool:
    """The vLLM config being built or run names FLASHINFER as its attention backend."""
    from vllm.config.vllm import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    backend = getattr(getattr(config, "attention_config", None), "backend", None)
    return getattr(backend, "name", None) == "FLASHINFER"


def install() -> None:
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend as B

    if getattr(B, "_vfleet_sm75_hooked", False):
        return
    original = B.supports_compute_capability.__func__

    def supports_compute_capability(cls: Any, capability: Any) -> bool:
        if (capability.major, capability.minor) == (7, 5) and flashinfer_configured():
            return True
        return bool(original(cls, capability))

    B.supports_compute_capability = classmethod(supports_compute_capability)
    B._vfleet_sm75_hooked = True
