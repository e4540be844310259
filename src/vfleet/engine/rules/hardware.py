"""Rules: what the hardware can run (devices, TP, dtype, kernels, attention backend, CUDA
environment, threads, compile caches, the SM75 plugin and its draft vocabulary)."""

from __future__ import annotations

from vfleet.config.schema import HostVars
from vfleet.engine.decisions import DraftPrune, DraftVocabBuild
from vfleet.engine.draft_prune import PAYS_MARGIN_US, card_bandwidth, cost, plugin_k, rows_pruned
from vfleet.engine.rules.core import (
    COMMUNITY,
    FIELD_NOTES,
    SEED_A100,
    SEED_BOOST,
    SEED_SYSTEMD,
    SEED_TURBO3,
    SEEDS_README,
    Ctx,
    rule,
)
from vfleet.engine.versions import v

# The first FlashInfer release with the SM75 fix (flashinfer PR 3526; plugin/README.md).
FLASHINFER_SM75_FIX = "0.6.16"


@rule("device-fits-profile", SEEDS_README, "refuse settings that the hardware cannot run")
def device_fits_profile(c: Ctx) -> None:
    backend = c.s.attention_backend
    if c.is_cpu:
        if backend not in (None, "CPU_ATTN"):
            c.refuse(
                f"attention backend {backend} is a GPU backend; the cpu profile uses "
                "vLLM's CPU attention",
                "remove attention_backend for the cpu profile",
            )
        if c.s.tensor_parallel_size not in (None, 1):
            c.refuse("tensor parallelism needs GPUs", "remove tensor_parallel_size")
        if c.s.kv_space_gib is None:
            c.refuse(
                "the cpu profile needs kv_space_gib (VLLM_CPU_KVCACHE_SPACE)",
                "set kv_space_gib: 1 (GiB)",
            )
        if c.s.gpus is not None:
            c.refuse("the cpu profile has no GPUs", "remove gpus; cpu_cores picks cores")
        return
    if c.s.cpu_cores is not None:
        c.refuse(
            "cpu_cores binds the CPU build's engine threads; a GPU profile has no use for it",
            "remove cpu_cores (gpus picks the GPUs)",
        )
    count = c.profile.accelerator.count
    gpus = c.s.gpus
    if gpus is not None:
        bad = sorted({g for g in gpus if g >= count} | {g for g in gpus if gpus.count(g) > 1})
        if bad:
            c.refuse(
                f"gpus {gpus}: {bad} not distinct GPU indices of the profile's {count} GPUs",
                f"list distinct indices from 0 to {count - 1}, e.g. gpus: [0, 1]",
            )
        if c.s.tensor_parallel_size not in (None, len(gpus)):
            c.refuse(
                f"tensor_parallel_size {c.s.tensor_parallel_size} but {len(gpus)} gpus {gpus}",
                f"list {c.s.tensor_parallel_size} GPUs, or leave tensor_parallel_size out",
            )
    tp = c.s.tensor_parallel_size or (len(gpus) if gpus else count)
    if tp > count:
        c.refuse(
            f"tensor_parallel_size {tp} exceeds the profile's {count} GPUs",
            f"set tensor_parallel_size <= {count}",
        )
    arch = c.model.arch
    if arch.num_attention_heads % tp or (
        arch.num_key_value_heads % tp and tp % arch.num_key_value_heads
    ):
        c.refuse(
            f"{arch.num_attention_heads} attention heads / {arch.num_key_value_heads} KV "
            f"heads cannot be split over {tp} GPUs",
            "use a tensor_parallel_size that divides the head counts",
        )
    c.d.tp = tp


@rule(
    "devices",
    SEED_TURBO3 + "; " + COMMUNITY,
    "pin an instance to its GPUs or cores, so that two instances share a box",
)
def devices(c: Ctx) -> None:
    if c.is_cpu:
        if c.s.cpu_cores is not None:
            c.setenv(
                "VLLM_CPU_OMP_THREADS_BIND",
                c.s.cpu_cores,
                "the engine's threads on these cores only: vLLM's default binds the same "
                "first core in every instance on the box",
            )
        return
    if c.s.gpus is not None:
        c.setenv(
            "CUDA_VISIBLE_DEVICES",
            ",".join(map(str, c.s.gpus)),
            f"this instance's GPUs (nvidia-smi numbering, CUDA_DEVICE_ORDER=PCI_BUS_ID): "
            f"one TP group of {len(c.s.gpus)}; another instance may hold the rest",
        )


