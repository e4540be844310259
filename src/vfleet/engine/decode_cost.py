"""What one decode step reads from GPU memory, and what one more MTP depth adds to it.

At batch 1 a decode step of these models is bound by reading memory: every weight the target
runs, the GDN layers' recurrent state (read and written), and per speculative token one draft
call (the MTP module and the LM head rows it scores) plus the verify's extra SSM state. At the
card's bandwidth those bytes give the step's floor. What a measured step takes beyond its floor
(kernel launches, the host between graph pieces, small GEMVs below bandwidth) is spread over
the layers the step runs, so that one measured depth gives every other depth's step time: the
sidecar and `vfleet tune` use this where no step-time table was measured (docs/TUNE.md, "The
cost model").

Counted per GPU (TP rank):
- weights: the planner's weight parts (vfleet.engine.gpu_memory.weight_bytes) / TP, less the
  embedding (a decode step gathers one row of it) and the MTP module (only the draft runs it);
  the LM head stays in (the target scores every step);
- state: 2 x GDN layers x (SSM + conv state) of one sequence: read, then written back;
- per depth: one MTP layer / TP (a draft call runs one), the LM head rows it scores (vLLM's
  padded shard, or the SM75 plugin's pruned share where draft-prune is on), and one more SSM
  state per GDN layer (vLLM's speculative GDN kernel keeps the state of every verified
  token: "keep the states for multi-query tokens", fla/ops/fused_sigmoid_gating.py in 0.21.0
  and 0.24.0, third_party/flash_linear_attention/ops/ in 0.27.1).

Not counted: attention's KV reads (they grow with the context: the model is for short
contexts), the vision tower (prefill only), activations, all-reduce time at TP > 1.

Pure arithmetic on the engine's inputs: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vfleet.engine.draft_prune import BYTES_PER_VALUE, Bandwidth, card_bandwidth, rows_full
from vfleet.engine.gpu_memory import weight_bytes
from vfleet.engine.planner import Deployment, cuda_graphs, gdn_ssm_conv_bytes, inputs_from

GB = 1e9


@dataclass(frozen=True)
class DecodeCost:
    """Bytes per GPU of one batch-1 decode step, by what reads them (module docstring)."""

    tp: int
    weights_bytes: int  # the target's weights a step reads (no embedding, no MTP module)
    state_bytes: int  # GDN state read and written, one sequence
    mtp_bytes: int  # per draft call: the MTP module
    head_rows: int  # per draft call: LM head rows scored
    head_bytes: int
    verify_state_bytes: int  # per depth: one more SSM state per GDN layer in the verify
    target_layers: int
    draft_layers: int  # layers one draft call runs: one MTP layer
    graph_mode: str  # the rendered CUDA graph mode (NONE, PIECEWISE, FULL_AND_PIECEWISE, ...)
    bandwidth: Bandwidth | None  # None: no figure for this card; floors unknown

    @property
    def per_depth_bytes(self) -> int:
        return self.mtp_bytes + self.head_bytes + self.verify_state_bytes

    def step_bytes(self, depth: int) -> int:
        """Bytes one decode step reads at MTP depth `depth` (0: no speculative decoding)."""
        return self.weights_bytes + self.state_bytes + depth * self.per_depth_bytes

    def floor_s(self, depth: int) -> float | None:
        """The step's floor at the card's bandwidth, seconds; None without a figure."""
        if self.bandwidth is None:
            return None
        return self.step_bytes(depth) / (self.bandwidth.gbs * GB)

    def layers(self, depth: int) -> int:
        return self.target_layers + depth * self.draft_layers

    def summary(self, depth: int, unit: str = "GPU") -> str:
        """One line for `vfleet plan` (unit: GPU, or CPU worker on the CPU profile)."""
        line = (
            f"{self.step_bytes(0) / GB:.2f} GB a step per {unit} (weights "
            f"{self.weights_bytes / GB:.2f}, GDN state {self.state_bytes / GB:.3f})"
        )
        if self.draft_layers:
            line += (
                f", +{self.per_depth_bytes / GB:.3f} GB per MTP depth (module "
                f"{self.mtp_bytes / GB:.3f}, head {self.head_rows:,} rows "
                f"{self.head_bytes / GB:.3f}, verify state {self.verify_state_bytes / GB:.3f})"
            )
        floor = self.floor_s(depth)
        if floor is not None and self.bandwidth is not None:
            line += (
                f"; floor at MTP {depth}: {floor * 1e3:.2f} ms at "
                f"{self.bandwidth.gbs:,.0f} GB/s ({self.bandwidth.source})"
            )
        else:
            line += "; no memory-bandwidth figure: set accelerator.memory_bandwidth_gbs"
        return line

    def sidecar(self) -> dict[str, Any] | None:
        """The figures the sidecar models depths from (sidecar.json `decode_cost`); None
        without a bandwidth figure (nothing to model from)."""
        if self.bandwidth is None:
            return None
        return {
            "base_bytes": self.step_bytes(0),
            "per_depth_bytes": self.per_depth_bytes if self.draft_layers else 0,
            "target_layers": self.target_layers,
            "draft_layers": self.draft_layers,
            "bandwidth_gbs": self.bandwidth.gbs,
            "graph_mode": self.graph_mode,
        }


def decode_cost(launch: Deployment) -> DecodeCost:
    """The decode step's bytes for a resolved deployment."""
    profile, arch, d = launch.profile, launch.model.arch, launch.decisions
    args = launch.config_values()
    tp = d.tp
    parts = weight_bytes(arch, launch.model.quantization, profile.accelerator.sm)
    target = sum(v // tp for k, v in parts.items() if k not in ("embedding", "mtp"))
    gdn = arch.num_hidden_layers - arch.full_attention_layers if arch.hybrid else 0
    ssm = conv = 0
    if gdn:
        x = inputs_from(profile, arch, d, args, 0, launch.stack.vllm)
        ssm, conv = gdn_ssm_conv_bytes(x)
    mtp = d.spec_method == "mtp" and arch.mtp_layers > 0
    head_rows = 0
    if mtp:
        head_rows = d.draft_prune.rows if d.draft_prune else rows_full(arch.vocab_size, tp)
    return DecodeCost(
        tp=tp,
        weights_bytes=target,
        state_bytes=2 * gdn * (ssm + conv),
        # vLLM runs one MTP layer per draft call (qwen3_5_mtp.py: layers[spec_step_idx %
        # num_mtp_layers]); every preset has one
        mtp_bytes=parts.get("mtp", 0) // tp // arch.mtp_layers if mtp else 0,
        head_rows=head_rows,
        head_bytes=head_rows * arch.hidden_size * BYTES_PER_VALUE,  # 16-bit in every checkpoint
        verify_state_bytes=gdn * ssm if mtp else 0,
        target_layers=arch.num_hidden_layers,
        draft_layers=1 if mtp else 0,
        graph_mode=cuda_graphs(args, d.max_num_seqs)[0]
        if profile.accelerator.kind != "cpu"
        else "NONE",
        bandwidth=card_bandwidth(
            profile.accelerator.gpu_model, profile.accelerator.memory_bandwidth_gbs
        ),
    )
