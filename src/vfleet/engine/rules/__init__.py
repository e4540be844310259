"""The knowledge base: named rules that turn a deployment into vLLM arguments and env.

Each rule states what it does, why, and where that was learned (a seed write-up, the
community findings, or vLLM's own source). Rules run in order over a shared context; they
set an argument or env var, warn, or refuse a known-bad combination with the fix.
Operator settings always win over a rule's default, but never over a refusal.
`vfleet explain` prints every decision with its rule, reason and source.

The rules live by concern in this package: identity, hardware, memory, speculative, caching,
multigpu, api_surface and overrides (the sections of the order below); core holds what they
share (Rule, Ctx and its effects, the sources they cite). RULES is the one ordered table
apply() runs: a rule reads only what the rules before it decided (vfleet.engine.decisions).
"""

from __future__ import annotations

from vfleet.config.schema import HardwareProfile, HostVars, ModelPreset, ServeSettings
from vfleet.engine.decisions import Decisions, DraftVocabBuild
from vfleet.engine.rules import (
    api_surface,
    caching,
    hardware,
    identity,
    memory,
    multigpu,
    overrides,
    speculative,
)
from vfleet.engine.rules.core import Ctx, Entry, Note, Rule
from vfleet.engine.rules.hardware import (
    CACHE_ENV,
    DRAFT_VOCAB_FILE,
    plugin_state_file,
)
from vfleet.engine.rules.identity import API_KEY_ENV

__all__ = [
    "API_KEY_ENV",
    "CACHE_ENV",
    "DRAFT_VOCAB_FILE",
    "RULES",
    "Ctx",
    "Decisions",
    "DraftVocabBuild",
    "Entry",
    "Note",
    "Rule",
    "apply",
    "plugin_state_file",
]

# The order is the knowledge base's: later rules build on earlier decisions, and of two rules
# that touch one argument the later wins (operator-overrides last). tests/unit/test_rules.py
# holds the recorded order.
RULES: tuple[Rule, ...] = (
    # identity (where it listens follows what may leave the box: api_surface.front)
    identity.model,
    api_surface.front,
    identity.listen,
    identity.api_key_in_env,
    # hardware
    hardware.device_fits_profile,
    hardware.devices,
    hardware.tensor_parallel,
    hardware.dtype_half_sm75,
    hardware.quantization,
    hardware.attention_backend,
    hardware.cuda_env,
    hardware.cpu_kv_space,
    hardware.threads,
    hardware.caches,
    # memory
    memory.context_and_batch,
    memory.gpu_memory,
    # speculative
    speculative.speculative,
    speculative.cudagraphs,
    speculative.async_scheduling,
    # the plugin's draft-prune follows MTP's depth and TP
    hardware.plugin,
    # caching
    caching.prefix_caching,
    caching.chunked_prefill,
    # multigpu
    multigpu.all_reduce,
    multigpu.multimodal_profiling,
    # api_surface
    api_surface.parsers,
    api_surface.bench_thinking_off,
    api_surface.observability,
    api_surface.sidecar,
    api_surface.drain,
    api_surface.restart_policy,
    api_surface.sleep_mode,
    # overrides
    overrides.auto_memory,
    overrides.operator_overrides,
)


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
    ctx.d.seal()
    return ctx