@rule("tensor-parallel", SEED_SYSTEMD, "split the model over the profile's GPUs")
def tensor_parallel(c: Ctx) -> None:
    if c.is_cpu:
        return
    why = "27B does not fit one 22 GB card; TP over all GPUs of the profile"
    c.arg("tensor-parallel-size", c.d.tp, why if c.d.tp > 1 else "one GPU")


@rule(
    "dtype-half-sm75",
    SEEDS_README + "; " + SEED_SYSTEMD,
    "SM75 has no bf16 tensor cores: compute in fp16",
)
def dtype_half_sm75(c: Ctx) -> None:
    if c.is_sm75:
        if c.s.dtype in ("bfloat16",):
            c.refuse(
                "bfloat16 on SM75 (Turing) has no tensor-core support",
                "use dtype: half (or leave dtype unset)",
            )
        c.arg("dtype", c.s.dtype or "half", "SM75 has no bf16 tensor cores; fp16 is fastest")
    elif c.s.dtype is not None:
        c.arg("dtype", c.s.dtype, "operator setting")


@rule("quantization", COMMUNITY + "; " + SEED_SYSTEMD, "pick the fast kernel for the weights")
def quantization(c: Ctx) -> None:
    q = c.model.quantization
    if c.is_cpu or q.method == "none":
        return
    if q.vllm_name:
        c.arg("quantization", q.vllm_name, f"{q.method} weights; named explicitly as the seed did")
    elif q.method == "awq" and c.model.arch.num_experts is None:
        c.arg(
            "quantization",
            "awq_marlin",
            "dense AWQ must use the Marlin kernel (7.8x faster than plain awq)",
            COMMUNITY,
        )


