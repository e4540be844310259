"""The knowledge base: named rules that turn a deployment into vLLM arguments and env.

Each rule states what it does, why, and where that was learned (a seed write-up, the
community findings, or vLLM's own source). Rules run in order over a shared context; they
set an argument or env var, warn, or refuse a known-bad combination with the fix.
Operator settings always win over a rule's default, but never over a refusal.
`vfleet explain` prints every decision with its rule, reason and source.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from vfleet.config.defaults import DEFAULT_HOST, DEFAULT_PORT, SHUTDOWN_TIMEOUT_S
from vfleet.config.schema import (
    DEFAULT_INSTANCE,
    HardwareProfile,
    HostVars,
    ModelPreset,
    ServeSettings,
    Stack,
)
from vfleet.engine.topology import group_links
from vfleet.engine.versions import MAMBA_ALIGN_IMPLIED_SINCE, option_supported, v
from vfleet.errors import Refused, VfleetError

# The first FlashInfer release with the SM75 fix (flashinfer PR 3526; plugin/README.md).
FLASHINFER_SM75_FIX = "0.6.16"
# Sleep mode's wake-up zeroes a quantised KV cache tensor by tensor; before 0.27.1 it calls
# .zero_() on the GDN/Mamba layers' state lists and the wake fails, leaving the engine paused
# (gpu_model_runner.py init_fp8_kv_scales; seen on the H200 lane with 0.24.0, docs/GPU.md).
SLEEP_FP8_HYBRID_WAKE_FIXED_IN = "0.27.1"

SEED_BOOST = "seeds/000 (2x 2080 Ti, vllm-boost, vLLM 0.27.1)"
SEED_A100 = "seeds/001 (A100 32 GB, vLLM 0.27.1, pm2)"
SEED_SYSTEMD = "seeds/002 (2x 2080 Ti NVLink, vLLM 0.24.0 systemd unit)"
SEED_TURBO3 = "seeds/004 (4x 2080 Ti, Caovan Turbo3, vLLM 0.21.0)"
SEEDS_README = "seeds/README.md (recurring facts)"
COMMUNITY = "docs/SOURCES.md#community"
FIELD_NOTES = "docs/SOURCES.md#observed (seen on vfleet's machines)"
VLLM_SOURCE = "vLLM source of the pinned versions (src/vfleet/engine/versions.py)"


@dataclass(frozen=True)
class Entry:
    """One rendered argument or environment variable and the rule that set it."""

    kind: Literal["arg", "env"]
    key: str
    value: Any
    rule: str
    reason: str
    source: str
    secret: bool = False


@dataclass(frozen=True)
class Note:
    level: Literal["warn", "dropped", "info"]
    rule: str
    message: str
    source: str


@dataclass(frozen=True)
class Rule:
    name: str
    summary: str
    source: str
    fn: Callable[[Ctx], None]


RULES: list[Rule] = []


def rule(name: str, source: str, summary: str) -> Callable[[Callable[[Ctx], None]], Rule]:
    def deco(fn: Callable[[Ctx], None]) -> Rule:
        r = Rule(name, summary, source, fn)
        RULES.append(r)
        return r

    return deco


@dataclass
class Ctx:
    profile: HardwareProfile
    model: ModelPreset
    stack_name: str
    s: ServeSettings
    host: HostVars
    args: dict[str, Entry] = field(default_factory=dict)
    env: dict[str, Entry] = field(default_factory=dict)
    notes: list[Note] = field(default_factory=list)
    # False for `vfleet plan`: report a configuration that does not fit instead of refusing.
    strict_memory: bool = True
    # Values decided by earlier rules that later rules build on.
    d: dict[str, Any] = field(default_factory=dict)
    current: Rule | None = None

    # -- facts -------------------------------------------------------------------------
    @property
    def stack(self) -> Stack:
        return self.profile.stacks[self.stack_name]

    @property
    def version(self) -> str:
        return self.stack.vllm

    @property
    def is_cpu(self) -> bool:
        return self.profile.accelerator.kind == "cpu"

    @property
    def sm(self) -> tuple[int, int]:
        return self.profile.accelerator.sm or (0, 0)

    @property
    def is_sm75(self) -> bool:
        return not self.is_cpu and self.sm == (7, 5)

    @property
    def instance(self) -> str:
        return self.s.instance or DEFAULT_INSTANCE

    # -- effects -----------------------------------------------------------------------
    def _rule(self) -> Rule:
        assert self.current is not None
        return self.current

    def arg(self, key: str, value: Any, why: str, source: str | None = None) -> None:
        r = self._rule()
        src = source or r.source
        if not option_supported(key, self.version):
            self.notes.append(
                Note(
                    "dropped",
                    r.name,
                    f"--{key} not emitted: vLLM {self.version} has no such option ({why})",
                    src,
                )
            )
            return
        if value is False:
            # `key: false` is dropped silently by `vllm serve --config` before
            # FALSE_BOOL_DROPPED_BEFORE; `no-key: true` means the same in every version.
            key, value = f"no-{key}", True
        if key in self.args:
            raise AssertionError(f"rule {r.name} sets --{key} twice (first: {self.args[key].rule})")
        self.args[key] = Entry("arg", key, value, r.name, why, src)

    def setenv(
        self, key: str, value: str, why: str, source: str | None = None, secret: bool = False
    ) -> None:
        r = self._rule()
        self.env[key] = Entry("env", key, value, r.name, why, source or r.source, secret)

    def warn(self, message: str, source: str | None = None) -> None:
        r = self._rule()
        self.notes.append(Note("warn", r.name, message, source or r.source))

    def info(self, message: str, source: str | None = None) -> None:
        r = self._rule()
        self.notes.append(Note("info", r.name, message, source or r.source))

    def refuse(self, message: str, fix: str, source: str | None = None) -> None:
        r = self._rule()
        raise Refused(r.name, message, fix, source or r.source)


# =========================================================================== identity


@rule("model", FIELD_NOTES, "serve the model directory on the host under a stable name")
def _model(c: Ctx) -> None:
    model_dir = c.s.model_dir or c.host.model_dir(c.model.name)
    c.d["model_dir"] = model_dir
    c.arg("model", model_dir, "the model directory on the serving host")
    name = c.s.served_model_name or c.model.served_model_name
    c.d["served_model_name"] = name
    c.arg("served-model-name", name, "the name clients put in `model`; stable across swaps")


@rule("listen", "vfleet default", "listen on loopback unless told otherwise")
def _listen(c: Ctx) -> None:
    host = c.s.host or DEFAULT_HOST
    port = c.s.port or DEFAULT_PORT
    c.d["host"], c.d["port"] = host, port
    why = "loopback by default: put nginx or a firewall in front before opening it"
    c.arg("host", host, why if host.startswith("127.") else "operator setting")
    c.arg("port", port, "OpenAI-compatible API and /metrics")


# The variable vLLM reads the API key from.
API_KEY_ENV = "VLLM_API_KEY"


@rule(
    "api-key-in-env",
    "vfleet security policy; vLLM source (envs.py reads VLLM_API_KEY)",
    "the API key goes into the 0600 env file, never into argv or unit files",
)
def _api_key(c: Ctx) -> None:
    if c.s.api_key is not None:
        c.setenv(
            API_KEY_ENV,
            c.s.api_key.get_secret_value(),
            "vLLM reads it when --api-key is absent; argv is visible to every user in ps",
            secret=True,
        )


# =========================================================================== hardware


@rule("device-fits-profile", SEEDS_README, "refuse settings that the hardware cannot run")
def _device(c: Ctx) -> None:
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
    c.d["tp"] = tp


@rule(
    "devices",
    SEED_TURBO3 + "; " + COMMUNITY,
    "pin an instance to its GPUs or cores, so that two instances share a box",
)
def _devices(c: Ctx) -> None:
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
def _tp(c: Ctx) -> None:
    if c.is_cpu:
        return
    why = "27B does not fit one 22 GB card; TP over all GPUs of the profile"
    c.arg("tensor-parallel-size", c.d["tp"], why if c.d["tp"] > 1 else "one GPU")


@rule(
    "dtype-half-sm75",
    SEEDS_README + "; " + SEED_SYSTEMD,
    "SM75 has no bf16 tensor cores: compute in fp16",
)
def _dtype(c: Ctx) -> None:
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
def _quant(c: Ctx) -> None:
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
def _backend(c: Ctx) -> None:
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
                "on); the CUDA graph mode is the cudagraphs rule's (PIECEWISE by default)"
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
    c.d["backend"] = backend
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
def _cuda_env(c: Ctx) -> None:
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
    if c.d.get("tp", 1) > 1:
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
def _cpu_kv(c: Ctx) -> None:
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
def _threads(c: Ctx) -> None:
    if c.s.omp_num_threads:
        c.setenv(
            "OMP_NUM_THREADS",
            str(c.s.omp_num_threads),
            "avoid thread oversubscription across API server, engine and workers",
        )


# The draft vocabulary's name inside a release (render.py writes it there).
DRAFT_VOCAB_FILE = "draft-vocab.json"


# Seed 000's table size (65,536 of Qwen3.x's 248,320 rows); half of a smaller vocabulary.
DRAFT_VOCAB_TOP = 65536


@dataclass(frozen=True)
class DraftVocabBuild:
    """A draft vocabulary the deploy builds on the host with the model's own tokenizer."""

    out: str  # VFLEET_SM75_DRAFT_VOCAB
    corpus: str | None  # a file on the host; None: the plugin's shipped default corpus
    top: int


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
def _caches(c: Ctx) -> None:
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


