"""What the rules decided: the typed seam between the rules and everything downstream.

The rules (`vfleet.engine.rules`) turn a deployment into vLLM arguments and env (`Ctx.args`,
`Ctx.env`); the values that later rules build on, and that the planner, the warmup, the
renderers and the fleet operations read, are fields of one `Decisions` object. Each field is
set once, by the rule named in its docstring; `rules.apply()` seals the object when the last
rule has run, after which it is read-only (assigning raises `FrozenInstanceError`). Reading a
field that no rule has set yet raises `AttributeError` (a rule that reads a later rule's
decision), except for the fields with a default, which some paths never set.
"""

from __future__ import annotations

from dataclasses import MISSING, FrozenInstanceError, dataclass, fields
from typing import TYPE_CHECKING

from vfleet.config.schema import SpecMethod


@dataclass(frozen=True)
class DraftVocabBuild:
    """A draft vocabulary the deploy builds on the host with the model's own tokenizer."""

    out: str  # VFLEET_SM75_DRAFT_VOCAB
    corpus: str | None  # a file on the host; None: the plugin's shipped default corpus
    top: int


@dataclass(frozen=True)
class DraftPrune:
    """The SM75 plugin's draft-prune, where rule `plugin` turns it on."""

    k: int  # the table's size: the K built on the host, or the default K for another table
    rows: int  # LM head rows TP rank 0 copies at load for the pruned head (the planner's term)


@dataclass(init=False, kw_only=True)
class Decisions:
    """The values the rules decided, filled in rule order and sealed by `rules.apply()`."""

    # -- identity ------------------------------------------------------------------------
    model_dir: str
    """The model directory on the serving host (`--model`). Rule `model`."""

    served_model_name: str
    """The name clients put in a request's `model` (`--served-model-name`). Rule `model`."""

    host: str
    """The address clients connect to: vLLM's own, or its nginx front's (loopback unless set).
    Rule `front`."""

    port: int
    """The port clients connect to (vLLM's, or the front's). Rule `front`."""

    front: bool
    """Whether an nginx front listens on host:port and forwards only the allowed routes
    (vfleet.engine.api_routes) to vLLM. Rule `front`."""

    vllm_host: str
    """The address vLLM itself listens on (`--host`): `host`, or loopback behind the front.
    Rule `front`."""

    vllm_port: int
    """vLLM's own port: the API and /metrics (`--port`): `port`, or `port` + 10000 behind
    the front. Rule `front`."""

    # -- hardware ------------------------------------------------------------------------
    tp: int = 1
    """Tensor-parallel size: the GPUs of one TP group (`--tensor-parallel-size`). Rule
    `device-fits-profile`, on GPU profiles; 1 on the cpu profile."""

    backend: str | None = None
    """The attention backend of the target model, and of its MTP draft
    (`--attention-backend`). Rule `attention-backend`, on GPU profiles; None on the cpu
    profile (vLLM's CPU attention)."""

    draft_vocab_build: DraftVocabBuild | None = None
    """A draft vocabulary the deploy builds on the host for the SM75 plugin; None when the
    release ships one, the operator names one, the model has no MTP, or draft-prune is off.
    Rule `plugin`."""

    draft_prune: DraftPrune | None = None
    """The plugin's draft-prune where it is on (its cost model, or the `draft_prune` setting);
    None where it is off or the stack carries no plugin. Rule `plugin`."""

    # -- memory --------------------------------------------------------------------------
    max_model_len: int
    """The context window KV is planned for (`--max-model-len`). Rule `context-and-batch`."""

    max_num_seqs: int
    """Sequences the scheduler runs at once (`--max-num-seqs`). Rule `context-and-batch`."""

    max_num_batched_tokens: int | None = None
    """The prefill chunk (`--max-num-batched-tokens`) when the operator set one; None leaves
    vLLM's default. Rule `context-and-batch`."""

    auto_memory: bool = False
    """True when the deployment sets neither `gpu_memory_utilization` nor
    `kv_cache_memory_bytes`: the rule `auto-memory` sizes the KV cache from the capacity
    plan. Rule `gpu-memory`."""

    # -- speculative ---------------------------------------------------------------------
    spec_method: SpecMethod
    """Speculative decoding: `mtp` (the model's own MTP layers), `ngram` or `none`. Rule
    `speculative`."""

    spec_k: int
    """Draft tokens per step (`num_speculative_tokens`, the MTP depth); 0 without speculative
    decoding. Rule `speculative`."""

    # -- caching -------------------------------------------------------------------------
    prefix_caching: bool
    """Whether prefix caching is on (`--enable-prefix-caching`). Rule `prefix-caching`."""

    # -- API surface and service ---------------------------------------------------------
    sidecar_port: int
    """The metrics sidecar's port (vLLM's + 1500 unless set). Rule `sidecar`."""

    sidecar_window_s: int
    """The sidecar's rate window in seconds. Rule `sidecar`."""

    shutdown_timeout_s: int
    """How long vLLM drains in-flight requests on SIGTERM (`--shutdown-timeout`); the units
    and compose stop 30 s after it. Rule `drain`."""

    restart_sec: int
    """Seconds between a crash and the restart (systemd `RestartSec`, pm2 `restart_delay`).
    Rule `restart-policy`."""

    start_limit_burst: int
    """Restarts allowed within the start-limit interval before a crash loop is stopped
    (systemd `StartLimitBurst`). Rule `restart-policy`."""

    def seal(self) -> None:
        """Make the decisions read-only; every field without a default must be set by now."""
        missing = [
            f.name for f in fields(self) if f.name not in self.__dict__ and f.default is MISSING
        ]
        if missing:
            raise AssertionError(f"no rule decided {', '.join(missing)}")
        object.__setattr__(self, "_sealed", True)

    # Hidden from mypy, which would otherwise accept an assignment to any name.
    if not TYPE_CHECKING:

        def __setattr__(self, name, value):
            if self.__dict__.get("_sealed"):
                raise FrozenInstanceError(f"cannot assign to field {name!r}: decisions are sealed")
            if name not in _FIELDS:
                raise AttributeError(f"Decisions has no field {name!r}")
            if name in self.__dict__:
                raise AssertionError(f"decision {name} set twice")
            object.__setattr__(self, name, value)


_FIELDS = frozenset(f.name for f in fields(Decisions))