@rule(
    "attention-backend",
    SEEDS_README + "; " + SEED_A100 + "; " + SEED_BOOST,
    "choose an attention backend the GPU and KV dtype can run",
)
def attention_backend(c: Ctx) -> None:
    if c.is_cpu:
        if c.s.kv_cache_dtype not in (None, "auto"):
            c.arg("kv-cache-dtype", c.s.kv_cache_dtype, "operator setting")
        return
    kv = c.s.kv_cache_dtype or "auto"
    fp8 = kv.startswith("fp8")
    backend = c.s.attention_backend
    sm = c.sm
    if backend == "FLASH_ATTN" and sm < (8, 0):
        c.refuse("FlashAttention 2 needs SM80+", "use TRITON_ATTN or FLASHINFER on SM75")
    if fp8 and backend == "TRITON_ATTN" and sm < (8, 9):
        c.refuse(
            f"TRITON_ATTN with fp8 KV needs SM89+ (Triton fp8e4nv); this GPU is SM{sm[0]}{sm[1]}",
            "use attention_backend FLASHINFER for fp8 KV, or kv_cache_dtype auto",
        )
    if fp8 and backend == "FLASH_ATTN" and sm < (9, 0):
        c.refuse(
            "FLASH_ATTN with fp8 KV needs FA3 (SM90)",
            "use attention_backend FLASHINFER for fp8 KV on SM80",
        )
    # vLLM 0.24.0 raised FLASHINFER's floor to SM80 (flashinfer issue 3620;
    # v1/attention/backends/flashinfer.py supports_compute_capability); 0.21.0 allows SM75.
    plugin_fi = c.is_sm75 and v(c.version) >= v("0.24.0")
    if backend is None:
        if fp8 or not c.is_sm75:
            backend = "FLASHINFER"
            why = (
                (
                    "fp8 KV below SM89 works only through FLASHINFER (storage compression, "
                    "software dequant)"
                )
                if fp8
                else (
                    "split-KV keeps long-context decode flat "
                    "(62-70 tok/s at 0-240K on A100; FA2 fell to 22 tok/s at 128K)"
                )
            )
        else:
            backend = "TRITON_ATTN"
            why = (
                "runs on SM75 in every pinned vLLM (FLASHINFER needs the SM75 plugin from 0.24 "
                "on); the CUDA graph mode is the cudagraphs rule's (PIECEWISE with MTP)"
            )
    else:
        why = "operator setting"
    if backend == "FLASHINFER" and plugin_fi:
        if not c.stack.plugin:
            c.refuse(
                f"vLLM {c.version} refuses FLASHINFER below SM80 (flashinfer issue 3620)",
                "use a stack with the vfleet SM75 plugin (`vfleet profiles`), or the "
                "vllm-0.21.0 line, or kv_cache_dtype auto with TRITON_ATTN",
            )
        if not c.stack.flashinfer or v(c.stack.flashinfer) < v(FLASHINFER_SM75_FIX):
            c.refuse(
                f"vLLM {c.version} refuses FLASHINFER below SM80, and the SM75 plugin lifts that "
                f"floor only with FlashInfer >= {FLASHINFER_SM75_FIX} (the SM75 fix, flashinfer "
                f"PR 3526); stack {c.stack_name} installs FlashInfer "
                f"{c.stack.flashinfer or 'none'}",
                "use the vllm-0.27.1-plugin stack (FlashInfer 0.6.16.post3), or kv_cache_dtype "
                "auto with TRITON_ATTN",
            )
        c.warn(
            "FLASHINFER on SM75 with vLLM >= 0.24 depends on the vfleet-sm75 plugin's "
            "flashinfer-sm75 feature and FlashInfer >= 0.6.16 (the SM75 fix, flashinfer PR 3526)",
            COMMUNITY,
        )
    c.d.backend = backend
    c.arg("attention-backend", backend, why)
    if kv != "auto":
        c.arg(
            "kv-cache-dtype",
            kv,
            "fp8 KV: ~1.8-2x the KV tokens; on SM75/SM80 it buys "
            "capacity, not speed (115,714 -> 207,692 tokens in seed 002)",
            SEED_SYSTEMD,
        )


@rule("cuda-env", SEED_SYSTEMD + "; " + COMMUNITY, "environment every CUDA stack needs")
def cuda_env(c: Ctx) -> None:
    if c.is_cpu:
        return
    c.setenv(
        "VLLM_USE_FLASHINFER_SAMPLER",
        "0",
        "the FlashInfer sampler's CUB JIT crashes the EngineCore in some builds",
        SEED_A100,
    )
    c.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID", "GPU ids match nvidia-smi", COMMUNITY)
    c.setenv(
        "CUDA_HOME",
        c.host.cuda_home,
        "the CUDA toolkit FlashInfer/Triton JIT compile against",
        SEED_SYSTEMD,
    )
    c.setenv(
        "TRITON_PTXAS_PATH",
        f"{c.host.cuda_home}/bin/ptxas",
        "Triton JIT needs a ptxas that knows the card",
        SEED_TURBO3,
    )
    if c.d.tp > 1:
        c.setenv(
            "PYTORCH_NVML_BASED_CUDA_CHECK",
            "1",
            "NVML-based CUDA checks are safer when several worker processes start at once",
            SEED_TURBO3,
        )
        c.setenv(
            "TORCHINDUCTOR_COMPILE_THREADS",
            "1",
            "TP workers compiling at once exhaust CPU and RAM otherwise",
            SEED_TURBO3,
        )
    if c.is_sm75:
        c.setenv("VLLM_USE_DEEP_GEMM", "0", "DeepGEMM does not support SM75", SEED_SYSTEMD)
        c.setenv("TORCH_CUDA_ARCH_LIST", "7.5", "JIT only for the card that is there", COMMUNITY)
        extra = c.s.extra_env or {}
        if "expandable_segments:True" in extra.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            c.warn(
                "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True crashes start-up on SM75 "
                "in community reports (seed 004 sets it on 0.21.0): verify on your stack",
                COMMUNITY,
            )


