"""GPU memory per rank, term by term as vLLM's own start-up measures it.

vLLM (0.21.0, 0.24.0 and 0.27.1 alike: v1/worker/gpu_worker.py determine_available_memory)
asks for `requested = ceil(total * gpu_memory_utilization)` of the card as torch reports it
(MemorySnapshot: cudaMemGetInfo), taken after the CUDA context and NCCL exist, and logs
`Available KV cache memory = requested - weight - peak activation - non-torch memory -
Estimated CUDA graph memory`. Each term below has that name, a value, an uncertainty (+/-), where
it lives ("profiled": inside the request, measured by vLLM at start-up; "outside": what the rest
of the card must hold, which vLLM never checks) and how it is known. With
`--kv-cache-memory-bytes` vLLM skips the measurement (it still runs the profile to compile),
so every term must then fit by prediction alone. docs/PLANNER.md lists the terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from vfleet.config.schema import HardwareProfile, ModelArch, ModelPreset, Quantization
from vfleet.hostside.tinymodels import hybrid_moe

GIB = 1 << 30
MIB = 1 << 20

Where = Literal["profiled", "outside"]
Known = Literal["vLLM source", "measured", "seed log", "public logs", "fitted", "unverified"]


@dataclass(frozen=True)
class Term:
    name: str  # as vLLM logs it, where it logs it
    bytes: int
    uncertainty: int  # +/- bytes
    where: Where
    known: Known
    source: str  # the vLLM file/function, seed or public log it comes from
    formula: str  # how the value was computed, with the numbers
    # A profiled term that is not resident while serving text (the vision encoder's profile):
    # its share of the request is free again for what vLLM allocates after the profile.
    resident: bool = True


@dataclass(frozen=True)
class CardMemory:
    total_bytes: int  # torch.cuda.mem_get_info()[1]: what vLLM multiplies by the utilisation
    uncertainty: int
    known: Known
    source: str
    # The CUDA context with torch initialised (taken before vLLM's start-up snapshot).
    context_bytes: int = 384 * MIB
    context_uncertainty: int = 128 * MIB
    context_known: Known = "unverified"


# The card's memory as torch reports it, by (gpu_model, nominal GiB; 0: any size). It is
# nvidia-smi's memory.total less memory.reserved (the driver's share): on an H200 (driver
# 580.159.04, 2026-12-01) 143,771 - 616 = 143,155 MiB, and cuMemGetInfo / torch said
# 150,109,880,320 B = 143,155.9 MiB. nvidia-smi's memory.used excludes the reserved share.
CARDS: dict[tuple[str, float], CardMemory] = {
    ("NVIDIA GeForce RTX 2080 Ti", 22): CardMemory(
        round(21.48 * GIB),
        5 * MIB,  # printed to 0.01 GiB
        "seed log",
        "seeds/004: torch.cuda.get_device_properties: VRAM=21.48 GiB on each of four cards; "
        "seeds/002's nvidia-smi (22,528 MiB, 21,720 used + ~280 free) agrees",
    ),
    ("NVIDIA A100 32GB (DRIVE-PG199-PROD)", 32): CardMemory(
        32_256 * MIB,
        256 * MIB,
        "unverified",
        "32,768 MiB less the ~1.5% the driver keeps on an A100 40 GB (torch: 39.39 GiB); "
        "no log of this part reports torch's figure",
    ),
    ("NVIDIA H200", 0): CardMemory(
        150_109_880_320,
        0,
        "measured",
        "measured: torch.cuda.mem_get_info on an H200, driver 580.159.04 (2026-12-01)",
        context_bytes=527 * MIB,
        context_uncertainty=16 * MIB,
        context_known="measured",
    ),
}
# Unknown cards: the nominal size less the 2.4% a 22 GB 2080 Ti loses, +/- 1.5%.
UNKNOWN_CARD_KEPT = 0.024


def card_memory(profile: HardwareProfile) -> CardMemory:
    acc = profile.accelerator
    nominal = float(acc.vram_gib or 0)
    cal = profile.calibration
    known = CARDS.get((acc.gpu_model or "", nominal)) or CARDS.get((acc.gpu_model or "", 0))
    if cal is not None and cal.torch_total_mib:
        # The profile's total replaces the card's; the CUDA context is a fact of the card (and
        # driver), so a known card's figure stays rather than falling back to the default.
        context = known or CardMemory(0, 0, "unverified", "")
        return CardMemory(
            int(cal.torch_total_mib * MIB),
            0,
            "seed log" if cal.torch_total_source.startswith("seeds/") else "unverified",
            f"profile calibration.torch_total_mib ({cal.torch_total_source or 'operator'})",
            context.context_bytes,
            context.context_uncertainty,
            context.context_known,
        )
    if known is not None:
        return known
    total = int(nominal * GIB * (1 - UNKNOWN_CARD_KEPT))
    return CardMemory(
        total,
        int(nominal * GIB * 0.015),
        "unverified",
        f"no entry for {acc.gpu_model!r} {nominal:g} GiB: nominal less {UNKNOWN_CARD_KEPT:.1%}; "
        "set calibration.torch_total_mib (nvidia-smi memory.total - memory.reserved)",
    )


# =========================================================================== weights


def param_counts(arch: ModelArch) -> dict[str, int]:
    """Parameter counts by part (text model), from the architecture facts."""
    h, inter = arch.hidden_size, arch.intermediate_size or 4 * arch.hidden_size
    q_out = arch.num_attention_heads * arch.head_dim * (2 if arch.hybrid else 1)  # gated q
    kv_out = 2 * arch.num_key_value_heads * arch.head_dim
    attn = h * (q_out + kv_out) + arch.num_attention_heads * arch.head_dim * h
    mlp = 3 * h * inter * (1 if arch.num_experts is None else arch.num_experts)
    nk, nv = arch.linear_num_key_heads or 0, arch.linear_num_value_heads or 0
    dk, dv = arch.linear_key_head_dim or 0, arch.linear_value_head_dim or 0
    gdn_in_big = h * (2 * nk * dk + 2 * nv * dv)  # in_proj_qkvz
    gdn_in_small = h * 2 * nv  # in_proj_ba
    gdn_out = nv * dv * h
    n_full = arch.full_attention_layers
    n_gdn = arch.num_hidden_layers - n_full
    return {
        "attention": n_full * attn,
        "gdn_in_proj_qkvz": n_gdn * gdn_in_big,
        "gdn_small": n_gdn
        * (gdn_in_small + (2 * nk * dk + nv * dv) * (arch.linear_conv_kernel_dim or 0)),
        "gdn_out_proj": n_gdn * gdn_out,
        "mlp": arch.num_hidden_layers * mlp,
        "embedding": arch.vocab_size * h,
        "lm_head": arch.vocab_size * h,
        "mtp": arch.mtp_layers * (attn + mlp + 2 * h * h),
    }


def quant_bytes(method: str, sm: tuple[int, int] | None) -> float:
    """Bytes per parameter of a quantised linear weight once vLLM has loaded it, scales
    included. AWQ int4 g128 runs as Marlin (int4 + fp16 scale + 4-bit zero per 128), except on
    SM 9.0, where vLLM 0.24.0 and 0.27.1 pick Machete first (kernels/linear/__init__.py
    _POSSIBLE_KERNELS: CutlassW4A8 needs fp8 activations, Machete only runs at capability 9.0;
    the H200 lane logged "Using MacheteLinearKernel for AutoAWQMarlinLinearMethod"), and
    Machete stores the zero points pre-scaled in the activation dtype
    (kernels/linear/mixed_precision/machete.py transform_w_zp: -scales x zeros), 2 B per group
    entry like the scales. FP8 block 128x128 below SM89 (no fp8 tensor cores) runs as Marlin
    too, which turns the fp32 block scales into fp16 group scales per 128 inputs and output
    channel (quantization/utils/marlin_utils_fp8.py prepare_fp8_layer_for_marlin); from SM89
    the block scales stay (one fp32 per 128x128), as in the checkpoint (sm None: the bytes on
    disk)."""
    if method == "awq":
        return 0.5 + (2 + (2 if sm == (9, 0) else 0.5)) / 128
    if method == "fp8":
        return 1.0 + (2 / 128 if sm is not None and sm < (8, 9) else 4 / (128 * 128))
    return 2.0


def weight_bytes(
    arch: ModelArch, q: Quantization, sm: tuple[int, int] | None = None
) -> dict[str, int]:
    """Weight bytes by part. What stays 16-bit in the quantised checkpoints: embeddings,
    lm_head, the MTP module and the small GDN projections (seed 001 lists them); the large
    linear layers (attention, GDN in/out, MLP) are quantised."""
    counts = param_counts(arch)
    qb = quant_bytes(q.method, sm)
    quantised = ("attention", "gdn_in_proj_qkvz", "gdn_out_proj", "mlp")
    return {k: int(v * (qb if k in quantised else 2)) for k, v in counts.items()}


# =========================================================================== inputs


@dataclass(frozen=True)
class MemInputs:
    """What the terms depend on, read from the rendered arguments."""

    tp: int
    max_num_seqs: int
    batched_tokens: int  # max_num_batched_tokens: the profile run's dummy batch
    batched_default: bool  # vLLM's default (not rendered)
    cudagraph_mode: str  # NONE, PIECEWISE, FULL, FULL_AND_PIECEWISE, ...
    capture_sizes: tuple[int, ...]
    backend: str
    custom_all_reduce: bool
    vision_loaded: bool  # the vision tower's weights are on the GPU
    mm_profiled: bool  # vLLM runs the vision encoder in its profile (no --skip-mm-profiling)
    vllm: str
    # The MTP module's weights are loaded only by the MTP drafter: with speculative decoding off
    # (or another method) "Model loading took" leaves them out (H200 lane, mid-hybrid-mtp:
    # 3.71 GiB without MTP, 4.15 GiB with it; docs/GPU.md).
    mtp_loaded: bool = True
    # LM head rows the SM75 plugin's draft-prune copies per rank at load (0: off). vLLM counts
    # them in "Model loading took": H200 lane, qwen3.8-27b-awq-mtp, 18.53 GiB with draft-prune
    # on against 17.91 off, +0.62 GiB = 65,536 x 5,120 x 2 B (docs/GPU.md section 9).
    draft_prune_rows: int = 0


def default_batched_tokens(card: CardMemory, gpu_model: str) -> int:
    """vLLM's default max_num_batched_tokens for the API server (engine/arg_utils.py
    get_batch_defaults, the same in 0.21.0, 0.24.0 and 0.27.1): 8192 on cards of >= 70 GiB
    that are not A100s, 2048 otherwise."""
    big = card.total_bytes >= 70 * GIB and "a100" not in gpu_model.lower()
    return 8192 if big else 2048


def _version(v: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in v.split(".")[:2])
    except ValueError:
        return (0, 0)


# =========================================================================== terms

# The fla chunked GDN prefill (model_executor/layers/fla/ops/chunk.py
# chunk_gated_delta_rule_fwd), per token and value head, fp16 with K = V = 128 and 64-token
# chunks: q and k (one key head per 3 value heads: 171), v 256, g 4, the solved A 128, w 256,
# u 256, the chunk states h (128 x 128 x 2 / 64 = 512), v_new 256, o 256.
GDN_PREFILL_BYTES_PER_TOKEN_HEAD = 2_100
# Per-rank sampler buffers per sequence and vocabulary entry during the profile's sampler
# run (gpu_model_runner.py _dummy_sampler_run): fp16 logits 2, fp32 logits 4, top-k/top-p
# sort values and int64 indices 12, probabilities 4, the rejection sampler's fp32 logits for
# 2 rows per sequence 8, fp32 draft probabilities 4.
SAMPLER_BYTES_PER_SEQ_VOCAB = 34
# The activation peak's part that does not grow with max_num_batched_tokens: 98 MiB, the
# intercept of the H200 lane's tiny-hybrid-mtp runs at 2,048 and 8,192 batched tokens (0.11 and
# 0.16 GiB logged, less the per-token part below: F in 91.5..101.8 and 94.6..104.9 MiB). Of it,
# torch's cuBLAS workspace is 32 MiB on SM90 (at::cuda CublasHandlePool, allocated through the
# caching allocator at the first GEMM of the profile run); the rest is not attributed. One
# constant for every configuration, measured on SM90 only.
PEAK_FIXED = 98 * MIB
# Triton's autotuner benchmarks with a 256 MiB L2-flush buffer (triton/backends/nvidia/driver.py
# get_empty_cache_for_benchmark). vLLM caches autotuning results on disk (env_override.py:
# TRITON_CACHE_AUTOTUNING=1), so only a start on a cold Triton cache autotunes inside the
# profile run (the GDN prefill kernels' warmup): H200 lane, fp16 on a fresh cache 0.31 GiB vs
# 0.16 warm, and main 128.00 vs main-restart 128.21 GiB of KV. Counted as uncertainty.
TRITON_BENCH_FLUSH = 256 * MIB
# The vision encoder's profile: its token budget, patches per token (2 x 2 merge) and the
# tower's widths (Qwen3.5 / Qwen3-VL family: hidden 1152, MLP 4304).
VISION_BUDGET_TOKENS, VISION_PATCHES_PER_TOKEN = 16384, 4
VISION_HIDDEN, VISION_MLP = 1152, 4304
FLASHINFER_WORKSPACE = 394 * MIB  # envs.py VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE (default)
CUSTOM_ALL_REDUCE = 24 * MIB  # custom_all_reduce.py: 8 MiB meta + 8 MiB buffer + 8 MiB rank_data
# CUDA graph estimate (gpu_model_runner.py profile_cudagraph_memory): the first capture of a
# mode plus (captures - 1) x the second capture's cost, at least 1 MiB each. Fitted to three
# public logs of Qwen3.6-27B (FlashInfer, MTP, PIECEWISE) on RTX 3090s:
# noonghunna/club-3090 #104 (TP 2, PIECEWISE=5, largest 16: 0.13 GiB), #44 (TP 4, 7 sizes,
# largest 32: 0.17 GiB), #127 (TP 4, 5 sizes, largest 16: 0.17 GiB): first = 88 + 20 x TP MiB,
# 1 MiB per further size (vLLM's floor).
GRAPH_FIRST_BASE, GRAPH_FIRST_PER_TP, GRAPH_PER_SIZE = 88 * MIB, 20 * MIB, 1 * MIB
# The FULL mode's first capture is profiled at long sequences (profile_cudagraph_memory:
# profile_seq_lens = min(max_model_len, max_num_tokens // num_tokens), in 0.21.0, 0.24.0 and
# 0.27.1), and vLLM takes the largest first capture of the modes. With FlashInfer's
# single-token decode graphs (no speculative decoding) the H200 lane logged 0.44 GiB for
# FULL_AND_PIECEWISE against 0.09 PIECEWISE, three sizes each (qwen3.6-27b-awq-int4, TP 1, 8192
# batched tokens, vLLM 0.24.0; docs/GPU.md section 11): a first capture of ~446 MiB. One
# shape measured: the +/- is half of it.
GRAPH_FULL_FIRST_FLASHINFER = 446 * MIB


@dataclass(frozen=True)
class ActivationPeak:
    """vLLM's "torch peak memory increase" of the profile run, term by term (per rank)."""

    widths: dict[str, int]  # elements per token live at each layer kind's widest point
    widest: str  # the layer kind that sets the forward peak
    forward: int  # max_num_batched_tokens x 2 B x widths[widest]
    moe_workspace: int  # the fused-MoE workspace, allocated in the profile run and kept
    sampler: int  # the sampler run's buffers (after the forward; only the larger phase counts)
    fixed: int
    value: int
    uncertainty: int
    formula: str