@rule("plugin", SEED_BOOST, "enable the vfleet SM75 plugin where the stack carries it")
def _plugin(c: Ctx) -> None:
    asked = [
        k for k in ("draft_vocab_corpus", "draft_vocab_file", "draft_vocab_top") if getattr(c.s, k)
    ]
    if asked and not c.stack.plugin:
        c.refuse(
            f"{', '.join(asked)}: stack {c.stack_name} does not carry the SM75 plugin",
            "drop them, or pick a stack with plugin: (vfleet profiles)",
        )
    if c.stack.plugin:
        c.setenv(
            "VFLEET_SM75",
            "auto",
            "plugin features turn themselves on when their "
            "conditions hold and log why not otherwise (VFLEET_SM75=off to disable)",
        )
        c.setenv(
            "VFLEET_SM75_STATE",
            plugin_state_file(c.host, c.instance),
            "the plugin writes which features are on and why there; the sidecar's "
            "plugin_features label and vfleet doctor report it",
        )
        _draft_vocab(c)


def _draft_vocab(c: Ctx) -> None:
    """Which draft vocabulary the plugin reads: the operator's table, a table built on the host
    from the operator's corpus, the preset's shipped table, or one built from the default
    corpus (in that order). Only MTP models draft from it."""
    key = "VFLEET_SM75_DRAFT_VOCAB"
    built = f"{c.host.instance_dir(c.instance)}/state/{DRAFT_VOCAB_FILE}"
    vocab = c.model.arch.vocab_size
    top = c.s.draft_vocab_top or min(DRAFT_VOCAB_TOP, vocab // 2)
    if c.s.draft_vocab_file:
        c.setenv(key, c.s.draft_vocab_file, "the operator's table (draft_vocab_file)")
    elif c.s.draft_vocab_corpus:
        c.d["draft_vocab_build"] = DraftVocabBuild(built, c.s.draft_vocab_corpus, top)
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
        c.d["draft_vocab_build"] = DraftVocabBuild(built, None, top)
        c.setenv(
            key,
            built,
            "built at deploy with the model's own tokenizer over the plugin's default corpus "
            f"(draft_vocab_corpus to name yours), K={top}: MTP drafts from its most frequent "
            "tokens, outputs unchanged",
        )
    if c.s.draft_vocab_top is not None and "draft_vocab_build" not in c.d:
        c.refuse(
            "draft_vocab_top sets K of a table built on the host, and none is built here",
            "drop draft_vocab_top, or name a corpus with draft_vocab_corpus",
        )
    if "draft_vocab_build" in c.d and not 1 <= top < vocab:
        c.refuse(
            f"draft_vocab_top {top} must be below the model's vocabulary ({vocab})",
            f"set draft_vocab_top between 1 and {vocab - 1}",
        )


# =========================================================================== memory


@rule("context-and-batch", SEED_A100 + "; " + SEED_SYSTEMD, "context length and batch limits")
def _limits(c: Ctx) -> None:
    arch = c.model.arch
    mml = c.s.max_model_len or arch.max_position_embeddings
    if mml > arch.max_position_embeddings:
        c.refuse(
            f"max_model_len {mml} exceeds the model's native window "
            f"{arch.max_position_embeddings}; past it (YaRN) MTP acceptance collapses to 0%",
            f"set max_model_len <= {arch.max_position_embeddings}",
            COMMUNITY,
        )
    c.d["max_model_len"] = mml
    c.arg("max-model-len", mml, "context window to plan KV for")
    seqs = c.s.max_num_seqs
    if seqs is None:
        seqs = (
            1
            if (
                not c.is_cpu
                and (c.profile.accelerator.vram_gib or 0) <= 32
                and c.profile.accelerator.count == 1
            )
            else 4
        )
    c.d["max_num_seqs"] = seqs
    c.arg(
        "max-num-seqs",
        seqs,
        "one sequence is what lets MTP fit a 32 GB card "
        "(Mamba state, graph pool and workspace shrink to one slot)"
        if seqs == 1
        else "concurrent sequences the scheduler runs",
    )
    if c.s.max_num_batched_tokens:
        c.d["max_num_batched_tokens"] = c.s.max_num_batched_tokens
        c.arg(
            "max-num-batched-tokens",
            c.s.max_num_batched_tokens,
            "prefill chunk size: bounds the activation peak",
        )


@rule(
    "gpu-memory", SEED_A100 + "; " + SEED_TURBO3 + "; " + COMMUNITY, "how much VRAM vLLM may take"
)
def _memory(c: Ctx) -> None:
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
        c.d["auto_memory"] = True  # sized by the planner once the KV shape is known
        return
    util = c.s.gpu_memory_utilization
    c.arg(
        "gpu-memory-utilization",
        util,
        "share of each GPU's memory vLLM may plan for; leave "
        "headroom for FlashInfer's ~394 MiB workspace allocated lazily outside the budget",
    )


# =========================================================================== speculative


@rule(
    "speculative",
    SEEDS_README + "; " + SEED_A100 + "; " + SEED_TURBO3,
    "MTP x3 by default; x4 only with four SM75 GPUs in one TP group",
)
def _spec(c: Ctx) -> None:
    spec = c.s.speculative
    method = spec.method if spec and spec.method else ("mtp" if c.model.arch.mtp_layers else "none")
    c.d["spec_method"] = method
    if method == "none":
        c.d["spec_k"] = 0
        return
    if method == "mtp" and not c.model.arch.mtp_layers:
        c.refuse(f"{c.model.name} has no MTP layers", "set speculative.method: ngram or none")
    k = spec.num_speculative_tokens if spec and spec.num_speculative_tokens else None
    if k is None:
        k = 4 if (c.is_sm75 and c.d.get("tp", 1) >= 4 and method == "mtp") else 3
        why = (
            "four SM75 GPUs in one TP group: MTP 4 (Turbo3's AutoSpec)"
            if k == 4
            else "3 draft tokens was best in every context length measured (2/3/4 sweep: ~1.9 "
            "tokens per step at 3)"
        )
    else:
        why = "operator setting"
        if method == "mtp" and k >= 4 and not (c.is_sm75 and c.d.get("tp", 1) >= 4):
            c.warn(
                f"MTP {k}: acceptance falls with depth (59/47/39% at 2/3/4 on A100) and "
                "speed peaked at 3; 4 paid off only on four SM75 GPUs",
                SEED_A100,
            )
    conf: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        conf["prompt_lookup_max"] = (spec.prompt_lookup_max if spec else None) or 3
        conf["prompt_lookup_min"] = (spec.prompt_lookup_min if spec else None) or 1
    backend = c.d.get("backend")
    if method == "mtp" and backend is not None:
        # vLLM picks the draft's backend on its own when none is named: with a FLASHINFER target
        # on SM90 it took FLASH_ATTN (FA3), which refuses fp8 KV with fp16 output and killed the
        # engine at the first request (H200 run, docs/GPU.md).
        conf["attention_backend"] = backend
        why += f"; the MTP draft uses the target's {backend} (its KV dtype and CUDA graphs)"
    c.d["spec_k"] = k
    c.arg("speculative-config", conf, why)
    seqs = c.d["max_num_seqs"]
    acc = c.profile.accelerator
    if (
        method == "mtp"
        and not c.is_cpu
        and acc.count == 1
        and (acc.vram_gib or 0) <= 32
        and seqs > 1
        and c.d["max_model_len"] >= 262144
    ):
        c.refuse(
            f"MTP with max_num_seqs {seqs} at {c.d['max_model_len']} context does not fit "
            "a 32 GB card (Mamba cache, graph pool and workspace scale with sequences)",
            "set max_num_seqs: 1, or a shorter max_model_len, or speculative.method: none",
            SEED_A100,
        )


@rule(
    "cudagraphs",
    SEEDS_README + "; " + SEED_SYSTEMD + "; " + COMMUNITY,
    "capture CUDA graphs for exactly the batch shapes decode uses",
)
def _graphs(c: Ctx) -> None:
    if c.is_cpu:
        return
    k = c.d.get("spec_k", 0)
    seqs = c.d["max_num_seqs"]
    if k:
        sizes = [(1 + k) * i for i in range(1, seqs + 1)]
        why = (
            f"every decode step verifies 1+{k} tokens per sequence: sizes cover "
            f"max_num_seqs x (1 + k) = {seqs} x {1 + k}"
        )
    else:
        sizes = sorted({1 << i for i in range(seqs.bit_length()) if 1 << i <= seqs} | {seqs})
        why = "decode batch sizes up to max_num_seqs"
    mode = c.s.cudagraph_mode or "PIECEWISE"
    if c.s.cudagraph_mode is None:
        why += (
            "; PIECEWISE: full CUDA graphs with MTP on the hybrid GDN layers can scramble output "
            "(seed 000 ran FULL_AND_PIECEWISE with TRITON_ATTN: set cudagraph_mode to opt in)"
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
def _async(c: Ctx) -> None:
    # vLLM turns async scheduling on by itself for MTP (config/vllm.py in 0.24.0 and later);
    # seed 002 turned it off on its 2080 Tis because it gained nothing at max_num_seqs 1. The
    # seeds that ran more sequences (000: 8, 004: 4) left vLLM's default, and so does vfleet.
    if c.s.async_scheduling is not None:
        c.arg("async-scheduling", c.s.async_scheduling, "operator setting")
    elif c.is_sm75 and c.d["max_num_seqs"] == 1:
        c.arg(
            "async-scheduling",
            False,
            "no gain at max_num_seqs 1 on SM75 (seed 002 measured and turned it off)",
        )


# =========================================================================== caching


@rule(
    "prefix-caching",
    SEED_A100 + "; " + SEED_TURBO3 + "; " + FIELD_NOTES + "; " + VLLM_SOURCE,
    "prefix caching on for hybrid models (align mode), off when the CPU build runs MTP",
)
def _prefix(c: Ctx) -> None:
    hybrid = c.model.arch.hybrid
    if c.is_cpu and hybrid and c.d["spec_method"] == "mtp":
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
        c.d["prefix_caching"] = False
        return
    want = c.s.prefix_caching if c.s.prefix_caching is not None else True
    c.d["prefix_caching"] = want
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
def _chunked(c: Ctx) -> None:
    need_align = c.model.arch.hybrid and c.d.get("prefix_caching")
    mbt = c.d.get("max_num_batched_tokens")
    long_ctx = mbt is not None and c.d["max_model_len"] > mbt
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


# =========================================================================== multi-GPU


@rule(
    "all-reduce",
    SEED_SYSTEMD + "; " + SEED_TURBO3 + "; " + COMMUNITY,
    "custom all-reduce over NVLink, NCCL otherwise, from the host's real topology",
)
def _allreduce(c: Ctx) -> None:
    tp = c.d.get("tp", 1)
    if c.is_cpu or tp < 2:
        return
    if c.s.custom_all_reduce is True:
        c.info("custom all-reduce left on (operator setting)")
        return
    if c.s.custom_all_reduce is False:
        c.arg("disable-custom-all-reduce", True, "operator setting")
        return
    gpus = c.s.gpus or list(range(tp))
    links = group_links(c.host.gpu_topology, gpus[:tp])
    if links == "nvlink":
        c.info(
            f"custom all-reduce left on: GPUs {gpus[:tp]} are NVLink-connected on every pair "
            "(nvidia-smi topo -m on the host), as on seed 002's box"
        )
    elif links == "pcie":
        c.arg(
            "disable-custom-all-reduce",
            True,
            f"GPUs {gpus[:tp]} are not NVLink-connected on every pair (nvidia-smi topo -m on the "
            "host): NCCL; custom all-reduce over PCIe was unstable on these cards (seed 004)",
        )
    else:
        c.arg(
            "disable-custom-all-reduce",
            True,
            "the GPU topology is not known here (a deploy reads nvidia-smi topo -m on the host "
            "and leaves custom all-reduce on over NVLink); NCCL is safe on any link. "
            "custom_all_reduce: true forces it on",
        )


@rule(
    "multimodal-profiling", SEED_SYSTEMD, "do not reserve VRAM for image profiling on 22 GB cards"
)
def _mm(c: Ctx) -> None:
    if c.s.language_model_only:
        c.arg("language-model-only", True, "text only: the vision tower is not loaded", SEED_BOOST)
    elif c.model.arch.multimodal and c.is_sm75:
        c.arg(
            "skip-mm-profiling",
            True,
            "the vision tower's profiling run costs KV capacity on 22 GB cards",
        )


# =========================================================================== API surface


@rule("parsers", SEED_A100 + "; " + SEED_SYSTEMD, "Qwen3 reasoning and tool-call parsers")
def _parsers(c: Ctx) -> None:
    reasoning = c.s.reasoning_parser or c.model.reasoning_parser
    if reasoning:
        c.arg("reasoning-parser", reasoning, "separates <think> content from the answer")
    tools = c.s.tool_call_parser or c.model.tool_call_parser
    if tools:
        auto = c.s.enable_auto_tool_choice if c.s.enable_auto_tool_choice is not None else True
        if auto:
            c.arg("enable-auto-tool-choice", True, "let the model decide to call tools")
        c.arg(
            "tool-call-parser",
            tools,
            "Qwen3's chat template emits <tool_call> XML; "
            "qwen3_coder parses it (fewer lost tool calls than hermes)",
        )


@rule("bench-thinking-off", SEED_A100, "benchmarks run with thinking disabled")
def _bench(c: Ctx) -> None:
    if c.s.purpose == "bench":
        c.arg(
            "default-chat-template-kwargs",
            {"enable_thinking": False},
            "the qwen3 reasoning parser can hide thinking tokens: they count in usage but "
            "appear in neither content nor reasoning, faking decode figures",
        )


@rule("observability", SEED_A100 + "; " + SEED_BOOST, "details needed to measure the server")
def _obs(c: Ctx) -> None:
    c.arg(
        "enable-prompt-tokens-details",
        True,
        "reports cached prompt tokens per request (cold vs warm TTFT)",
    )
    if c.s.log_requests:
        c.arg("enable-log-requests", True, "operator setting")
    c.arg(
        "disable-uvicorn-access-log",
        True,
        "health probes every few seconds would flood the log",
        SEED_SYSTEMD,
    )


# The sidecar listens next to vLLM: port + 1500 by default (8000 -> 9500), so two instances on
# one host get two sidecars without configuration, and 9400 (NVIDIA's DCGM exporter) stays free.
SIDECAR_PORT_OFFSET = 1500


@rule("sidecar", "docs/OBSERVABILITY.md", "a metrics sidecar next to every instance")
def _sidecar(c: Ctx) -> None:
    port = int(c.d["port"])
    sidecar = c.s.sidecar_port or port + SIDECAR_PORT_OFFSET
    if sidecar == port or sidecar > 65535:
        raise Refused(
            "sidecar",
            f"the sidecar port {sidecar} collides with vLLM's port or is out of range",
            "set sidecar_port to a free port other than the vLLM port",
            "vfleet",
        )
    c.d["sidecar_port"] = sidecar
    c.d["sidecar_window_s"] = c.s.sidecar_window_s or 60


@rule(
    "drain",
    "docs/SOURCES.md#upstream (vLLM --shutdown-timeout, 0.18+)",
    "drain in-flight requests on SIGTERM",
)
def _drain(c: Ctx) -> None:
    t = c.s.shutdown_timeout_s if c.s.shutdown_timeout_s is not None else SHUTDOWN_TIMEOUT_S
    c.d["shutdown_timeout_s"] = t
    c.arg(
        "shutdown-timeout",
        t,
        "SIGTERM waits this long for in-flight requests instead of "
        "failing them with HTTP 500 (the default is 0)",
    )


@rule(
    "restart-policy",
    "docs/SOURCES.md#observed (the API server exits 0 when its engine dies; "
    "crash loop 23 restarts/min)",
    "restart on any exit, but stop a crash loop with a start limit",
)
def _restart_policy(c: Ctx) -> None:
    c.d["restart_sec"] = c.s.restart_sec if c.s.restart_sec is not None else 10
    c.d["start_limit_burst"] = c.s.start_limit_burst or 3


# =========================================================================== overrides


@rule(
    "auto-memory",
    "vfleet planner (docs/PLANNER.md): vLLM's memory terms from its source; " + SEED_TURBO3,
    "size the KV cache from the capacity plan when the deployment leaves memory unset",
)
def _auto_memory(c: Ctx) -> None:
    if not c.d.get("auto_memory"):
        return
    from vfleet.engine.gpu_memory import GIB, MIB, auto_memory
    from vfleet.engine.planner import inputs_from, kv_plan, memory_model

    args = {k: e.value for k, e in c.args.items()}
    model = memory_model(c.profile, c.model, c.d, args, c.stack.vllm)
    cal = c.profile.calibration
    auto = auto_memory(
        model,
        cal.tested_gpu_memory_utilization if cal else None,
        cal.tested_by if cal else "",
    )
    fit = auto.kv_bytes if auto.use_bytes else model.available_kv(auto.utilization)
    plan = kv_plan(inputs_from(c.profile, c.model.arch, c.d, args, max(fit, 0), c.stack.vllm))
    if plan.num_blocks < plan.blocks_per_request and c.strict_memory:
        c.refuse(
            f"one {c.d['max_model_len']}-token request needs {plan.blocks_per_request} KV blocks "
            f"({plan.blocks_per_request * plan.bytes_per_block / GIB:.2f} GiB per GPU); after "
            f"the weights and the other memory terms {max(fit, 0) / GIB:.2f} GiB fit",
            "run `vfleet plan` for the smallest change that fits (shorter max_model_len, fp8 "
            "KV, fewer draft tokens, more GPUs)",
        )
    if not auto.use_bytes:
        c.arg(
            "gpu-memory-utilization",
            auto.utilization,
            f"{auto.utilization_source}; not --kv-cache-memory-bytes: {auto.why}; predicted "
            f"~{plan.kv_cache_tokens:,} KV tokens (+/- "
            f"{model.profiled_uncertainty / MIB:.0f} MiB of KV), vLLM measures the rest",
        )
        return
    c.arg(
        "kv-cache-memory-bytes",
        max(plan.num_blocks * plan.bytes_per_block, 1),  # whole blocks, nothing wasted
        f"planner: {plan.num_blocks} blocks of {plan.block_size} tokens = "
        f"{plan.kv_cache_tokens:,} KV tokens, {plan.max_concurrency:.2f}x at "
        f"{c.d['max_model_len']} tokens; {auto.why}",
    )


@rule(
    "operator-overrides",
    "vfleet operator setting (deployment file or --set)",
    "extra_args and extra_env, verbatim",
)
def _overrides(c: Ctx) -> None:
    for key, value in (c.s.extra_args or {}).items():
        if key in c.args:
            c.warn(
                f"extra_args overrides --{key} (was {c.args[key].value!r} from rule "
                f"{c.args[key].rule})"
            )
            del c.args[key]
        c.arg(key, value, "operator override (extra_args)")
    sleep = (c.s.extra_args or {}).get("enable-sleep-mode")
    kv = c.args.get("kv-cache-dtype")
    if (
        str(sleep).lower() == "true"
        and kv is not None
        and str(kv.value).startswith("fp8")
        and c.model.arch.hybrid
        and v(c.version) < v(SLEEP_FP8_HYBRID_WAKE_FIXED_IN)
    ):
        c.refuse(
            f"enable-sleep-mode with {kv.value} KV on a hybrid model: vLLM {c.version}'s "
            "wake_up fails on the GDN state (init_fp8_kv_scales) and leaves the engine paused",
            "set kv_cache_dtype auto, or use a stack with vLLM >= "
            + SLEEP_FP8_HYBRID_WAKE_FIXED_IN,
            VLLM_SOURCE + "; docs/GPU.md (H200 lane)",
        )
    for key, value in (c.s.extra_env or {}).items():
        if key == API_KEY_ENV:
            raise VfleetError(
                "the API key does not belong in extra_env",
                key="extra_env",
                fix="set api_key (it goes into the 0600 env file)",
            )
        c.setenv(key, str(value), "operator override (extra_env)")


def apply(
    profile: HardwareProfile,
    model: ModelPreset,
    stack_name: str,
    settings: ServeSettings,
    host: HostVars,
    strict_memory: bool = True,
) -> Ctx:
    ctx = Ctx(
        profile=profile,
        model=model,
        stack_name=stack_name,
        s=settings,
        host=host,
        strict_memory=strict_memory,
    )
    for r in RULES:
        ctx.current = r
        r.fn(ctx)
    ctx.current = None
    return ctx