@rule("cpu-kv-space", FIELD_NOTES, "the CPU build sizes its KV cache in GiB from the env")
def cpu_kv_space(c: Ctx) -> None:
    if not c.is_cpu:
        return
    c.setenv(
        "VLLM_CPU_KVCACHE_SPACE",
        str(c.s.kv_space_gib),
        "KV cache size in GiB for the CPU build (an int)",
    )
    for key in ("gpu_memory_utilization", "kv_cache_memory_bytes"):
        if getattr(c.s, key) is not None:
            c.warn(f"{key} has no effect on the cpu profile (KV space comes from kv_space_gib)")


@rule("threads", SEED_SYSTEMD + "; " + SEED_TURBO3, "bound CPU threads per process")
def threads(c: Ctx) -> None:
    if c.s.omp_num_threads:
        c.setenv(
            "OMP_NUM_THREADS",
            str(c.s.omp_num_threads),
            "avoid thread oversubscription across API server, engine and workers",
        )


# The draft vocabulary's name inside a release (render.py writes it there).
DRAFT_VOCAB_FILE = "draft-vocab.json"


def plugin_state_file(host: HostVars, instance: str) -> str:
    """Where the SM75 plugin writes its runtime decision (the sidecar and the doctor read it)."""
    return f"{host.instance_dir(instance)}/state/plugin-features.json"


# Compile caches: env var -> folder under the instance's cache dir.
CACHE_ENV = {
    "VLLM_CACHE_ROOT": "vllm",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TRITON_CACHE_DIR": "triton",
    # Python bytecode, written by the instance's first start (the venv's own __pycache__ is not
    # read once a prefix is set, so the role installs with --no-compile). Without it a venv
    # with no bytecode, read-only under ProtectSystem=strict, was compiled again at every start.
    "PYTHONPYCACHEPREFIX": "pycache",
}


@rule("caches", SEED_TURBO3 + "; " + COMMUNITY, "per-instance compile caches that survive restarts")
def caches(c: Ctx) -> None:
    base = c.host.cache_dir(c.instance)
    why = "kept across restarts so the next start does not recompile for minutes; per instance"
    for key, sub in CACHE_ENV.items():
        c.setenv(key, f"{base}/{sub}", why)
    if not c.is_cpu:
        c.setenv(
            "TRITON_CACHE_AUTOTUNING", "1", "reuse autotuning results across restarts", SEED_TURBO3
        )
    else:
        c.setenv(
            "VLLM_USE_AOT_COMPILE",
            "0",
            "vllm-cpu's AOT compile cache never loads on the CPU backend (\"'function' object "
            "has no attribute 'finalize_loading'\"): every start traced again; the other cache "
            "path loads (a warm restart in 40 s instead of 55, docs/BENCHMARKS.md)",
            FIELD_NOTES,
        )
    c.setenv(
        "PYTHONDONTWRITEBYTECODE",
        "",
        "empty: bytecode is cached even where the caller's environment turns it off (pm2 "
        "passes its daemon's environment on); a start without it took 72-79 s, not 30-35 "
        "(tiny model, docs/BENCHMARKS.md)",
        FIELD_NOTES,
    )
    c.setenv("HF_HUB_OFFLINE", "1", "weights are local; never reach for a hub at start-up")


# The busy-poll window of vLLM's shared-memory queue readers on the CPU profile (vLLM: 1 s).
READER_SPIN_S = "0.1"