def activation_peak(arch: ModelArch, m: MemInputs) -> ActivationPeak:
    """The profile run's torch peak above the weights (vLLM 0.24.0, 16-bit activations).

    Where each part comes from (vLLM 0.24.0 source unless said):

    - The dummy forward (v1/worker/gpu_model_runner.py _dummy_run with max_num_batched_tokens
      T, is_profile=True): no attention metadata, so attention and the GDN core return early
      (qwen_gdn_linear_attn.py _forward_core warms the prefill kernels on 64 tokens only). The
      model is torch.compile'd in pieces split at the attention ops (config/compilation.py
      _attention_ops), and each layer's tensors are dead before the next layer's widest point,
      so the peak is the widest layer kind plus the residual stream. Per token, counting every
      tensor a layer kind allocates up to its split point, with the residual, the layer's
      input (normed) and its output buffer (3 x hidden). Inductor frees a buffer after its
      last use, so this is an upper bound of what one layer holds at once; the H200 figures
      sit at it (mid-hybrid-mtp 4.5% above even this count), so nothing is taken off:
      - GDN, Qwen3-Next layout (qwen3_next.py: gqa_interleaved_layout=True; forward_cuda,
        fix_query_key_value_ordering): in_proj_qkvz (2 nk dk + 2 nv dv)/TP and in_proj_ba
        2 nv/TP, contiguous copies of q, k, v (2 nk dk + nv dv)/TP and their torch.cat as
        many, z nv dv/TP, b and a 2 nv/TP, core_attn_out (torch.zeros) nv dv/TP;
      - GDN, Qwen3.5 layout (qwen3_5.py: gqa_interleaved_layout=False): q/k/v and z are views
        of in_proj_qkvz: the projections, b and a, and core_attn_out;
      - full attention (qwen3_next.py Qwen3NextAttention): qkv_proj (gated q: 2 nq hd + 2 nkv
        hd)/TP, q, gate and k out of fused_qk_rmsnorm_rope_gate, the attention output nq hd/TP;
      - dense MLP (Qwen3NextMLP): gate_up 2 I/TP and silu-and-mul I/TP;
      - MoE (Qwen3NextSparseMoeBlock, at T > VLLM_SHARED_EXPERTS_STREAM_TOKEN_THRESHOLD the
        shared expert runs on the main stream): the shared expert's gate_up, activation and
        output, the routed output (runner/moe_runner.py); plus the TritonExperts workspace
        (experts/triton_moe.py workspace_shapes: T x top-k x (max(I_e/TP, hidden) +
        max(2 I_e/TP, hidden)); modular_kernel.py _allocate_buffers takes it from
        v1/worker/workspace.py WorkspaceManager, which keeps it: it is live at every later
        layer's peak). MoE shapes of the generated models: hostside/tinymodels.py hybrid_moe.
    - The MTP drafter's dummy run (one attention layer + the MLP, with the target's hidden
      states held) is narrower than the widest target layer for these shapes: not counted.
    - _dummy_sampler_run: logits for max_num_seqs rows and the sampler's buffers
      (SAMPLER_BYTES_PER_SEQ_VOCAB), after the forward, with the final hidden states (T x
      hidden) and the MoE workspace still held; the larger of the two phases counts.
    - PEAK_FIXED: what does not grow with T (measured, see the constant).

    Checked against vLLM's DEBUG log on an H200 (docs/GPU.md 2 and 2b): tiny-hybrid-mtp at
    2,048 and 8,192 tokens 114 / 162 MiB vs 0.11 / 0.16 GiB logged; mid-hybrid-mtp at 8,192
    1,124 MiB vs 1.15 GiB (-4.5%), with and without MTP. Not measured: a dense MLP's width
    (the 27B presets) and the fixed part off SM90.
    """
    tp, h, t = m.tp, arch.hidden_size, m.batched_tokens
    act = 2  # bf16/fp16 activations (every preset); 0.24.0 profiles in the model dtype
    base = 3 * h  # residual, the layer's input and its output buffer
    nq, hd = arch.num_attention_heads // tp, arch.head_dim
    nkv = max(1, arch.num_key_value_heads // tp)
    gated = arch.hybrid  # Qwen3-Next / Qwen3.5 attention has an output gate
    widths = {
        "attention": base
        + (nq * (2 if gated else 1) + 2 * nkv) * hd
        + nq * hd * (2 if gated else 1)
        + nkv * hd
        + nq * hd
    }
    if arch.hybrid:
        nk, nv = (arch.linear_num_key_heads or 0) // tp, (arch.linear_num_value_heads or 0) // tp
        dk, dv = arch.linear_key_head_dim or 0, arch.linear_value_head_dim or 0
        qkvz, qkv, vdim = 2 * nk * dk + 2 * nv * dv, 2 * nk * dk + nv * dv, nv * dv
        gdn = base + qkvz + 2 * nv + 2 * nv + vdim
        if arch.model_type == "qwen3_next":
            gdn += 2 * qkv + vdim  # q/k/v copies, their cat, the z copy
        widths["GDN"] = gdn
    workspace = 0
    if arch.num_experts:
        moe = hybrid_moe(arch.model_dump())
        ie = int(moe["moe_intermediate_size"]) // tp
        shared = int(moe["shared_expert_intermediate_size"]) // tp
        topk = int(moe["num_experts_per_tok"])
        widths["MoE"] = base + 3 * shared + 2 * h + arch.num_experts
        workspace = t * topk * (max(ie, h) + max(2 * ie, h)) * act
    else:
        inter = (arch.intermediate_size or 4 * h) // tp
        widths["MLP"] = base + 3 * inter
    widest = max(widths, key=lambda k: widths[k])
    forward = t * act * widths[widest]
    sampler = m.max_num_seqs * arch.vocab_size * SAMPLER_BYTES_PER_SEQ_VOCAB
    value = PEAK_FIXED + workspace + max(forward, t * act * h + sampler)
    unc = forward // 10 + PEAK_FIXED // 2 + TRITON_BENCH_FLUSH
    batch = f"{t} tokens{' (vLLM default)' if m.batched_default else ''}"
    parts = ", ".join(f"{k} {v}" for k, v in widths.items())
    formula = (
        f"{PEAK_FIXED // MIB} MiB fixed + {batch} x 2 B x {widths[widest]} ({widest}; per "
        f"token and rank: {parts}) = {forward / MIB:.0f} MiB"
        + (
            f" + MoE workspace {workspace / MIB:.0f} MiB (MoE shapes of vfleet's generated "
            "models: the schema has no moe_intermediate_size or top-k)"
            if workspace
            else ""
        )
        + f"; the sampler run ({m.max_num_seqs} seqs x {arch.vocab_size} vocab x "
        f"{SAMPLER_BYTES_PER_SEQ_VOCAB} B = {sampler / MIB:.0f} MiB) comes after the forward"
    )
    return ActivationPeak(
        widths, widest, forward, workspace, sampler, PEAK_FIXED, value, unc, formula
    )


def gpu_terms(
    arch: ModelArch,
    preset: ModelPreset,
    sm: tuple[int, int],
    card: CardMemory,
    m: MemInputs,
    residual_bytes: int = 0,
    runtime_residual_bytes: int = 0,
    residual_source: str = "",
) -> list[Term]:
    """Every memory term per rank besides the KV cache."""
    tp, h = m.tp, arch.hidden_size
    terms: list[Term] = []

    parts = weight_bytes(arch, preset.quantization, sm)
    if not m.mtp_loaded:
        parts.pop("mtp", None)
    weights = sum(v // tp for v in parts.values())
    vision = int(preset.unmodelled_weights_gib * GIB) // tp if m.vision_loaded else 0
    pruned_head = m.draft_prune_rows * h * 2  # bf16/fp16, as the LM head it copies
    terms.append(
        Term(
            "weight",
            weights + vision + pruned_head,
            int(0.03 * (weights + vision)),
            "profiled",
            "vLLM source",
            "gpu_model_runner.py load_model (logged: 'Model loading took X GiB memory'); "
            "shapes from the model's config, packing from the quantisation kernels "
            "(quant_bytes); +/-3%: which tensors stay 16-bit is read from one seed",
            f"{sum(parts.values()) / GIB:.2f} GiB text model"
            + ("" if m.mtp_loaded or not arch.mtp_layers else " (MTP module not loaded)")
            + f" / TP {tp}"
            + (f" + vision {preset.unmodelled_weights_gib:g} GiB / TP {tp}" if vision else "")
            + (
                f" + draft-prune's head copy {m.draft_prune_rows:,} rows x {h} x 2 B"
                if pruned_head
                else ""
            ),
        )
    )

    peak = activation_peak(arch, m)
    terms.append(
        Term(
            "peak activation",
            peak.value,
            peak.uncertainty,
            "profiled",
            "measured",
            "gpu_worker.py determine_available_memory: the torch allocated-bytes peak of "
            "gpu_model_runner.py profile_run above the weights, i.e. _dummy_run("
            "max_num_batched_tokens) without attention metadata (attention and the GDN core "
            "skip), the MTP drafter's dummy run, then _dummy_sampler_run. Per-token part: the "
            "widest layer's tensors (activation_peak), from qwen3_next.py / qwen3_5.py, "
            "qwen_gdn_linear_attn.py forward_cuda and fused_moe; fixed part and the check: "
            "H200 lane (docs/GPU.md 2, 2b: tiny 0.11 / 0.16 GiB, mid 1.15 GiB; planner +1% / "
            "-1% / -4.5%), generated MoE models only: a dense MLP's width and the fixed part "
            "off SM90 are not measured. +/-: 10% of the per-token part, half the fixed part, "
            "up to 256 MiB more on a cold Triton cache",
            peak.formula,
        )
    )
    if arch.multimodal and m.vision_loaded and m.mm_profiled:
        patches = VISION_BUDGET_TOKENS * VISION_PATCHES_PER_TOKEN
        encoder = patches * 2 * (2 * VISION_MLP + 6 * VISION_HIDDEN)
        cached = VISION_BUDGET_TOKENS * h * 2 * 2
        terms.append(
            Term(
                "peak activation (vision encoder profile)",
                encoder + cached,
                encoder // 2,
                "profiled",
                "unverified",
                "gpu_model_runner.py profile_run: without --skip-mm-profiling the encoder runs "
                "one image of the maximum size (budget 16384 tokens in public 0.27 logs of "
                "Qwen3.8-27B, noonghunna/club-3090 issue 1047) before the text run, which "
                "keeps its outputs; freed before serving. Tower shape (27 layers, hidden "
                "1152, MLP 4304, 2x2 patch merge) from the Qwen3-VL family, not read here",
                f"{VISION_BUDGET_TOKENS} tokens x {VISION_PATCHES_PER_TOKEN} patches x 2 B x "
                f"(2 x {VISION_MLP} + 6 x {VISION_HIDDEN}) + outputs {VISION_BUDGET_TOKENS} x "
                f"{h} x 2 B, twice",
                resident=False,
            )
        )
    terms.append(
        Term(
            "non-torch memory",
            (192 + (64 if tp > 1 else 0)) * MIB,
            160 * MIB,
            "profiled",
            "unverified",
            "utils/mem_utils.py memory_profiling: non_torch_increase from the start-up "
            "snapshot (kernel modules loaded lazily, cuBLAS, NCCL's first collectives)",
            "192 MiB, + 64 MiB with TP > 1",
        )
    )
    graphs, graph_unc, graph_formula = _graph_estimate(m)
    if graphs:
        terms.append(
            Term(
                "CUDAGraph memory",
                graphs,
                graph_unc,
                "profiled",
                "public logs",
                "gpu_model_runner.py profile_cudagraph_memory (logged: 'Estimated CUDA graph "
                "memory: X GiB total'; subtracted since VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS "
                "defaults to 1 in 0.21.0+); per-size costs fitted to noonghunna/club-3090 "
                "issues 44, 104, 127",
                graph_formula,
            )
        )
    if residual_bytes:
        terms.append(
            Term(
                "unexplained (fitted)",
                residual_bytes,
                abs(residual_bytes),
                "profiled",
                "fitted",
                residual_source,
                "the seed's logged KV pool less the terms above; its own size is its "
                "uncertainty at any other configuration",
            )
        )

    terms.append(
        Term(
            "CUDA context",
            card.context_bytes,
            card.context_uncertainty,
            "outside",
            card.context_known,
            "taken before vLLM's start-up snapshot (gpu_worker.py init_device), so outside "
            "the requested memory; 527 MiB measured on an H200 (132 SMs), less on a "
            "68-SM 2080 Ti (the per-SM local memory reservation scales with SMs)",
            f"{card.context_bytes / MIB:.0f} MiB",
        )
    )
    if tp > 1:
        terms.append(
            Term(
                "NCCL communicators",
                160 * MIB,
                128 * MIB,
                "outside",
                "unverified",
                "gpu_worker.py init_device: init_worker_distributed_environment runs before "
                "the snapshot ('This ensures NCCL buffers are allocated before we measure')",
                "160 MiB per rank",
            )
        )
        if m.custom_all_reduce:
            terms.append(
                Term(
                    "custom all-reduce buffers",
                    CUSTOM_ALL_REDUCE,
                    8 * MIB,
                    "outside",
                    "vLLM source",
                    "distributed/device_communicators/custom_all_reduce.py CustomAllreduce: "
                    "meta + 8 MiB buffer (create_shared_buffer), 8 MiB rank_data",
                    "24 MiB",
                )
            )
    if m.backend == "FLASHINFER":
        terms.append(
            Term(
                "FlashInfer workspace",
                FLASHINFER_WORKSPACE,
                0,
                "outside",
                "vLLM source",
                "v1/attention/backends/flashinfer.py FlashInferMetadataBuilder."
                "_get_workspace_buffer: allocated on the first request, after the KV cache "
                "(envs.py VLLM_FLASHINFER_WORKSPACE_BUFFER_SIZE)",
                "394 MiB, one attention metadata builder",
            )
        )
    if arch.hybrid:
        nv = arch.linear_num_value_heads or 0
        # The real chunk's GDN layer: what the profile run held for it (activation_peak's GDN
        # width) plus the chunked core it skipped; the fixed part and the MoE workspace are in
        # both and cancel.
        width = peak.widths["GDN"]
        core = m.batched_tokens * (nv // tp) * GDN_PREFILL_BYTES_PER_TOKEN_HEAD
        layer = m.batched_tokens * 2 * width + core
        excess = max(0, layer - peak.forward)
        terms.append(
            Term(
                "GDN prefill above the profiled peak",
                excess,
                core // 2,
                "outside",
                "vLLM source",
                "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py _forward_core "
                "returns early in the profile run (it warms the kernels on 64 tokens only), so "
                "a real max_num_batched_tokens prefill chunk's GDN layer is never measured; "
                "shapes from fla/ops/chunk.py chunk_gated_delta_rule_fwd; +/-50% of the core",
                f"GDN layer {m.batched_tokens} tokens x (2 B x {width} + {nv}/{tp} heads x "
                f"{GDN_PREFILL_BYTES_PER_TOKEN_HEAD} B) = {layer / MIB:.0f} MiB, less the "
                f"profiled forward {peak.forward / MIB:.0f} MiB ({peak.widest})",
            )
        )
    if runtime_residual_bytes:
        terms.append(
            Term(
                "unexplained at runtime (fitted)",
                runtime_residual_bytes,
                abs(runtime_residual_bytes),
                "outside",
                "fitted",
                residual_source,
                "the seed's nvidia-smi memory in use while serving less the request and the "
                "terms above (allocator caching after long prefills, attention temporaries); "
                "its own size is its uncertainty",
            )
        )
    return terms


def _graph_estimate(m: MemInputs) -> tuple[int, int, str]:
    mode = m.cudagraph_mode.upper()
    n = len(m.capture_sizes)
    if mode == "NONE" or n == 0:
        return 0, 0, ""
    first = GRAPH_FIRST_BASE + GRAPH_FIRST_PER_TP * m.tp
    modes = 2 if mode == "FULL_AND_PIECEWISE" else 1
    unc = 64 * MIB
    formula = f"first capture 88 + 20 x TP {m.tp} = {first // MIB} MiB"
    if "FULL" in mode and m.backend == "FLASHINFER" and 1 in m.capture_sizes:
        first = max(first, GRAPH_FULL_FIRST_FLASHINFER)
        unc += GRAPH_FULL_FIRST_FLASHINFER // 2
        formula = (
            f"FULL first capture {first // MIB} MiB (FlashInfer single-token decode, measured "
            "once on the H200)"
        )
    elif "FULL" in mode:
        # Not measured for this backend or with speculative decoding (TRITON_ATTN with MTP on
        # the H200 logged no more than PIECEWISE); 0.26+ grows the FULL mode's first capture
        # with max_num_batched_tokens on hybrid GDN models (vllm-project/vllm issue 50780).
        unc += (1024 if _version(m.vllm) >= (0, 26) else 256) * MIB
        formula += "; FULL graphs' first capture not measured here (vllm issue 50780 on 0.26+)"
    value = first + modes * (n - 1) * GRAPH_PER_SIZE
    formula += f" + {modes} x ({n} - 1) sizes x 1 MiB"
    return value, unc, formula


# =========================================================================== the split


@dataclass(frozen=True)
class MemoryModel:
    card: CardMemory
    terms: list[Term]

    @property
    def weights(self) -> int:
        return sum(t.bytes for t in self.terms if t.name == "weight")

    @property
    def profiled(self) -> int:
        """Everything vLLM's profiling subtracts from its request besides the weights."""
        return sum(t.bytes for t in self.terms if t.where == "profiled" and t.name != "weight")

    @property
    def outside(self) -> int:
        return sum(t.bytes for t in self.terms if t.where == "outside")

    @property
    def transient(self) -> int:
        """Profiled but free again while serving text (the vision encoder's profile)."""
        return sum(t.bytes for t in self.terms if t.where == "profiled" and not t.resident)

    @property
    def uncertainty(self) -> int:
        """Worst case: the terms' errors added (they are model errors, not independent)."""
        return self.card.uncertainty + sum(t.uncertainty for t in self.terms)

    @property
    def profiled_uncertainty(self) -> int:
        """The KV figure's +/- at a utilisation: the card's figure and the profiled terms."""
        return self.card.uncertainty + sum(
            t.uncertainty for t in self.terms if t.where == "profiled"
        )

    @property
    def outside_uncertainty(self) -> int:
        """What vLLM's own profiling cannot catch when it sizes the KV cache from the
        utilisation: the card's figure and the terms outside its request."""
        return self.card.uncertainty + sum(
            t.uncertainty for t in self.terms if t.where == "outside"
        )

    def available_kv(self, util: float) -> int:
        """vLLM's 'Available KV cache memory' at this utilisation."""
        return math.ceil(self.card.total_bytes * util) - self.weights - self.profiled


AUTO_MARGIN = 0.03  # of the card, kept free when the plan sets the KV bytes itself


@dataclass(frozen=True)
class AutoMemory:
    """The auto-memory decision: explicit KV bytes, or a utilisation vLLM profiles under."""

    use_bytes: bool
    kv_bytes: int  # what explicit bytes would be (before rounding to whole blocks)
    margin_bytes: int
    uncertainty_bytes: int
    utilization: float
    utilization_source: str
    why: str


def auto_memory(model: MemoryModel, tested_util: float | None, tested_by: str) -> AutoMemory:
    total = model.card.total_bytes
    margin = int(total * AUTO_MARGIN)
    kv = total - model.weights - model.profiled - model.outside - margin
    unc = model.uncertainty
    if tested_util is not None:
        util, util_source = tested_util, f"the tested value ({tested_by})"
    else:
        # vLLM measures the profiled terms itself; the rest of the card must hold the outside
        # terms and their uncertainty.
        spare = model.outside + model.outside_uncertainty
        util = math.floor(1000 * (total - spare) / total) / 1000
        util_source = (
            f"computed: the card less the terms vLLM does not profile "
            f"({model.outside / MIB:.0f} MiB +/- {model.outside_uncertainty / MIB:.0f} MiB)"
        )
    use_bytes = unc <= margin
    if use_bytes:
        why = (
            f"the terms' uncertainty ({unc / MIB:.0f} MiB) is within the "
            f"{AUTO_MARGIN:.0%} margin ({margin / MIB:.0f} MiB)"
        )
    else:
        why = (
            f"the memory terms' uncertainty (+/- {unc / MIB:.0f} MiB) exceeds the "
            f"{AUTO_MARGIN:.0%} margin ({margin / MIB:.0f} MiB) that explicit KV bytes would "
            "leave, and with --kv-cache-memory-bytes vLLM skips its own memory profiling; "
            f"gpu-memory-utilization lets vLLM measure the weights, activations and graphs"
        )
    return AutoMemory(use_bytes, kv, margin, unc, util, util_source, why)
