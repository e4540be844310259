"""Rules: context length, batch limits and how much GPU memory vLLM may take."""

from __future__ import annotations

from vfleet.engine.rules.core import (
    COMMUNITY,
    SEED_A100,
    SEED_SYSTEMD,
    SEED_TURBO3,
    Ctx,
    rule,
)


@rule("context-and-batch", SEED_A100 + "; " + SEED_SYSTEMD, "context length and batch limits")
def context_and_batch(c: Ctx) -> None:
    arch = c.model.arch
    mml = c.s.max_model_len or arch.max_position_embeddings
    if mml > arch.max_position_embeddings:
        c.refuse(
            f"max_model_len {mml} exceeds the model's native window "
            f"{arch.max_position_embeddings}; past it (YaRN) MTP acceptance collapses to 0%",
            f"set max_model_len <= {arch.max_position_embeddings}",
            COMMUNITY,
        )
    c.d.max_model_len = mml
    c.arg("max-model-len", mml, "context window to plan KV for")
    seqs = c.s.max_num_seqs
    if seqs is None:
        seqs = 1 if c.one_32g_gpu else 4
    c.d.max_num_seqs = seqs
    c.arg(
        "max-num-seqs",
        seqs,
        "one sequence is what lets MTP fit a 32 GB card "
        "(Mamba state, graph pool and workspace shrink to one slot)"
        if seqs == 1
        else "concurrent sequences the scheduler runs",
    )
    if c.s.max_num_batched_tokens:
        c.d.max_num_batched_tokens = c.s.max_num_batched_tokens
        c.arg(
            "max-num-batched-tokens",
            c.s.max_num_batched_tokens,
            "prefill chunk size: bounds the activation peak",
        )


@rule(
    "gpu-memory", SEED_A100 + "; " + SEED_TURBO3 + "; " + COMMUNITY, "how much VRAM vLLM may take"
)
def gpu_memory(c: Ctx) -> None:
    if c.is_cpu:
        return
    if c.s.kv_cache_memory_bytes is not None:
        c.arg(
            "kv-cache-memory-bytes",
            c.s.kv_cache_memory_bytes,
            "explicit KV budget: stable across driver/context-size changes",
            COMMUNITY,
        )
        if c.s.gpu_memory_utilization is not None:
            c.warn("gpu_memory_utilization is ignored by vLLM when kv_cache_memory_bytes is set")
        return
    if c.s.gpu_memory_utilization is None:
        c.d.auto_memory = True  # sized by the planner once the KV shape is known
        return
    util = c.s.gpu_memory_utilization
    c.arg(
        "gpu-memory-utilization",
        util,
        "share of each GPU's memory vLLM may plan for; leave "
        "headroom for FlashInfer's ~394 MiB workspace allocated lazily outside the budget",
    )