@rule(
    "plugin",
    SEED_BOOST + "; docs/GPU.md (section 7: the draft head measured on the H200)",
    "enable the vfleet SM75 plugin where the stack carries it; draft-prune where it pays",
)
def plugin(c: Ctx) -> None:
    asked = [
        k
        for k in ("draft_vocab_corpus", "draft_vocab_file", "draft_vocab_top")
        if getattr(c.s, k) is not None
    ]
    if asked and not c.stack.plugin:
        c.refuse(
            f"{', '.join(asked)}: stack {c.stack_name} does not carry the SM75 plugin",
            "drop them, or pick a stack with plugin: (vfleet profiles)",
        )
    if not c.stack.plugin:
        if c.s.draft_prune:  # a profile's default too (cpu's other stack): said, not refused
            c.info(f"draft_prune=true: stack {c.stack_name} carries no plugin to prune with")
        return
    prune, why = _draft_prune(c)
    if prune:
        c.setenv(
            "VFLEET_SM75",
            "auto",
            "plugin features turn themselves on when their conditions hold and log why not "
            f"otherwise (VFLEET_SM75=off to disable); draft-prune on {why}",
        )
    else:
        try:  # the plugin's own feature names (its settings module: one definition of them)
            from vfleet_sm75.settings import FEATURES
        except ImportError:
            c.refuse(
                f"stack {c.stack_name} carries the SM75 plugin, and the vfleet-sm75 package "
                "(plugin/) is not installed beside vfleet to name its features",
                "make venv (installs ./plugin), or pip install -e ./plugin",
            )

        c.setenv(
            "VFLEET_SM75",
            ",".join(f for f in FEATURES if f != "draft-prune"),
            "every plugin feature but draft-prune, each on when its conditions hold (the "
            f"plugin logs why not; VFLEET_SM75=off to disable); draft-prune off: {why}",
        )
    c.setenv(
        "VFLEET_SM75_STATE",
        plugin_state_file(c.host, c.instance),
        "the plugin writes which features are on and why there; the sidecar's "
        "plugin_features label and vfleet doctor report it",
    )
    if c.is_cpu:
        c.setenv(
            "VFLEET_SM75_SPIN_S",
            READER_SPIN_S,
            "the plugin's reader-spin: vLLM's queue readers busy-poll 1 s after every read, "
            "so at one request a second a CPU worker spun a whole core (98 %, 7 % at 0.01 s) "
            "that the box's compute needs; decode unchanged (docs/BENCHMARKS.md, \"The "
            "reader's spin\"). Not set on GPUs: not measured there",
            FIELD_NOTES,
        )
    if prune:
        _draft_vocab(c)


def _draft_prune(c: Ctx) -> tuple[bool, str]:
    """Draft-prune on or off, and why: the `draft_prune` setting, a `draft_vocab_*` setting
    (naming its table asks for it), or else its cost model (vfleet.engine.draft_prune): on
    where the LM head rows it skips save at least PAYS_MARGIN_US per draft call beyond its
    fixed cost at the card's memory bandwidth. Only an MTP drafter drafts through it."""
    table = [
        k for k in ("draft_vocab_corpus", "draft_vocab_file", "draft_vocab_top") if getattr(c.s, k)
    ]
    if c.d.spec_method != "mtp":
        if table:
            c.refuse(
                f"{', '.join(table)} set draft-prune's table, and nothing drafts through it here "
                f"(speculative decoding: {c.d.spec_method}; draft-prune prunes MTP's head)",
                "drop them, or serve with MTP (speculative.method=mtp)",
            )
        return False, f"no MTP drafter to prune (speculative decoding: {c.d.spec_method})"
    if c.s.sleep_level == 2:
        # The pruned head's rows are plain tensors the plugin allocates in vLLM's weights pool
        # at load: a level 2 sleep drops their contents and neither vLLM's reload nor the
        # plugin's drafter-reload rebuilds them, so after the wake it would draft from garbage.
        if c.s.draft_prune or table:
            c.refuse(
                "draft-prune with sleep_level 2: a level 2 wake does not restore the pruned "
                "head's rows (the plugin builds them once, at load)",
                "sleep_level 1, or drop draft_prune and draft_vocab_*",
            )
        return False, (
            "sleep_level 2: a level 2 wake does not restore the pruned head's rows (built once, "
            "at load); the head is vLLM's own"
        )
    arch = c.model.arch
    k = c.s.draft_vocab_top or plugin_k(arch.vocab_size)
    # A table's own size decides at load; VFLEET_SM75_DRAFT_TOPK cuts it.
    topk = (c.s.extra_env or {}).get("VFLEET_SM75_DRAFT_TOPK", "")
    if topk.isdigit() and int(topk) > 0:
        k = min(k, int(topk))
    assumed = (
        f" (K as a table built here would have it: {c.s.draft_vocab_file or c.model.draft_vocab}"
        " decides at load)"
        if c.s.draft_vocab_file or (c.model.draft_vocab and not c.s.draft_vocab_corpus)
        else ""
    )
    card = c.profile.accelerator.gpu_model or ""
    bw = card_bandwidth(card, c.profile.accelerator.memory_bandwidth_gbs)
    model = cost(arch.vocab_size, arch.hidden_size, k, c.d.tp, bw) if bw else None
    figures = (
        model.summary(c.d.spec_k) + assumed
        if model
        else f"no memory-bandwidth figure for {'a CPU' if c.is_cpu else repr(card)} "
        "(set accelerator.memory_bandwidth_gbs in the hardware profile)"
    )
    if c.s.draft_prune is False and table:
        c.refuse(
            f"{', '.join(table)} set draft-prune's table, and draft_prune=false turns it off",
            "drop one or the other",
        )
    if c.s.draft_prune is not None:
        on, why = c.s.draft_prune, f"by draft_prune={str(c.s.draft_prune).lower()}"
    elif table:
        on, why = True, f"by {', '.join(table)}, which names its table"
    else:
        on = bool(model and model.pays)
        why = (
            f"by its cost model, which asks {PAYS_MARGIN_US:.0f} us a call (draft_prune=true "
            "or false to choose)"
        )
    if on:
        c.d.draft_prune = DraftPrune(k, rows_pruned(k, c.d.tp))
    return on, f"{why}: {figures}"


