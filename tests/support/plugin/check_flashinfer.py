"""Ask the pinned vLLM's own backend selection if FLASHINFER is valid on compute capability 7.5.

Run with a vLLM virtualenv's python and a real FlashInfer on the path:
``python check_flashinfer.py OUT.json``. Asks stock vLLM first, then installs the plugin's
flashinfer-sm75 hook and asks again (the hook's on/off decision needs an SM75 device, which this
machine does not have; decide.py's gating is tested on its own). No device is faked: vLLM's
selection functions take the capability as an argument. Writes the invalid reasons and the
auto-selection candidates of each case.
"""

from __future__ import annotations

import json
import sys
import types

import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.config.attention import AttentionConfig

# vllm.platforms.cuda imports the CUDA build's compiled op library, which a CPU build lacks.
# A stand-in module (the only thing not real here) lets the CUDA platform's selection code load;
# it registers no ops, and selection calls none.
sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
from vllm.platforms.cuda import CudaPlatform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.flashinfer import FlashInferBackend  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

# Qwen3.x full-attention layers: head size 256, fp16 on SM75, fp8 KV (what the profile asks).
SELECTOR = AttentionSelectorConfig(
    head_size=256, dtype=torch.float16, kv_cache_dtype="fp8", block_size=16
)


def case(capability: tuple[int, int], configured: str | None) -> dict[str, object]:
    cap = DeviceCapability(*capability)
    config = VllmConfig(attention_config=AttentionConfig(backend=configured))
    with set_current_vllm_config(config):
        reasons = FlashInferBackend.validate_configuration(
            device_capability=cap, **SELECTOR._asdict()
        )
        valid, _ = CudaPlatform.get_valid_backends(cap, SELECTOR)
    return {
        "capability": list(capability),
        "configured": configured,
        "invalid_reasons": reasons,
        "auto_candidates": [c.backend.name for c in valid],
    }


def main() -> None:
    from vfleet_sm75 import flashinfer_sm75

    assert AttentionBackendEnum.FLASHINFER.get_class() is FlashInferBackend
    result = {}
    for hook in ("stock", "hook"):
        if hook == "hook":
            flashinfer_sm75.install()
        result[hook] = [case(c, b) for c in ((7, 5), (8, 0)) for b in ("FLASHINFER", None)]
    with open(sys.argv[1], "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
