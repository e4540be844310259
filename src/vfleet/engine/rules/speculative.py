"""Rules: speculative decoding (MTP depth), CUDA graph shapes and async scheduling."""

from __future__ import annotations

from typing import Any

from vfleet.config.schema import SpecMethod
from vfleet.engine.rules.core import (
    COMMUNITY,
    GPU_LANE,
    SEED_A100,
    SEED_SYSTEMD,
    SEED_TURBO3,
    SEEDS_README,
    VLLM_SOURCE,
    Ctx,
    rule,
)


@rule(
    "speculative",
    SEEDS_README + "; " + SEED_A100 + "; " + SEED_TURBO3,
    "MTP x3 by default; x4 only with four SM75 GPUs in one TP group",
)
def speculative(c: Ctx) -> None:
    spec = c.s.speculative
    method: SpecMethod = (
        spec.method if spec and spec.method else ("mtp" if c.model.arch.mtp_layers else "none")
    )
    c.d.spec_method = method
    if method == "none":
        c.d.spec_k = 0
        return
    if method == "mtp" and not c.model.arch.mtp_layers:
        c.refuse(f"{c.model.name} has no MTP layers", "set speculative.method: ngram or none")
    k = spec.num_speculative_tokens if spec and spec.num_speculative_tokens else None
    four_sm75 = c.is_sm75 and c.d.tp >= 4  # Turbo3's box, where MTP 4 paid off
    if k is None:
        k = 4 if (four_sm75 and method == "mtp") else 3
        why = (
            "four SM75 GPUs in one TP group: MTP 4 (Turbo3's AutoSpec)"
            if k == 4
            else "3 draft tokens was best in every context length measured (2/3/4 sweep: ~1.9 "
            "tokens per step at 3)"
        )
    else:
        why = "operator setting"
        if method == "mtp" and k >= 4 and not four_sm75:
            c.warn(
                f"MTP {k}: acceptance falls with depth (59/47/39% at 2/3/4 on A100) and "
                "speed peaked at 3; 4 paid off only on four SM75 GPUs",
                SEED_A100,
            )
    conf: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        conf["prompt_lookup_max"] = (spec.prompt_lookup_max if spec else None) or 3
        conf["prompt_lookup_min"] = (spec.prompt_lookup_min if spec else None) or 1
    backend = c.d.backend
    if method == "mtp" and backend is not None:
        # vLLM picks the draft's backend on its own when none is named: with a FLASHINFER target
        # on SM90 it took FLASH_ATTN (FA3), which refuses fp8 KV with fp16 output and killed the
        # engine at the first request (H200 run, docs/GPU.md).
        conf["attention_backend"] = backend
        why += f"; the MTP draft uses the target's {backend} (its KV dtype and CUDA graphs)"
    c.d.spec_k = k
    c.arg("speculative-config", conf, why)
    seqs = c.d.max_num_seqs
    if method == "mtp" and c.one_32g_gpu and seqs > 1 and c.d.max_model_len >= 262144:
        c.refuse(
            f"MTP with max_num_seqs {seqs} at {c.d.max_model_len} context does not fit "
            "a 32 GB card (Mamba cache, graph pool and workspace scale with sequences)",
            "set max_num_seqs: 1, or a shorter max_model_len, or speculative.method: none",
            SEED_A100,
        )


@rule(
    "cudagraphs",
    SEEDS_README + "; " + SEED_SYSTEMD + "; " + COMMUNITY + "; " + GPU_LANE,
    "capture CUDA graphs for exactly the batch shapes decode uses; full decode graphs without MTP",
)
def cudagraphs(c: Ctx) -> None:
    if c.is_cpu:
        return
    k = c.d.spec_k
    seqs = c.d.max_num_seqs
    if k:
        sizes = [(1 + k) * i for i in range(1, seqs + 1)]
        why = (
            f"every decode step verifies 1+{k} tokens per sequence: sizes cover "
            f"max_num_seqs x (1 + k) = {seqs} x {1 + k}"
        )
    else:
        sizes = sorted({1 << i for i in range(seqs.bit_length()) if 1 << i <= seqs} | {seqs})
        why = "decode batch sizes up to max_num_seqs"
    # Without speculation a decode step is one token per sequence, which every backend vfleet
    # renders captures whole (vLLM 0.21.0/0.24.0/0.27.1: TRITON_ATTN ALWAYS, FLASHINFER w/o TRT-LLM
    # UNIFORM_SINGLE_TOKEN_DECODE, GDN UNIFORM_BATCH), and vLLM's own default is then
    # FULL_AND_PIECEWISE. The scramble report is about MTP's 1+k-token steps only.
    mode = c.s.cudagraph_mode or ("PIECEWISE" if k else "FULL_AND_PIECEWISE")
    if c.s.cudagraph_mode is None and k:
        why += (
            "; PIECEWISE: full CUDA graphs with MTP on the hybrid GDN layers can scramble output "
            "(seed 000 ran FULL_AND_PIECEWISE with TRITON_ATTN: set cudagraph_mode to opt in)"
        )
    elif c.s.cudagraph_mode is None:
        why += (
            "; FULL_AND_PIECEWISE: without MTP a decode step replays one CUDA graph instead of "
            "one per piece between the layers (H200, qwen3.6-27b-awq-int4, vLLM 0.24.0, one "
            "stream: 52.3 tok/s PIECEWISE, 91.2 FULL_AND_PIECEWISE)"
        )
    conf = {
        "cudagraph_mode": mode,
        "cudagraph_capture_sizes": sizes,
        "max_cudagraph_capture_size": max(sizes),
    }
    c.arg("compilation-config", conf, why)


@rule(
    "async-scheduling",
    SEED_SYSTEMD + "; " + VLLM_SOURCE,
    "no async scheduling where it gains nothing: SM75 with one sequence",
)
def async_scheduling(c: Ctx) -> None:
    # vLLM turns async scheduling on by itself for MTP (config/vllm.py in 0.24.0 and later);
    # seed 002 turned it off on its 2080 Tis because it gained nothing at max_num_seqs 1. The
    # seeds that ran more sequences (000: 8, 004: 4) left vLLM's default, and so does vfleet.
    if c.s.async_scheduling is not None:
        c.arg("async-scheduling", c.s.async_scheduling, "operator setting")
    elif c.is_sm75 and c.d.max_num_seqs == 1:
        c.arg(
            "async-scheduling",
            False,
            "no gain at max_num_seqs 1 on SM75 (seed 002 measured and turned it off)",
        )