def _draft_vocab(c: Ctx) -> None:
    """Which draft vocabulary the plugin reads: the operator's table, a table built on the host
    from the operator's corpus, the preset's shipped table, or one built from the default
    corpus (in that order). Only MTP models draft from it."""
    key = "VFLEET_SM75_DRAFT_VOCAB"
    built = f"{c.host.instance_dir(c.instance)}/state/{DRAFT_VOCAB_FILE}"
    vocab = c.model.arch.vocab_size
    top = c.s.draft_vocab_top or plugin_k(vocab)
    if c.s.draft_vocab_file:
        c.setenv(key, c.s.draft_vocab_file, "the operator's table (draft_vocab_file)")
    elif c.s.draft_vocab_corpus:
        c.d.draft_vocab_build = DraftVocabBuild(built, c.s.draft_vocab_corpus, top)
        c.setenv(
            key,
            built,
            f"built at deploy with the model's own tokenizer over {c.s.draft_vocab_corpus} "
            f"(draft_vocab_corpus), K={top}: MTP drafts from its most frequent tokens",
        )
    elif c.model.draft_vocab:
        c.setenv(
            key,
            f"{c.host.instance_dir(c.instance)}/current/{DRAFT_VOCAB_FILE}",
            f"the model's draft vocabulary ({c.model.draft_vocab}), shipped in the release: "
            "MTP drafts from its most frequent tokens, outputs unchanged",
        )
    elif c.model.arch.mtp_layers:
        c.d.draft_vocab_build = DraftVocabBuild(built, None, top)
        c.setenv(
            key,
            built,
            "built at deploy with the model's own tokenizer over the plugin's default corpus "
            f"(draft_vocab_corpus to name yours), K={top}: MTP drafts from its most frequent "
            "tokens, outputs unchanged",
        )
    if c.s.draft_vocab_top is not None and c.d.draft_vocab_build is None:
        c.refuse(
            "draft_vocab_top sets K of a table built on the host, and none is built here",
            "drop draft_vocab_top, or name a corpus with draft_vocab_corpus",
        )
    if c.d.draft_vocab_build is not None and not 1 <= top < vocab:
        c.refuse(
            f"draft_vocab_top {top} must be below the model's vocabulary ({vocab})",
            f"set draft_vocab_top between 1 and {vocab - 1}",
        )
