"""vLLM loads its general plugins on a presented SM75 CUDA device, then selects FLASHINFER.

Run with a vLLM source tree and a real FlashInfer on PYTHONPATH (the plugin's wheel too, or
not, for the stock case): ``python check_sm75_load.py OUT.json``. The environment is the
serving environment's (VFLEET_SM75, VLLM_USE_FLASHINFER_SAMPLER, FLASHINFER_NVCC).

What is presented, not real: vLLM's current platform is its own CudaPlatform class with the
device query answering compute capability 7.5 and a 2080 Ti's name (the smallest surface vLLM
reads the device from; this machine has no GPU), and the CUDA build's op library is an empty
stand-in module (selection calls no op). Everything else runs as on a host: vLLM's own plugin
loader calls the plugin, the plugin decides from that platform and the installed FlashInfer,
and vLLM's own ``get_attn_backend_cls`` accepts or refuses FLASHINFER (head size 256, fp16,
fp8 KV: Qwen3.x's full-attention layers as seed 002 runs them).
"""

from __future__ import annotations

import json
import sys
import types

import torch

sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
import vllm.platforms  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.config.attention import AttentionConfig  # noqa: E402
from vllm.platforms.cuda import CudaPlatform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402


class PresentedSM75(CudaPlatform):  # type: ignore[misc, valid-type]
    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
        return DeviceCapability(7, 5)

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "NVIDIA GeForce RTX 2080 Ti"


SELECTOR = AttentionSelectorConfig(
    head_size=256, dtype=torch.float16, kv_cache_dtype="fp8", block_size=None
)


def main() -> None:
    vllm.platforms.current_platform = PresentedSM75()
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.v1.attention.backends.flashinfer import FlashInferBackend

    result: dict[str, object] = {
        "hooked": bool(getattr(FlashInferBackend, "_vfleet_sm75_hooked", False)),
    }
    for configured in ("FLASHINFER", None):
        config = VllmConfig(attention_config=AttentionConfig(backend=configured))
        with set_current_vllm_config(config):
            try:
                chosen = PresentedSM75.get_attn_backend_cls(
                    AttentionBackendEnum[configured] if configured else None, SELECTOR
                )
                outcome = {"backend": chosen, "error": None}
            except ValueError as exc:
                outcome = {"backend": None, "error": str(exc)}
        result[configured or "auto"] = outcome
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
