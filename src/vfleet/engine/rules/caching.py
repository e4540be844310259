"""Rules: prefix caching (Mamba align mode) and chunked prefill."""

from __future__ import annotations

from vfleet.engine.rules.core import (
    FIELD_NOTES,
    SEED_A100,
    SEED_SYSTEMD,
    SEED_TURBO3,
    VLLM_SOURCE,
    Ctx,
    Note,
    rule,
)
from vfleet.engine.versions import MAMBA_ALIGN_IMPLIED_SINCE, v


@rule(
    "prefix-caching",
    SEED_A100 + "; " + SEED_TURBO3 + "; " + FIELD_NOTES + "; " + VLLM_SOURCE,
    "prefix caching on for hybrid models (align mode), off when the CPU build runs MTP",
)
def prefix_caching(c: Ctx) -> None:
    hybrid = c.model.arch.hybrid
    if c.is_cpu and hybrid and c.d.spec_method == "mtp":
        if c.s.prefix_caching:
            c.refuse(
                "prefix caching with MTP on the CPU build: the Mamba 'align' cache mode "
                "runs a Triton kernel that has no CPU backend",
                "set prefix_caching: false",
                FIELD_NOTES,
            )
        c.arg(
            "enable-prefix-caching",
            False,
            "the CPU build cannot run MTP with Mamba "
            "'align' caching (Triton kernel without CPU backend)",
            FIELD_NOTES,
        )
        c.d.prefix_caching = False
        return
    want = c.s.prefix_caching if c.s.prefix_caching is not None else True
    c.d.prefix_caching = want
    if hybrid and not want:
        c.warn(
            "prefix caching off on a hybrid model: summary decode fell from 240 to 127 "
            "tok/s in seed 001 (Mamba cache mode side effect) and warm TTFT is lost",
            SEED_A100,
        )
    c.arg(
        "enable-prefix-caching",
        want,
        "reuse shared prefixes (warm 240K TTFT 4.3 s vs 155 s cold in seed 001)"
        if want
        else "operator setting",
    )
    if hybrid and want:
        if v(c.version) >= v(MAMBA_ALIGN_IMPLIED_SINCE):
            c.notes.append(
                Note(
                    "dropped",
                    "prefix-caching",
                    f"--mamba-cache-mode align not emitted: vLLM "
                    f"{c.version} sets it itself when prefix caching is on for GDN models",
                    VLLM_SOURCE,
                )
            )
        else:
            c.arg(
                "mamba-cache-mode",
                "align",
                "hybrid models need Mamba align mode with prefix caching",
                SEED_TURBO3,
            )


@rule(
    "chunked-prefill",
    SEED_SYSTEMD + "; " + VLLM_SOURCE,
    "chunked prefill for long context and for Mamba align mode",
)
def chunked_prefill(c: Ctx) -> None:
    need_align = c.model.arch.hybrid and c.d.prefix_caching
    mbt = c.d.max_num_batched_tokens
    long_ctx = mbt is not None and c.d.max_model_len > mbt
    if c.s.chunked_prefill is False:
        if need_align:
            c.refuse(
                "Mamba align mode (prefix caching on a hybrid model) requires chunked "
                "prefill (vLLM asserts it)",
                "remove chunked_prefill: false",
            )
        if long_ctx:
            c.refuse(
                "max_model_len exceeds max_num_batched_tokens without chunked prefill: "
                "long prompts cannot be scheduled (and OOM in prefill)",
                "remove chunked_prefill: false",
            )
        c.arg("enable-chunked-prefill", False, "operator setting")
        return
    if c.s.chunked_prefill or need_align or long_ctx:
        c.arg(
            "enable-chunked-prefill",
            True,
            "required by Mamba align mode"
            if need_align
            else "long context: prefill in chunks of max_num_batched_tokens, else OOM",
        )
