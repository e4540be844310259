#!/usr/bin/env python3
"""GPU lane: vfleet's rendered configurations served by a real CUDA vLLM, and measured.

On any machine with a CUDA GPU and the profile's vLLM importable (docs/GPU.md):

    python bench/gpu_lane.py run --out OUT [--profile h200-141g] [--only main,no-mtp]
        [--python PY] [--pythonpath DIR] [--model-dir DIR]

For each configuration of the matrix (``MATRIX``: the profile's rendered defaults, then one or
two settings changed at a time) it renders the release with vfleet (the same vllm.yaml, env
file and launch.sh a deploy writes) under --base-dir, starts ``launch.sh``, waits for /health,
then runs what the configuration's roles ask for:

  first-request  TTFT of one streamed chat request right after /health (no warmup ran: the
                 record's ``after_warmup`` is false, the summary says "(no warmup)")
  probe          ``vfleet-probe --warmup --json``: all four tiers (live, models, serving, warm)
  greedy         fixed prompts at temperature 0: the texts (compared across configurations:
                 with and without MTP they must be identical) and the MTP counters' deltas
  sidecar        ``vfleet-exporter`` against the server: its figures against the same figures
                 computed by hand from raw /metrics scrapes taken at the same moments
  bench          ``vfleet bench run`` (decode and context scenarios, short)

and parses vLLM's log for the memory terms (GPU KV cache size, available KV memory, weights,
CUDA graph estimate and pool, activation peak, non-torch memory) and the start-up times. The
server is stopped by its process group. One JSON (lane.json), one markdown summary (lane.md)
and the logs (logs.tar.gz) are written to --out.

Back on any machine with vfleet (no GPU needed):

    python bench/gpu_lane.py report OUT/lane.json [--md FILE]

puts vfleet's planner prediction for each configuration beside what vLLM logged (error per
term). Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROFILE = "h200-141g"
DEFAULT_MODEL = "tiny-hybrid-mtp"
PORT = 8000
SIDECAR_PORT = 9500
GIB = 1 << 30

# --------------------------------------------------------------------------- the matrix


@dataclass(frozen=True)
class LaneConfig:
    """One configuration: --set overrides on top of the profile and model, and what to run."""

    name: str
    sets: tuple[str, ...]
    roles: tuple[str, ...]
    why: str
    # vLLM logs the activation peak and non-torch memory only at DEBUG.
    debug_log: bool = True
    # The SM75 plugin's draft-prune on, with a draft vocabulary built here for the model
    # (vfleet-sm75 vocab build over the plugin's default corpus, K as rule `plugin` takes it).
    draft_prune: bool = False
    # Build that vocabulary over the plugin's default corpus plus the greedy replies of the
    # configurations run before this one (the model's own text: a table that covers it).
    vocab_from_replies: bool = False
    # Another hardware profile whose render of the model this configuration serves on this
    # card, with that card's KV budget as its plan leaves it (emulated_sets).
    emulate: str | None = None


ROLES = ("first-request", "probe", "greedy", "sidecar", "bench", "sleep", "restart", "decode")
# Every configuration of the tiny model keeps within its 4096-token window.
BASE_SETS = ("max_model_len=4096",)
# --dummy-weights (a preset of a real checkpoint at its own size, from a config-only folder:
# config.json and a tokenizer, no weights): vLLM builds the architecture from config.json with
# random weights (--load-format dummy), and the multimodal class starts without an image
# processor only with the language model alone (--language-model-only: the vision tower is
# neither built nor profiled). Nothing else is changed: the window is the profile's own.
DUMMY_SETS = ("extra_args.load-format=dummy",)
MULTIMODAL_DUMMY_SETS = ("language_model_only=true",)
# vLLM 0.24.0 serves /sleep, /wake_up, /is_sleeping and /collective_rpc only with
# VLLM_SERVER_DEV_MODE=1 (entrypoints/openai/api_server.py); --enable-sleep-mode turns on the
# CuMem allocator that sleep needs (config/model.py).
# kv_cache_dtype auto: with fp8 KV on a hybrid model, vLLM 0.24.0's wake_up fails in
# init_fp8_kv_scales ('list' object has no attribute 'zero_': the GDN state entries are lists)
# and leaves the engine paused (H200 lane, docs/GPU.md).
SLEEP_SETS = (
    "extra_args.enable-sleep-mode=true",
    "extra_env.VLLM_SERVER_DEV_MODE=1",
    "kv_cache_dtype=auto",
)
MATRIX: tuple[LaneConfig, ...] = (
    LaneConfig(
        "main",
        (),
        ("first-request", "probe", "greedy", "sidecar"),
        "the profile's rendered defaults (FLASHINFER, fp8 KV, MTP 3, PIECEWISE graphs, prefix "
        "caching, chunked prefill, Qwen3 parsers); the first start on a fresh host is cold",
        debug_log=False,
    ),
    LaneConfig("no-mtp", ("speculative.method=none",), ("greedy",), "greedy reference, MTP off"),
    LaneConfig("kv-auto", ("kv_cache_dtype=auto",), ("greedy",), "bf16 KV instead of fp8"),
    LaneConfig("fp16", ("dtype=half",), ("greedy",), "fp16 compute (as SM75 renders) with fp8 KV"),
    LaneConfig(
        "no-prefix-caching",
        ("prefix_caching=false",),
        ("greedy",),
        "prefix caching (and the Mamba align mode it implies) off, as on the CPU build with MTP",
    ),
    LaneConfig(
        "main-restart",
        (),
        ("first-request", "greedy", "bench"),
        "main again: the caches of the earlier starts are warm",
        debug_log=False,
    ),
    LaneConfig(
        "util-0.5-seqs-16",
        ("gpu_memory_utilization=0.5", "max_num_seqs=16"),
        ("greedy",),
        "half the memory share, 16 sequences (capture sizes up to 64)",
    ),
    LaneConfig(
        "k1-mnbt-2048",
        ("speculative.num_speculative_tokens=1", "max_num_batched_tokens=2048"),
        ("greedy",),
        "MTP 1 and a 2048-token batch (capture sizes 2..8)",
    ),
    LaneConfig(
        "sleep",
        SLEEP_SETS,
        ("greedy", "sleep", "restart"),
        "main with --enable-sleep-mode: level 1 and level 2 sleep/wake cycles against full "
        "restarts of the same release (the fast-swap primitive)",
        debug_log=False,
    ),
    LaneConfig(
        "sleep-drafter",
        (*SLEEP_SETS, "extra_env.VFLEET_SM75=drafter-reload"),
        ("greedy", "sleep"),
        "sleep with the SM75 plugin's drafter-reload: reload_weights reloads the MTP drafter "
        "too, so a level 2 wake keeps MTP acceptance (against sleep, where it falls to 0)",
        debug_log=False,
    ),
    LaneConfig(
        "real",
        (),
        ("first-request",),
        "the rendered defaults at DEBUG (every memory term in the log): with --dummy-weights a "
        "27B preset at its own size; the first start on a fresh host is cold",
    ),
    LaneConfig(
        "real-restart",
        (),
        ("first-request",),
        "real again, on the caches real left: a warm restart (to /health and the first token)",
    ),
    LaneConfig(
        "real-no-mtp",
        ("speculative.method=none",),
        ("first-request", "decode"),
        "MTP off: single-stream decode without speculation (against the HBM roofline: `report`)",
    ),
    # Issue 31 item 1: other configurations per preset, at DEBUG (every term in the log), each
    # one setting away from `real`; and the A100 profile's own render with its card emulated.
    LaneConfig(
        "real-32k",
        ("max_model_len=32768",),
        ("first-request", "decode"),
        "real with a 32K window instead of the profile's 256K (KV tokens, graph sizes unchanged)",
    ),
    LaneConfig(
        "real-seqs-8",
        ("max_num_seqs=8",),
        ("first-request",),
        "real with 8 sequences: capture sizes up to 16, the activation and graph terms grow",
    ),
    LaneConfig(
        "real-mtp1",
        ("speculative.num_speculative_tokens=1",),
        ("first-request", "decode"),
        "real with MTP 1: a step verifies 2 tokens, one draft pass (the cost model's depth 1)",
    ),
    LaneConfig(
        "a100-emulated",
        (),
        ("first-request", "decode"),
        "the a100-32g profile's own render of the model (its window, sequences, batch, KV "
        "dtype, backend, MTP depth) on this card, with the KV bytes its plan leaves on a 32 GB "
        "A100 as kv_cache_memory_bytes: the A100's KV pool at its real size, its page math "
        "and its decode (the other terms are this card's)",
        emulate="a100-32g",
    ),
    # Issue 31 item 5: the render's choices that move single-stream decode, at INFO (vLLM logs
    # two DEBUG lines per step), each against PIECEWISE (rule `cudagraphs`' default with MTP; its
    # default without MTP is FULL_AND_PIECEWISE since these pairs, docs/GPU.md section 11).
    LaneConfig(
        "nomtp-piecewise",
        ("speculative.method=none", "cudagraph_mode=PIECEWISE"),
        ("first-request", "greedy", "decode"),
        "MTP off, PIECEWISE graphs (the render's default before the graph-mode pair), at INFO: "
        "the baseline of the pair",
        debug_log=False,
    ),
    LaneConfig(
        "nomtp-full",
        ("speculative.method=none", "cudagraph_mode=FULL_AND_PIECEWISE"),
        ("first-request", "greedy", "decode"),
        "MTP off, FULL_AND_PIECEWISE: a decode step is one CUDA graph, not one graph per "
        "piece between the 64 attention and GDN layers (FlashInfer supports full graphs for "
        "single-token decode on SM90: UNIFORM_SINGLE_TOKEN_DECODE)",
        debug_log=False,
    ),
    LaneConfig(
        "mtp-triton-full",
        ("attention_backend=TRITON_ATTN", "cudagraph_mode=FULL_AND_PIECEWISE"),
        ("first-request", "greedy", "decode"),
        "MTP 3 with full decode graphs: vLLM 0.24.0 downgrades FULL decode graphs with "
        "spec-decode to PIECEWISE under FlashInfer on SM90 (UNIFORM_SINGLE_TOKEN_DECODE, "
        "config/compilation.py), so the attention is TRITON_ATTN (ALWAYS) for it",
        debug_log=False,
    ),
    # The decode cost model's depths (issue 31 item 5; docs/TUNE.md, "The cost model"): one
    # backend and full decode graphs throughout, so that only the depth (and the head) differs.
    LaneConfig(
        "nomtp-triton-full",
        (
            "speculative.method=none",
            "attention_backend=TRITON_ATTN",
            "cudagraph_mode=FULL_AND_PIECEWISE",
        ),
        ("first-request", "decode"),
        "MTP off with mtp-triton-full's backend and graphs: the cost model's depth 0",
        debug_log=False,
    ),
    LaneConfig(
        "mtp1-triton-full",
        (
            "speculative.num_speculative_tokens=1",
            "attention_backend=TRITON_ATTN",
            "cudagraph_mode=FULL_AND_PIECEWISE",
        ),
        ("first-request", "decode"),
        "MTP 1 with full decode graphs: the cost model's depth 1",
        debug_log=False,
    ),
    LaneConfig(
        "mtp-triton-full-pruned",
        (
            "attention_backend=TRITON_ATTN",
            "cudagraph_mode=FULL_AND_PIECEWISE",
            "extra_env.VFLEET_SM75=draft-prune",
        ),
        ("first-request", "decode"),
        "mtp-triton-full with the plugin's pruned head: the model's head bytes against the "
        "step with full graphs (PIECEWISE's host time hid any saving before)",
        debug_log=False,
        draft_prune=True,
    ),
    LaneConfig(
        "plugin-off",
        (),
        ("first-request", "greedy", "decode"),
        "main, the SM75 plugin installed but not asked for (VFLEET_SM75 unset): the baseline",
        debug_log=False,
    ),
    LaneConfig(
        "plugin-on",
        ("extra_env.VFLEET_SM75=draft-prune",),
        ("greedy", "decode"),
        "main with the plugin's draft-prune: MTP drafts from the K most frequent tokens",
        debug_log=False,
        draft_prune=True,
    ),
    LaneConfig(
        "plugin-on-covered",
        ("extra_env.VFLEET_SM75=draft-prune",),
        ("greedy", "decode"),
        "plugin-on with a table built over the default corpus plus the model's own greedy "
        "replies from the configurations before it (run after plugin-off): the default corpus "
        "misses 7 of the tiny model's 10 reply tokens",
        debug_log=False,
        draft_prune=True,
        vocab_from_replies=True,
    ),
)


def select(names: str | None) -> list[LaneConfig]:
    if not names:
        return list(MATRIX)
    by = {c.name: c for c in MATRIX}
    unknown = [n for n in names.split(",") if n not in by]
    if unknown:
        raise SystemExit(f"error: --only: unknown configuration(s) {unknown}; known: {list(by)}")
    return [by[n] for n in names.split(",")]


# --------------------------------------------------------------------------- vLLM's log

_NUM = r"([0-9][0-9,]*(?:\.[0-9]+)?)"
_LOG_PATTERNS: dict[str, str] = {
    "kv_tokens": rf"GPU KV cache size: {_NUM} tokens",
    "available_kv_gib": rf"Available KV cache memory: {_NUM} GiB",
    "weights_gib": rf"Model loading took {_NUM} GiB memory",
    "load_s": rf"Model loading took {_NUM} GiB memory and {_NUM} seconds",
    "cudagraph_estimate_gib": rf"Estimated CUDA graph memory: {_NUM} GiB total",
    "graph_capture_s": rf"Graph capturing finished in {_NUM} secs",
    "graph_pool_gib": rf"Graph capturing finished in {_NUM} secs, took {_NUM} GiB",
    "torch_peak_gib": rf"torch peak memory increase: {_NUM} ?GiB",
    "non_torch_gib": rf"non-torch forward increase memory: {_NUM} ?GiB",
    "non_kv_gib": rf"Total non KV cache memory: {_NUM} ?GiB",
    "requested_gib": rf"Requested memory: {_NUM} \(util\), {_NUM} GiB",
    "initial_free_gib": rf"Initial free memory: {_NUM} GiB",
    "init_engine_s": rf"init engine \(profile, create kv cache, warmup model\) took {_NUM} s",
    "compile_s": rf"torch\.compile took {_NUM} s in total",
    "max_concurrency": rf"Maximum concurrency for {_NUM} tokens per request: {_NUM}x",
}
# Which capture group holds the figure when a pattern has several.
_LOG_GROUP = {"load_s": 2, "graph_pool_gib": 2, "requested_gib": 2, "max_concurrency": 2}
_SLEEP_LINE = re.compile(rf"Sleep mode freed {_NUM} GiB memory, {_NUM} GiB memory is still in use")
_RELOAD_LINE = re.compile(rf"Reloading and processing weights took {_NUM} seconds")
# An error is a line vLLM logs at ERROR or CRITICAL, or an unlevelled traceback or exception
# line (a crashed process's stderr). A levelled line at DEBUG/INFO/WARNING is not, whatever it
# holds: the DEBUG env dump names VLLM_TOOL_JSON_ERROR_AUTOMATIC_RETRY and the ulimit WARNING
# mentions "OSError" on every healthy start.
_LEVEL = re.compile(r"^(?:\([^)]*\)\s+)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s")
_ERROR_LINE = re.compile(
    r"Traceback \(most recent call last\)|CUDA out of memory|EngineCore.*died"
    r"|^(?:\([^)]*\)\s+)?[A-Za-z_][\w.]*(?:Error|Exception)\b"
)


def is_error_line(line: str) -> bool:
    level = _LEVEL.match(line.strip())
    if level:
        return level.group(1) in ("ERROR", "CRITICAL")
    return bool(_ERROR_LINE.search(line.strip()))


@dataclass
class LogTerms:
    """The figures vLLM logged at start-up (GiB as vLLM rounds them: 2 decimals)."""

    kv_tokens: int | None = None
    available_kv_gib: float | None = None
    weights_gib: float | None = None
    load_s: float | None = None
    cudagraph_estimate_gib: float | None = None
    graph_capture_s: float | None = None
    graph_pool_gib: float | None = None
    torch_peak_gib: float | None = None
    non_torch_gib: float | None = None
    non_kv_gib: float | None = None
    requested_gib: float | None = None
    initial_free_gib: float | None = None
    init_engine_s: float | None = None
    compile_s: float | None = None
    max_concurrency: float | None = None
    attention_backends: list[str] = field(default_factory=list)
    # One entry per /sleep: "Sleep mode freed X GiB memory, Y GiB memory is still in use."
    sleep_freed_gib: list[float] = field(default_factory=list)
    sleep_in_use_gib: list[float] = field(default_factory=list)
    # "Reloading and processing weights took X seconds" (logged once per process)
    reload_s: float | None = None
    # the SM75 plugin's one-line decision ("vfleet-sm75 0.1.0 on vLLM ...: draft-prune=...")
    plugin_lines: list[str] = field(default_factory=list)
    # drafter-reload's line per reload_weights call: what it reloaded and how long it took
    drafter_lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def parse_log(text: str) -> LogTerms:
    """The first occurrence of each figure (the target model's; a draft logs after it)."""
    out = LogTerms()
    for key, pattern in _LOG_PATTERNS.items():
        m = re.search(pattern, text)
        if not m:
            continue
        raw = m.group(_LOG_GROUP.get(key, 1)).replace(",", "")
        setattr(out, key, int(raw) if key == "kv_tokens" else float(raw))
    # "Using FLASHINFER attention backend ..." or (0.24.0) "Using AttentionBackendEnum.X backend."
    out.attention_backends = sorted(
        set(re.findall(r"Using (?:AttentionBackendEnum\.)?(\w+) (?:attention )?backend", text))
        - {"TRITON"}  # "Using TRITON Unquantized MoE backend" is the MoE's
    )
    for m in _SLEEP_LINE.finditer(text):
        out.sleep_freed_gib.append(float(m.group(1).replace(",", "")))
        out.sleep_in_use_gib.append(float(m.group(2).replace(",", "")))
    if m := _RELOAD_LINE.search(text):
        out.reload_s = float(m.group(1))
    out.plugin_lines = sorted(
        {
            ln[ln.index("vfleet-sm75 ") :][:400]
            for ln in text.splitlines()
            if " on vLLM " in ln and "vfleet-sm75 " in ln
        }
    )
    out.drafter_lines = [
        ln[ln.index("drafter-reload") :][:300]
        for ln in text.splitlines()
        if "vfleet-sm75: drafter-reload" in ln
    ]
    out.errors = [ln.strip()[:300] for ln in text.splitlines() if is_error_line(ln)][:20]
    return out


# --------------------------------------------------------------------------- /metrics

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def counter_sums(text: str) -> dict[str, float]:
    """Raw Prometheus text -> name (with the `position` label kept) -> value summed over the
    other labels. Deliberately not the sidecar's parser: the sidecar is checked against it."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.group(1), m.group(2) or "", m.group(3)
        pos = re.search(r'position="(\d+)"', labels)
        key = f"{name}/{pos.group(1)}" if pos else name
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


@dataclass
class SpecDelta:
    """MTP and decode figures from the counter deltas between two scrapes."""

    drafts: float
    draft_tokens: float
    accepted: float
    generation_tokens: float
    steps: float
    seconds: float
    acceptance: float | None
    mean_acceptance_length: float | None
    per_position: dict[str, float]
    decode_tokens_per_s: float | None
    tokens_per_step: float | None


def spec_delta(before: dict[str, float], after: dict[str, float], seconds: float) -> SpecDelta:
    def d(key: str) -> float:
        return max(0.0, after.get(key, 0.0) - before.get(key, 0.0))

    drafts = d("vllm:spec_decode_num_drafts_total")
    tokens = d("vllm:spec_decode_num_draft_tokens_total")
    accepted = d("vllm:spec_decode_num_accepted_tokens_total")
    gen = d("vllm:generation_tokens_total")
    steps = d("vllm:iteration_tokens_total_count")
    prefix = "vllm:spec_decode_num_accepted_tokens_per_pos_total/"
    per_pos = {
        k[len(prefix) :]: d(k) / drafts for k in sorted(after) if k.startswith(prefix) and drafts
    }
    return SpecDelta(
        drafts=drafts,
        draft_tokens=tokens,
        accepted=accepted,
        generation_tokens=gen,
        steps=steps,
        seconds=round(seconds, 3),
        acceptance=accepted / tokens if tokens else None,
        mean_acceptance_length=1 + accepted / drafts if drafts else None,
        per_position=per_pos,
        decode_tokens_per_s=gen / seconds if seconds > 0 else None,
        tokens_per_step=gen / steps if steps else None,
    )


def cache_info(text: str) -> dict[str, str]:
    """vllm:cache_config_info's labels: num_gpu_blocks, block_size, cache_dtype, ..."""
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            return dict(re.findall(r'(\w+)="([^"]*)"', line))
    return {}


def exporter_figures(text: str) -> dict[str, float]:
    """The sidecar's vfleet_* gauges (position kept as a suffix)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or not m.group(1).startswith("vfleet_"):
            continue
        pos = re.search(r'position="(\d+)"', m.group(2) or "")
        key = m.group(1) + (f"/{pos.group(1)}" if pos else "")
        try:
            out[key] = float(m.group(3))
        except ValueError:
            continue
    return out


# (sidecar gauge, SpecDelta attribute) pairs compared in the sidecar check
SIDECAR_PAIRS = (
    ("vfleet_spec_decode_acceptance_rate", "acceptance"),
    ("vfleet_spec_decode_mean_acceptance_length", "mean_acceptance_length"),
    ("vfleet_tokens_per_step", "tokens_per_step"),
    ("vfleet_decode_tokens_per_second", "decode_tokens_per_s"),
)


def compare_sidecar(sidecar: dict[str, float], hand: SpecDelta) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for gauge, attr in SIDECAR_PAIRS:
        rows.append({"figure": gauge, "sidecar": sidecar.get(gauge), "hand": getattr(hand, attr)})
    for pos, rate in hand.per_position.items():
        rows.append(
            {
                "figure": f"vfleet_spec_decode_position_acceptance_rate/{pos}",
                "sidecar": sidecar.get(f"vfleet_spec_decode_position_acceptance_rate/{pos}"),
                "hand": rate,
            }
        )
    for row in rows:
        s, h = row["sidecar"], row["hand"]
        row["rel_err"] = abs(s - h) / abs(h) if s is not None and h else None
    return rows


# --------------------------------------------------------------------------- HTTP

# A chat request's timeout, streamed or not: the first request after /health pays the JIT that
# start-up left; a cold kv-auto start (FlashInfer compiling its bf16-KV kernels) outlasted 120 s,
# the engine finishing ~130 s after the request (docs/GPU.md section 4).
REQUEST_TIMEOUT_S = 300.0


def http(
    path: str, body: dict[str, Any] | None = None, timeout: float = 120, port: int = PORT
) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read() if exc.fp else b""
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc).encode()


def scrape(port: int = PORT) -> str:
    status, raw = http("/metrics", timeout=10, port=port)
    return raw.decode("utf-8", "replace") if status == 200 else ""


GREEDY_PROMPTS = (
    "Tell me about the quick brown fox.",
    "Write one sentence about GPUs.",
    "What is 2 + 2?",
)


def chat(model: str, prompt: str, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 0,
    }
    t0 = time.perf_counter()
    if not stream:
        status, raw = http("/v1/chat/completions", body, timeout=REQUEST_TIMEOUT_S)
        took = time.perf_counter() - t0
        if status != 200:
            return {"ok": False, "status": status, "error": raw[:500].decode("utf-8", "replace")}
        msg = json.loads(raw)["choices"][0]["message"]
        return {
            "ok": True,
            "seconds": round(took, 4),
            "content": msg.get("content"),
            "reasoning": msg.get("reasoning_content") or msg.get("reasoning"),
        }
    body["stream"] = True
    req = urllib.request.Request(
        f"http://127.0.0.1:{PORT}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    ttft = None
    chunks = 0
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
            for line in resp:
                if line.startswith(b"data: ") and b"[DONE]" not in line:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    chunks += 1
    except (urllib.error.URLError, OSError) as exc:
        return {"ok": False, "error": str(exc)}
    return {
        "ok": ttft is not None,
        "ttft_s": round(ttft, 4) if ttft is not None else None,
        "total_s": round(time.perf_counter() - t0, 4),
        "chunks": chunks,
    }


# --------------------------------------------------------------------------- one server


@dataclass
class Host:
    """Where the lane renders and runs: a vfleet base folder on this machine."""

    base: Path
    python: str
    pythonpath: str
    cuda_home: str
    model_dir: Path
    profile: str
    model: str
    # --set: added to every configuration (e.g. extra_args.gdn-prefill-backend=triton)
    sets: tuple[str, ...] = ()
    # --repeats: sleep/wake cycles per level and full restarts in the `sleep` configuration
    repeats: int = 3
    # BASE_SETS for the generated models; DUMMY_SETS (and no window) with --dummy-weights
    base_sets: tuple[str, ...] = BASE_SETS

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        extra = [
            p for p in (self.pythonpath, str(REPO / "src"), str(REPO / "healthcheck/src")) if p
        ]
        env["PYTHONPATH"] = os.pathsep.join([*extra, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env


def launch_of(host: Host, cfg: LaneConfig, extra: Sequence[str] = ()) -> Any:
    """vfleet's Launch of `cfg` on `host`: the profile and model with the lane's settings."""
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.config.schema import HostVars
    from vfleet.engine.compile import resolve

    return resolve(
        host.profile,
        host.model,
        sets=[*host.base_sets, *host.sets, *cfg.sets, *extra],
        host=HostVars(base_dir=str(host.base), cuda_home=host.cuda_home),
    )


def resolve_values(host: Host, cfg: LaneConfig) -> dict[str, Any]:
    """The rendered vLLM arguments of `cfg` (what vllm.yaml holds), by flag name."""
    values: dict[str, Any] = launch_of(host, cfg).config_values()
    return values


def served_name(host: Host) -> str:
    """The model name requests must ask for: the preset's served_model_name (the 27B presets
    serve as e.g. qwen-local, not under the preset's name), else the preset's name."""
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.config.profiles import load_model

    return load_model(host.model).served_model_name or host.model


def render(host: Host, cfg: LaneConfig, extra: Sequence[str] = ()) -> Path:
    """Render the release of `cfg` under base/instances/main/releases/<name> and point
    base/instances/main/current at it (the probe's rendered paths expect that)."""
    from vfleet.render.release import render_files, write_atomic

    launch = launch_of(host, cfg, extra)
    inst = host.base / "instances" / "main"
    rel = inst / "releases" / cfg.name
    write_atomic(render_files(launch), rel)
    current = inst / "current"
    if current.is_symlink() or current.exists():
        current.unlink()
    current.symlink_to(rel)
    (inst / "state").mkdir(parents=True, exist_ok=True)
    (inst / "home").mkdir(parents=True, exist_ok=True)
    return rel


def prepare_host(host: Host, stack_venv: str) -> None:
    """The venv path launch.sh execs: a wrapper around the given python (and PYTHONPATH)."""
    venv_bin = host.base / "venvs" / stack_venv / "bin"
    venv_bin.mkdir(parents=True, exist_ok=True)
    wrapper = venv_bin / "python"
    path = host.pythonpath
    wrapper.write_text(
        "#!/bin/sh\n"
        + (f'export PYTHONPATH="{path}${{PYTHONPATH:+:$PYTHONPATH}}"\n' if path else "")
        + f'exec "{host.python}" "$@"\n',
        encoding="utf-8",
    )
    wrapper.chmod(0o755)
    models = host.base / "models"
    models.mkdir(parents=True, exist_ok=True)
    link = models / host.model
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(host.model_dir.resolve())


def port_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def runs_at_debug(cfg: LaneConfig, rel: Path) -> bool:
    """Whether vLLM logs at DEBUG when `start` starts the release: launch.sh sources vllm.env
    after the lane's environment, so a level rendered there (--set
    extra_env.VLLM_LOGGING_LEVEL=...) wins over the configuration's own."""
    env = (rel / "vllm.env").read_text(encoding="utf-8")
    m = re.search(r"^VLLM_LOGGING_LEVEL=['\"]?(\w*)", env, re.MULTILINE)
    return m.group(1).upper() == "DEBUG" if m else cfg.debug_log


def start(rel: Path, log: Path, debug: bool, pidfile: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    if debug:
        env["VLLM_LOGGING_LEVEL"] = "DEBUG"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            ["sh", str(rel / "launch.sh")],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    pidfile.write_text(str(proc.pid), encoding="utf-8")
    return proc


def stop_leftover(pidfile: Path) -> bool:
    """Stop the server an interrupted run of this lane left behind (its own process group)."""
    try:
        pgid = int(pidfile.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    pidfile.unlink()
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return False
    time.sleep(3)
    return True


def wait_ready(proc: subprocess.Popen[bytes], timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            return None
        if http("/health", timeout=5)[0] == 200:
            return round(time.monotonic() - t0, 2)
        time.sleep(0.5)
    return None


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=15)
    except ProcessLookupError:
        pass


def gpu_used_mib() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        return int(out.split()[0])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def dir_mib(path: Path) -> float:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, f)).st_size
    return round(total / (1 << 20), 1)


def run_greedy(model: str) -> dict[str, Any]:
    before = counter_sums(scrape())
    t0 = time.monotonic()
    replies = [chat(model, p, 96) for p in GREEDY_PROMPTS]
    delta = spec_delta(before, counter_sums(scrape()), time.monotonic() - t0)
    return {"replies": replies, "spec": asdict(delta)}


def greedy_texts(greedy: dict[str, Any]) -> list[tuple[Any, Any]]:
    return [(x.get("reasoning"), x.get("content")) for x in greedy["replies"]]


def post(path: str, body: dict[str, Any] | None = None, timeout: float = 300) -> dict[str, Any]:
    """POST to the server and time it (the dev endpoints answer when the engine is done)."""
    t0 = time.perf_counter()
    status, raw = http(path, body if body is not None else {}, timeout=timeout)
    out: dict[str, Any] = {"status": status, "seconds": round(time.perf_counter() - t0, 3)}
    if status != 200:
        out["error"] = raw[:300].decode("utf-8", "replace")
    return out


def sleep_cycle(
    model: str, level: int, ref: list[tuple[Any, Any]], reload: bool = True
) -> dict[str, Any]:
    """One /sleep + wake: times, GPU memory (nvidia-smi) before / asleep / awake, and the first
    request after the wake (TTFT, greedy texts against `ref`, MTP acceptance).

    Level 1 offloads the weights to CPU memory and drops the KV cache; a plain /wake_up brings
    both back. Level 2 drops the weights too: the weights are woken (empty), reloaded from disk
    with vLLM's reload_weights, then the KV cache is woken, as vLLM's own tests do. With
    reload=False a level 2 wake is a plain /wake_up (the weights are whatever the memory holds).
    """
    rec: dict[str, Any] = {"level": level, "reload": reload, "mib_before": gpu_used_mib()}
    rec["sleep"] = post(f"/sleep?level={level}")
    rec["is_sleeping"] = json.loads(http("/is_sleeping", timeout=10)[1] or b"{}").get("is_sleeping")
    rec["mib_asleep"] = gpu_used_mib()
    t0 = time.perf_counter()
    if level == 2 and reload:
        rec["wake_weights"] = post("/wake_up?tags=weights")
        rec["reload_weights"] = post("/collective_rpc", {"method": "reload_weights"})
        rec["wake_kv"] = post("/wake_up?tags=kv_cache")
    else:
        rec["wake"] = post("/wake_up")
    rec["wake_total_s"] = round(time.perf_counter() - t0, 3)
    rec["mib_awake"] = gpu_used_mib()
    posts = [v for k, v in rec.items() if isinstance(v, dict) and "status" in v]
    if any(p["status"] != 200 for p in posts):
        rec["first_request"] = {"ok": False, "error": "a sleep or wake call failed"}
        rec["greedy_same"], rec["acceptance"] = False, None
        return rec
    rec["first_request"] = chat(model, "[wake] " + GREEDY_PROMPTS[1], 32, True)
    greedy = run_greedy(model)
    rec["greedy_same"] = all(r.get("ok") for r in greedy["replies"]) and greedy_texts(greedy) == ref
    rec["acceptance"] = greedy["spec"]["acceptance"]
    if not rec["greedy_same"]:
        rec["greedy"] = greedy["replies"]
    return rec


def run_sleep(model: str, repeats: int) -> dict[str, Any]:
    """`repeats` level 1 and level 2 cycles, then one level 2 wake without a weight reload."""
    ref = run_greedy(model)
    ref_texts = greedy_texts(ref)
    cycles: list[dict[str, Any]] = []
    for level, reload in [(1, True)] * repeats + [(2, True)] * repeats + [(2, False)]:
        cycles.append(sleep_cycle(model, level, ref_texts, reload))
        if not cycles[-1]["first_request"].get("ok"):
            break  # a failed wake leaves the engine paused: stop here
    return {"reference": ref["replies"], "cycles": cycles}


DECODE_TOKENS = 512


def run_decode(model: str, repeats: int) -> dict[str, Any]:
    """Single-stream decode speed: one request of DECODE_TOKENS at a time (the wired models
    never stop early), generation tokens from the counters over the request's wall time."""
    runs: list[dict[str, Any]] = []
    for _ in range(repeats):
        before = counter_sums(scrape())
        t0 = time.monotonic()
        reply = chat(model, "[decode] " + GREEDY_PROMPTS[0], DECODE_TOKENS)
        delta = spec_delta(before, counter_sums(scrape()), time.monotonic() - t0)
        runs.append({"ok": reply.get("ok"), **asdict(delta)})
    rates = sorted(r["decode_tokens_per_s"] for r in runs if r["decode_tokens_per_s"])
    return {"runs": runs, "median_tokens_per_s": rates[len(rates) // 2] if rates else None}


def run_restarts(
    rel: Path,
    procs: list[subprocess.Popen[bytes]],
    model: str,
    logdir: Path,
    name: str,
    repeats: int,
    timeout: float,
    pidfile: Path,
    out: list[dict[str, Any]],
) -> None:
    """Full restarts of the same release (caches warm): stop, start, /health, first token.
    procs[0] is the running server (replaced in place, so an interrupted run stops the right
    one); each restart's figures are appended to `out` as they come."""
    for i in range(repeats):
        t0 = time.perf_counter()
        stop(procs[0])
        stopped = time.perf_counter() - t0
        procs[0] = start(rel, logdir / f"{name}.restart{i + 1}.log", False, pidfile)
        ready = wait_ready(procs[0], timeout)
        rec: dict[str, Any] = {"stop_s": round(stopped, 2), "ready_s": ready}
        if ready is not None:
            rec["first_request"] = chat(model, "[restart] " + GREEDY_PROMPTS[1], 32, True)
        rec["to_first_token_s"] = round(time.perf_counter() - t0, 2)
        out.append(rec)
        if ready is None:
            break


def run_probe(host: Host, rel: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    res = subprocess.run(
        [
            host.python,
            "-m",
            "vfleet_healthcheck.probe",
            "--config",
            str(rel / "probe.json"),
            "--warmup",
            "--json",
            "--timeout",
            "300",
        ],
        capture_output=True,
        text=True,
        env={**host.env(), "VFLEET_PROBE_STATE": str(host.base / "instances/main/state")},
        timeout=600,
        check=False,
    )
    out: dict[str, Any] = {"rc": res.returncode, "seconds": round(time.monotonic() - t0, 2)}
    try:
        out["report"] = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        out["stdout"], out["stderr"] = res.stdout[-2000:], res.stderr[-2000:]
    return out


def run_sidecar(host: Host, rel: Path, model: str, logdir: Path) -> dict[str, Any]:
    cmd = [host.python, "-m", "vfleet_healthcheck.exporter", "--vllm-url"]
    cmd += [f"http://127.0.0.1:{PORT}", "--listen", f"127.0.0.1:{SIDECAR_PORT}"]
    cmd += ["--config", str(rel / "sidecar.json")]
    with (logdir / "sidecar.log").open("wb") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=host.env(), start_new_session=True
        )
    try:
        for _ in range(60):
            if http("/metrics", timeout=5, port=SIDECAR_PORT)[0] == 200:
                break
            time.sleep(0.5)
        # The exporter scrapes vLLM when it is scraped; a raw scrape right after each of its
        # scrapes sees the same counters while the server is idle.
        scrape(SIDECAR_PORT)
        raw0, t0 = counter_sums(scrape()), time.monotonic()
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=4) as pool:
            list(pool.map(lambda p: chat(model, p, 200), (*GREEDY_PROMPTS, "Count to ten.")))
        side = exporter_figures(scrape(SIDECAR_PORT))
        raw1, t1 = counter_sums(scrape()), time.monotonic()
        hand = spec_delta(raw0, raw1, t1 - t0)
        return {"rows": compare_sidecar(side, hand), "hand": asdict(hand)}
    finally:
        stop(proc)


def run_bench(host: Host, out: Path) -> dict[str, Any]:
    cmd = [host.python, "-m", "vfleet.cli.main", "bench", "run", "--url", f"127.0.0.1:{PORT}"]
    cmd += ["--scenario", "decode,context", "--lengths", "512,2048", "--decode-tokens", "256"]
    cmd += ["--repeats", "2", "--out", str(out), "--no-plots", "--quiet", "--time-limit", "90"]
    t0 = time.monotonic()
    res = subprocess.run(
        cmd, capture_output=True, text=True, env=host.env(), timeout=300, check=False
    )
    result: dict[str, Any] = {"rc": res.returncode, "seconds": round(time.monotonic() - t0, 2)}
    if (out / "result.md").exists():
        result["markdown"] = (out / "result.md").read_text(encoding="utf-8")
    if res.returncode:
        result["stderr"] = res.stderr[-2000:]
    return result


DEFAULT_DRAFT_CORPUS = REPO / "plugin" / "src" / "vfleet_sm75" / "data" / "draft-corpus.txt"


def replies_corpus(records: Sequence[dict[str, Any]]) -> str:
    """The greedy replies (reasoning and content) of earlier configurations, one per line: the
    model's own text, for a draft table that covers what it answers."""
    lines: list[str] = []
    for rec in records:
        for reply in rec.get("greedy", {}).get("replies", []):
            if reply.get("ok"):
                lines += [t for t in (reply.get("reasoning"), reply.get("content")) if t]
    return "\n".join(line.replace("\n", " ").strip() for line in lines) + ("\n" if lines else "")


def draft_vocab_sets(host: Host, replies: str | None = None) -> tuple[list[str], dict[str, Any]]:
    """Build the draft vocabulary for the model (once) and the settings that point the plugin
    at it; K is what rule `plugin` takes for a table built on the host. With `replies`, the
    table is built over the default corpus plus that text (a separate table file)."""
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.config.profiles import load_model
    from vfleet.engine.draft_prune import plugin_k

    top = plugin_k(load_model(host.model).arch.vocab_size)
    suffix = "-covered" if replies is not None else ""
    table = host.base / "build" / f"{host.model}.draft-vocab{suffix}.json"
    table.parent.mkdir(parents=True, exist_ok=True)
    cmd = [host.python, "-m", "vfleet_sm75.cli", "vocab", "build", "--tokenizer"]
    cmd += [str(host.model_dir), "--top", str(top), "--out", str(table), "--tp", "1"]
    if replies is not None:
        corpus = host.base / "build" / f"{host.model}.replies.txt"
        corpus.write_text(replies, encoding="utf-8")
        cmd += ["--corpus", str(DEFAULT_DRAFT_CORPUS), str(corpus)]
    res = subprocess.run(
        cmd, capture_output=True, text=True, env=host.env(), timeout=300, check=False
    )
    info = {"rc": res.returncode, "top": top, "output": (res.stdout + res.stderr)[-1500:]}
    state = host.base / "instances" / "main" / "state" / "plugin-features.json"
    sets = [f"extra_env.VFLEET_SM75_DRAFT_VOCAB={table}", f"extra_env.VFLEET_SM75_STATE={state}"]
    return sets, info


# The rendered vLLM arguments a profile's render carries over to the card it is emulated on,
# as the settings that render them (the rest is the serving card's own: its backend support,
# graph mode, memory terms).
EMULATED_ARGS = {
    "max-model-len": "max_model_len",
    "max-num-seqs": "max_num_seqs",
    "max-num-batched-tokens": "max_num_batched_tokens",
    "kv-cache-dtype": "kv_cache_dtype",
    "attention-backend": "attention_backend",
}


def emulated_sets(profile: str, model: str) -> list[str]:
    """Settings that serve `profile`'s render of `model` here with that card's KV pool:
    its window, sequences, batch, KV dtype, backend and MTP depth as rendered there, and
    kv_cache_memory_bytes = the KV bytes its plan leaves per GPU on its own card (how the
    planner plans that card: vLLM takes the KV pool as given and skips its own sizing)."""
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.engine.compile import resolve
    from vfleet.engine.planner import plan_launch

    launch = resolve(profile, model)
    plan = plan_launch(launch)
    if plan.gpu is None or plan.gpu.kv_bytes <= 0 or not plan.fits:
        raise SystemExit(f"error: {profile} x {model} does not fit its card: {plan.problems}")
    args = {e.key: e.value for e in launch.args}
    sets = [f"{name}={args[key]}" for key, name in EMULATED_ARGS.items() if key in args]
    spec = args.get("speculative-config")
    depth = spec.get("num_speculative_tokens") if isinstance(spec, dict) else None
    sets.append(
        f"speculative.num_speculative_tokens={depth}" if depth else "speculative.method=none"
    )
    return [*sets, f"kv_cache_memory_bytes={plan.gpu.kv_bytes}"]


def serve_one(
    host: Host,
    cfg: LaneConfig,
    logdir: Path,
    timeout: float,
    earlier: Sequence[dict[str, Any]] = (),
) -> dict[str, Any]:
    extra: list[str] = []
    vocab_info: dict[str, Any] | None = None
    if cfg.vocab_from_replies:
        replies = replies_corpus(earlier)
        if not replies:
            return {
                "name": cfg.name,
                "error": "no greedy replies from an earlier configuration to build the table "
                "from: run it after plugin-off (--only plugin-off,plugin-on-covered)",
            }
        extra, vocab_info = draft_vocab_sets(host, replies)
    elif cfg.draft_prune:
        extra, vocab_info = draft_vocab_sets(host)
    if cfg.emulate:
        extra = [*extra, *emulated_sets(cfg.emulate, host.model)]
    rel = render(host, cfg, extra)
    # a configuration named twice in --only (interleaved runs) keeps each start's log
    log = logdir / f"{cfg.name}.log"
    for n in range(2, 100):
        if not log.exists():
            break
        log = logdir / f"{cfg.name}.{n}.log"
    rec: dict[str, Any] = {
        "name": cfg.name,
        "sets": [*host.base_sets, *host.sets, *cfg.sets, *extra],
        "why": cfg.why,
        "vllm_yaml": (rel / "vllm.yaml").read_text(encoding="utf-8"),
        # `report` says why a DEBUG-only term is missing from a run at INFO
        "debug_log": runs_at_debug(cfg, rel),
    }
    if vocab_info is not None:
        rec["draft_vocab"] = vocab_info
    if not port_free(PORT):
        rec["error"] = f"port {PORT} is busy before the start"
        return rec
    procs = [start(rel, log, cfg.debug_log, host.base / "lane.pid")]
    proc = procs[0]
    try:
        rec["ready_s"] = ready = wait_ready(proc, timeout)
        if ready is None:
            rec["error"] = f"not ready (exit code {proc.poll()})"
            return rec
        model = served_name(host)
        if "first-request" in cfg.roles:
            # before the probe's warmup set (role `probe`): what a first user request waits for
            first = chat(model, "[first] " + GREEDY_PROMPTS[0] * 20, 64, True)
            rec["first_request"] = {**first, "after_warmup": False}
            rec["second_request"] = chat(model, "[second] " + GREEDY_PROMPTS[0] * 20, 64, True)
        metrics = scrape()
        rec["cache_info"] = cache_info(metrics)
        rec["vllm_version"] = json.loads(http("/version")[1] or b"{}").get("version")
        rec["gpu_used_mib"] = gpu_used_mib()
        if "probe" in cfg.roles:
            rec["probe"] = run_probe(host, rel)
        if "greedy" in cfg.roles:
            rec["greedy"] = run_greedy(model)
        if "sidecar" in cfg.roles:
            rec["sidecar"] = run_sidecar(host, rel, model, logdir)
        if "bench" in cfg.roles:
            rec["bench"] = run_bench(host, logdir / "bench")
        if "decode" in cfg.roles:
            rec["decode"] = run_decode(model, host.repeats)
        if "sleep" in cfg.roles:
            rec["sleep"] = run_sleep(model, host.repeats)
        if "restart" in cfg.roles:
            rec["restarts"] = []
            run_restarts(
                rel,
                procs,
                model,
                logdir,
                cfg.name,
                host.repeats,
                timeout,
                host.base / "lane.pid",
                rec["restarts"],
            )
        rec["alive_at_end"] = procs[0].poll() is None and http("/health", timeout=5)[0] == 200
    except (SystemExit, KeyboardInterrupt):
        # `timeout` (SIGTERM) or Ctrl-C: keep what was measured, stop the server, stop the run.
        rec["error"] = "interrupted"
        rec["interrupted"] = True
    finally:
        stop(procs[0])
        (host.base / "lane.pid").unlink(missing_ok=True)
        rec["log_terms"] = asdict(parse_log(log.read_text(encoding="utf-8", errors="replace")))
        for i, restart in enumerate(rec.get("restarts", [])):
            rlog = logdir / f"{cfg.name}.restart{i + 1}.log"
            if rlog.exists():
                terms = parse_log(rlog.read_text(encoding="utf-8", errors="replace"))
                restart["init_engine_s"], restart["compile_s"] = (
                    terms.init_engine_s,
                    terms.compile_s,
                )
        caches = host.base / "cache" / "main"
        rec["cache_mib"] = {p.name: dir_mib(p) for p in sorted(caches.glob("*")) if p.is_dir()}
        fi = Path.home() / ".cache" / "flashinfer"
        rec["cache_mib"]["flashinfer-home"] = dir_mib(fi) if fi.exists() else 0.0
    return rec


NOT_RUN = "not run (no-mtp, the MTP-off reference, did not run)"


def greedy_identity(records: Sequence[dict[str, Any]]) -> dict[str, Any] | str:
    """Every configuration's greedy replies against the MTP-off reference (same prompts);
    ``NOT_RUN`` when the reference did not run (nothing was compared)."""
    ref = next((r for r in records if r["name"] == "no-mtp" and "greedy" in r), None)
    if ref is None:
        return NOT_RUN
    out: dict[str, Any] = {"reference": ref["name"], "same": {}}

    def texts(rec: dict[str, Any]) -> list[tuple[Any, Any]]:
        return [(x.get("reasoning"), x.get("content")) for x in rec["greedy"]["replies"]]

    for rec in records:
        if "greedy" in rec and rec is not ref:
            out["same"][rec["name"]] = texts(rec) == texts(ref)
    return out


def greedy_pairs(records: Sequence[dict[str, Any]]) -> dict[str, bool]:
    """Configurations that must answer alike, when both ran: plugin-on against plugin-off, and
    full CUDA graphs against piecewise ones (the same kernels, one graph per step instead of
    one per piece). With dummy weights (drawn from a seed) the replies are degenerate (the same
    token over and over): a pair then agrees without showing much."""
    by = {r["name"]: r for r in records if "greedy" in r}
    out: dict[str, bool] = {}
    for a, b in (
        ("plugin-on", "plugin-off"),
        ("plugin-on-covered", "plugin-off"),
        ("nomtp-full", "nomtp-piecewise"),
    ):
        if a in by and b in by:
            ta, tb = (greedy_texts(by[n]["greedy"]) for n in (a, b))
            out[f"{a} = {b}"] = all(x.get("ok") for x in by[a]["greedy"]["replies"]) and ta == tb
    return out


# What `run` records of the machine, and the card's copy bandwidth (the decode roofline's
# ceiling, `report`): a 2 GiB device-to-device copy, bytes read + written, median of 20 timed
# with CUDA events after 3 warm-ups (as bench/draft_head_gpu.py measures it).
FACTS_CODE = """
import json, platform, torch
p = torch.cuda.get_device_properties(0)
free, total = torch.cuda.mem_get_info()
a = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
b = torch.empty_like(a)
for _ in range(3):
    b.copy_(a)
torch.cuda.synchronize()
rates = []
for _ in range(20):
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    b.copy_(a)
    e1.record()
    e1.synchronize()
    rates.append(2 * a.numel() * a.element_size() / (e0.elapsed_time(e1) * 1e-3) / 1e9)
print(json.dumps({
    "gpu": p.name, "total_memory": total, "free_memory": free,
    "capability": list(torch.cuda.get_device_capability(0)), "torch": torch.__version__,
    "cuda": torch.version.cuda, "python": platform.python_version(),
    "copy_gbps": round(sorted(rates)[len(rates) // 2], 1),
}))
"""


def machine_facts(python: str, env: dict[str, str]) -> dict[str, Any]:
    code = FACTS_CODE
    res = subprocess.run(
        [python, "-c", code], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    try:
        facts: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        facts = {"error": res.stderr[-1500:]}
    nvcc = shutil.which("nvcc")
    facts["nvcc"] = nvcc
    facts["nproc"] = os.cpu_count()
    return facts


def first_request_md(rec: dict[str, Any]) -> str | None:
    """The first request's TTFT with whether the warmup set ran before it (None: none ran)."""
    first = rec.get("first_request")
    if not first:
        return None
    warm = {True: "after the warmup set", False: "no warmup"}.get(
        first.get("after_warmup"), "warmup not recorded"
    )
    ttft = first.get("ttft_s")
    took = f"{ttft} s" if ttft is not None else f"failed: {first.get('error', '?')}"
    second = (rec.get("second_request") or {}).get("ttft_s")
    then = f", second {second} s" if second is not None else ""
    return f"first request {rec['name']}: {took} ({warm}){then}"


def summary_md(result: dict[str, Any]) -> str:
    lines = [
        f"# GPU lane: {result['profile']} x {result['model']}",
        "",
        f"machine: {json.dumps(result['machine'])}",
        "",
        "| config | ready s | KV tokens | avail KV GiB | weights GiB | graph est/pool GiB | "
        "acceptance | mean len | error |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["configs"]:
        t = r.get("log_terms", {})
        spec = r.get("greedy", {}).get("spec", {})
        acc = spec.get("acceptance")
        mal = spec.get("mean_acceptance_length")
        lines.append(
            f"| {r['name']} | {r.get('ready_s')} | {t.get('kv_tokens')} | "
            f"{t.get('available_kv_gib')} | {t.get('weights_gib')} | "
            f"{t.get('cudagraph_estimate_gib')}/{t.get('graph_pool_gib')} | "
            f"{'-' if acc is None else f'{acc:.3f}'} | {'-' if mal is None else f'{mal:.2f}'} | "
            f"{r.get('error', '')} |"
        )
    ident = result["greedy_identity"]
    ident = ident if isinstance(ident, str) else json.dumps(ident)
    lines += ["", f"greedy identical to MTP off: {ident}"]
    lines += [f"greedy pairs: {json.dumps(result.get('greedy_pairs', {}))}", ""]
    for r in result["configs"]:
        if first := first_request_md(r):
            lines.append(first)
        if "decode" in r:
            lines.append(f"decode {r['name']}: median {r['decode']['median_tokens_per_s']} tok/s")
        for line in r.get("log_terms", {}).get("plugin_lines", []):
            lines.append(f"plugin {r['name']}: {line}")
    if any(sleep_rows(r) for r in result["configs"]):
        lines += ["", sleep_md(result)]
    return "\n".join(lines)


def dummy_base_sets(model: str) -> tuple[str, ...]:
    """The settings --dummy-weights adds to every configuration of `model`."""
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.config.profiles import load_model

    multimodal = load_model(model).arch.multimodal
    return DUMMY_SETS + (MULTIMODAL_DUMMY_SETS if multimodal else ())


def build_config_only(python: str, model: str, model_dir: Path, env: dict[str, str]) -> None:
    """A config-only folder of `model` (vfleet model make --config-only): config.json from the
    preset (src/vfleet/checks/vllm_check.py model_config_json) and a tokenizer, no weights."""
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.checks.vllm_check import model_config_json
    from vfleet.config.profiles import load_model

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(model_config_json(load_model(model)), fh)
    t_build = time.monotonic()
    script = str(REPO / "src/vfleet/hostside/tinymodels.py")
    subprocess.run(
        [python, script, "config-only", str(model_dir), "--config-json", fh.name],
        check=True,
        env=env,
    )
    os.unlink(fh.name)
    print(f"wrote {model} (config only) in {time.monotonic() - t_build:.1f} s: {model_dir}")


def make_host(a: argparse.Namespace) -> Host:
    """The Host of `run` / `caches`; builds the generated model (or, with --dummy-weights, the
    preset's config-only folder) if it is not there yet."""
    base = Path(a.base_dir).expanduser()
    nvcc = shutil.which("nvcc")
    cuda_home = a.cuda_home or (
        str(Path(nvcc).resolve().parent.parent) if nvcc else "/usr/local/cuda"
    )
    model_dir = Path(a.model_dir) if a.model_dir else base / "build" / a.model
    host = Host(
        base,
        a.python,
        a.pythonpath or "",
        cuda_home,
        model_dir,
        a.profile,
        a.model,
        tuple(a.sets),
        a.repeats,
        dummy_base_sets(a.model) if a.dummy_weights else BASE_SETS,
    )
    if a.dummy_weights and not (model_dir / "config.json").exists():
        build_config_only(a.python, a.model, model_dir, host.env())
    elif not (model_dir / "config.json").exists():
        # The generated test models are built here from the preset (no downloads).
        sys.path[:0] = [str(REPO / "src")]
        from vfleet.config.profiles import load_model

        arch = load_model(a.model).arch.model_dump()
        gen = load_model(a.model).source.generator
        if gen is None:
            raise SystemExit(
                f"error: {a.model} is a real checkpoint, not a generated model: pass "
                "--model-dir with its weights, or --dummy-weights (random weights at its size)"
            )
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump(arch, fh)
        t_build = time.monotonic()
        subprocess.run(
            [
                a.python,
                str(REPO / "src/vfleet/hostside/tinymodels.py"),
                str(gen),
                str(model_dir),
                "--arch-json",
                fh.name,
            ],
            check=True,
            env=host.env(),
        )
        print(f"built {a.model} in {time.monotonic() - t_build:.1f} s: {model_dir}", flush=True)
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.engine.compile import resolve

    stack = resolve(a.profile, a.model, sets=list(host.base_sets)).stack
    prepare_host(host, f"{stack.vllm_package}-{stack.vllm}")
    return host


def cmd_run(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    host = make_host(a)
    base = host.base
    # `timeout` or Ctrl-C: unwind, so that the server's process group is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    base.mkdir(parents=True, exist_ok=True)
    if stop_leftover(base / "lane.pid"):
        print("stopped a server an interrupted run left behind", flush=True)
    logdir = out / "logs"
    logdir.mkdir(exist_ok=True)
    result: dict[str, Any] = {
        "profile": a.profile,
        "model": a.model,
        "machine": machine_facts(a.python, host.env()),
        "cuda_home": host.cuda_home,
        "configs": [],
    }
    t_all = time.monotonic()
    for cfg in select(a.only):
        if a.budget_s and time.monotonic() - t_all > a.budget_s:
            result["configs"].append({"name": cfg.name, "error": "skipped: --budget-s spent"})
            continue
        print(f"== {cfg.name}: {' '.join(cfg.sets) or 'defaults'}", flush=True)
        rec = serve_one(host, cfg, logdir, a.start_timeout, result["configs"])
        result["configs"].append(rec)
        t = rec.get("log_terms", {})
        spec = rec.get("greedy", {}).get("spec", {})
        print(
            f"   ready {rec.get('ready_s')} s, KV {t.get('kv_tokens')} tokens, acceptance "
            f"{spec.get('acceptance')}, error {rec.get('error')}",
            flush=True,
        )
        (out / "lane.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
        if rec.get("interrupted"):
            break
    result["greedy_identity"] = greedy_identity(result["configs"])
    result["greedy_pairs"] = greedy_pairs(result["configs"])
    result["seconds"] = round(time.monotonic() - t_all, 1)
    (out / "lane.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (out / "lane.md").write_text(summary_md(result), encoding="utf-8")
    with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
        tar.add(logdir, arcname="logs")
    shutil.rmtree(logdir)
    print(summary_md(result))
    return 0


# --------------------------------------------------------------------------- caches

# What a restart can reuse, by name: the folders the render points the caches at (vllm.env:
# VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR, PYTHONPYCACHEPREFIX) and the
# instance's own HOME (launch.sh sets it): FlashInfer JIT-compiles into ~/.cache/flashinfer,
# and whatever else a library keeps under ~ (CUDA's compute cache) lands there too.
# Paths are relative to the vfleet base folder.
CACHES: dict[str, tuple[str, ...]] = {
    "compile": ("cache/main/vllm", "cache/main/torchinductor"),
    "triton": ("cache/main/triton",),
    "home": ("instances/main/home",),
    "bytecode": ("cache/main/pycache",),
}


@dataclass(frozen=True)
class CacheVariant:
    """One start of the same release with some of its caches taken away first."""

    name: str
    removes: tuple[str, ...]  # keys of CACHES
    why: str
    # run the rendered warmup set (vfleet-probe --warmup) between /health and the first request
    warmup: bool = False
    # start from a fresh base folder with a tar of this base folder's caches unpacked into it
    carried: bool = False
    # take every cache away, then unpack a tar of them at the same paths: a fresh host that
    # gets an earlier start's caches where the deploy puts the instance (the base folder is the
    # profile's, so the same on every host)
    carried_same: bool = False
    # as carried_same, but packed and unpacked as a deploy's cache seed does
    # (src/vfleet/hostside/cacheseed.py: mtimes to the nanosecond, bytecode compiled from
    # source as checked-hash pycs, signed and verified with a throwaway key)
    seeded: bool = False


CACHE_VARIANTS: tuple[CacheVariant, ...] = (
    CacheVariant("warm", (), "every cache of the earlier starts kept: the reference restart"),
    CacheVariant("no-compile", ("compile",), "without vLLM's torch.compile/AOT + inductor cache"),
    CacheVariant("no-triton", ("triton",), "without the Triton kernel cache"),
    CacheVariant("no-home", ("home",), "without the instance HOME: FlashInfer JIT (+ CUDA's)"),
    CacheVariant("no-bytecode", ("bytecode",), "without the Python bytecode cache"),
    CacheVariant("cold", tuple(CACHES), "no cache at all: a fresh host's first start"),
    CacheVariant(
        "cold-warmup",
        tuple(CACHES),
        "no cache at all, then the rendered warmup set before the first request",
        warmup=True,
    ),
    CacheVariant(
        "carried",
        (),
        "a fresh base folder (another path) with the caches of this one carried in as a tar",
        carried=True,
    ),
    CacheVariant(
        "carried-same",
        tuple(CACHES),
        "every cache taken away, then a tar of them unpacked at the same paths (a fresh host "
        "given an earlier start's caches)",
        carried_same=True,
    ),
    CacheVariant(
        "seeded",
        tuple(CACHES),
        "as carried-same, packed and unpacked by vfleet's cache seed script (nanosecond "
        "mtimes: FlashInfer's ninja keeps its objects; docs/CACHES.md)",
        carried_same=True,
        seeded=True,
    ),
)


def select_variants(names: str | None) -> list[CacheVariant]:
    if not names:
        return list(CACHE_VARIANTS)
    by = {v.name: v for v in CACHE_VARIANTS}
    unknown = [n for n in names.split(",") if n not in by]
    if unknown:
        raise SystemExit(f"error: --variants: unknown variant(s) {unknown}; known: {list(by)}")
    return [by[n] for n in names.split(",")]


def cache_paths(base: Path, keys: Sequence[str]) -> list[Path]:
    return [base / rel for key in keys for rel in CACHES[key]]


def move_aside(base: Path, keys: Sequence[str], aside: Path) -> list[tuple[Path, Path]]:
    """Rename the caches named by `keys` into `aside` (same file system: instant); returns
    (original, aside) pairs for restore()."""
    moved: list[tuple[Path, Path]] = []
    for path in cache_paths(base, keys):
        if not path.exists():
            continue
        dest = aside / path.relative_to(base)
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists():
            shutil.rmtree(dest)
        path.rename(dest)
        moved.append((path, dest))
    return moved


def restore(moved: Sequence[tuple[Path, Path]]) -> None:
    """Drop what a start rebuilt in place of the moved caches and put the originals back, so
    each variant starts from the same caches."""
    for original, aside in moved:
        if original.exists():
            shutil.rmtree(original)
        original.parent.mkdir(parents=True, exist_ok=True)
        aside.rename(original)


def pack_caches(base: Path, tar_path: Path) -> dict[str, Any]:
    """Tar every cache of `base` (paths relative to it), as a deploy would carry them."""
    t0 = time.monotonic()
    with tarfile.open(tar_path, "w") as tar:
        for path in cache_paths(base, list(CACHES)):
            if path.exists():
                tar.add(path, arcname=str(path.relative_to(base)))
    mib = round(tar_path.stat().st_size / (1 << 20), 1)
    return {"seconds": round(time.monotonic() - t0, 2), "mib": mib}


def unpack_caches(tar_path: Path, base: Path) -> float:
    t0 = time.monotonic()
    with tarfile.open(tar_path) as tar:
        tar.extractall(base, filter="tar")
    return round(time.monotonic() - t0, 2)


def _seed_request(base: Path) -> dict[str, Any]:
    return {
        "roots": {
            "cache": str(base / "cache/main"),
            "flashinfer": str(base / "instances/main/home/.cache/flashinfer"),
        },
        "pycache": str(base / "cache/main/pycache"),
        "manifest_name": "vfleet-cache-seed.json",
        "manifest": {"source_host": "gpu-lane"},
    }


def _lane_key(tar_path: Path) -> tuple[Path, Path]:
    """A throwaway operator key beside the seed and an allowed_signers file for it: the lane
    signs and verifies as a deploy does (ssh-keygen -Y)."""
    key = tar_path.with_name("lane-seed.key")
    if not key.exists():
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "lane", "-f", str(key)],
            check=True, timeout=60,
        )  # fmt: skip
    signers = tar_path.with_name("lane-seed.allowed_signers")
    pub = key.with_name(key.name + ".pub").read_text().strip()
    signers.write_text(f'lane namespaces="vfleet-cache-seed" {pub}\n')
    return key, signers


def seed_pack(base: Path, tar_path: Path) -> dict[str, Any]:
    """The caches as `vfleet caches pack` packs them (the instance HOME's FlashInfer folder
    only, not all of HOME as pack_caches does)."""
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.hostside import cacheseed

    t0 = time.monotonic()
    from vfleet.fleet.caches import seal

    with tar_path.open("wb") as out:
        manifest = cacheseed.pack(_seed_request(base), out)
    seal(str(tar_path), _lane_key(tar_path)[0])
    mib = round(tar_path.stat().st_size / (1 << 20), 1)
    return {"seconds": round(time.monotonic() - t0, 2), "mib": mib, "pyc": manifest.get("pyc")}


def seed_unpack(tar_path: Path, base: Path) -> float:
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.hostside import cacheseed

    t0 = time.monotonic()
    req = {**_seed_request(base), "tar": str(tar_path), "owner": None,
           "allowed_signers": str(_lane_key(tar_path)[1])}  # fmt: skip
    done = cacheseed.unpack(req)
    if not done.get("unpacked"):
        raise SystemExit(f"error: the seed was not unpacked: {done}")
    return round(time.monotonic() - t0, 2)


def cache_sizes(base: Path) -> dict[str, float]:
    """MiB per cache folder and per entry of the instance HOME (what a library put there)."""
    out = {str(p.relative_to(base)): dir_mib(p) for p in cache_paths(base, list(CACHES))}
    home = base / "instances/main/home"
    for sub in sorted(home.glob(".*/*")) + sorted(home.glob("[!.]*")):
        out[str(sub.relative_to(base))] = dir_mib(sub)
    return out


def start_and_first_request(
    host: Host, cfg: LaneConfig, name: str, logdir: Path, timeout: float, warmup: bool
) -> dict[str, Any]:
    """Render `cfg`, start it, time /health, (the warmup set), the first and second request."""
    rel = render(host, cfg)
    log = logdir / f"{name}.log"
    rec: dict[str, Any] = {"variant": name}
    if not port_free(PORT):
        rec["error"] = f"port {PORT} is busy before the start"
        return rec
    pidfile = host.base / "lane.pid"
    t0 = time.monotonic()
    # At the configuration's own log level, as `run` starts it: on torch < 2.12 vLLM 0.24.0
    # turns Inductor's size/alignment/scalar asserts on only at VLLM_LOGGING_LEVEL=DEBUG
    # (config/compilation.py), they are part of the compilation config its torch.compile cache
    # key covers, so a restart at INFO of a configuration `run` started at DEBUG (`real`) found
    # none of its compile artefacts and compiled again (H200, 2026-12-04: docs/GPU.md 10).
    proc = start(rel, log, cfg.debug_log, pidfile)
    try:
        rec["ready_s"] = ready = wait_ready(proc, timeout)
        if ready is None:
            rec["error"] = f"not ready (exit code {proc.poll()})"
            return rec
        if warmup:
            rec["warmup"] = run_probe(host, rel)
        model = served_name(host)
        first = chat(model, "[first] " + GREEDY_PROMPTS[0] * 20, 64, True)
        rec["first_request"] = {**first, "after_warmup": warmup}
        rec["second_request"] = chat(model, "[second] " + GREEDY_PROMPTS[0] * 20, 64, True)
        rec["to_first_token_s"] = round(time.monotonic() - t0, 2)
    except (SystemExit, KeyboardInterrupt):
        rec["error"] = "interrupted"
        rec["interrupted"] = True
    finally:
        stop(proc)
        pidfile.unlink(missing_ok=True)
        terms = parse_log(log.read_text(encoding="utf-8", errors="replace"))
        rec["init_engine_s"], rec["compile_s"] = terms.init_engine_s, terms.compile_s
        rec["errors"] = terms.errors
    return rec


def run_cache_variant(
    host: Host, cfg: LaneConfig, v: CacheVariant, logdir: Path, timeout: float
) -> dict[str, Any]:
    aside = host.base.parent / (host.base.name + "-aside")
    if not v.carried:
        tar_path = host.base.parent / (host.base.name + "-caches.tar")
        pack, unpack = (seed_pack, seed_unpack) if v.seeded else (pack_caches, unpack_caches)
        packed = pack(host.base, tar_path) if v.carried_same else None
        moved = move_aside(host.base, v.removes, aside)
        try:
            if packed is not None:
                packed["unpack_s"] = unpack(tar_path, host.base)
                tar_path.unlink()
            rec = start_and_first_request(host, cfg, v.name, logdir, timeout, v.warmup)
            rec["rebuilt_mib"] = cache_sizes(host.base)
        finally:
            restore(moved)
        rec["removed"] = [str(o.relative_to(host.base)) for o, _ in moved]
        if packed is not None:
            rec["tar"] = {**packed, "from": str(host.base), "to": str(host.base)}
        return rec
    fresh = host.base.parent / (host.base.name + "-carried")
    if fresh.exists():
        shutil.rmtree(fresh)
    fresh.mkdir(parents=True)
    tar_path = host.base.parent / (host.base.name + "-caches.tar")
    packed = pack_caches(host.base, tar_path)
    unpacked_s = unpack_caches(tar_path, fresh)
    carried = replace(host, base=fresh)
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.engine.compile import resolve

    stack = resolve(host.profile, host.model, sets=list(host.base_sets)).stack
    prepare_host(carried, f"{stack.vllm_package}-{stack.vllm}")
    try:
        rec = start_and_first_request(carried, cfg, v.name, logdir, timeout, v.warmup)
        rec["rebuilt_mib"] = cache_sizes(fresh)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
        tar_path.unlink(missing_ok=True)
    rec["tar"] = {**packed, "unpack_s": unpacked_s, "from": str(host.base), "to": str(fresh)}
    return rec


def caches_md(result: dict[str, Any]) -> str:
    lines = [
        "| variant | caches taken away | ready (/health) s | init engine s | torch.compile s | "
        "warmup set s | first request TTFT s | second TTFT s | start to first token s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rec in result["variants"]:
        warm = rec.get("warmup", {}).get("seconds", "-") if rec.get("warmup") else "-"
        first = (rec.get("first_request") or {}).get("ttft_s", "-")
        second = (rec.get("second_request") or {}).get("ttft_s", "-")
        removed = ", ".join(rec.get("removed", [])) or (
            "fresh base folder, caches carried in" if "tar" in rec else "none"
        )
        if rec.get("removed") and "tar" in rec:
            removed += " (then a tar of them unpacked at the same paths)"
        lines.append(
            f"| {rec['variant']} | {removed} | {rec.get('ready_s', '-')} | "
            f"{rec.get('init_engine_s', '-')} | {rec.get('compile_s', '-')} | {warm} | {first} | "
            f"{second} | {rec.get('to_first_token_s', '-')} |"
        )
    return "\n".join(lines) + "\n"


def cmd_caches(a: argparse.Namespace) -> int:
    """Restarts of one configuration with one cache taken away at a time (docs/GPU.md, 5)."""
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = select_variants(a.variants)
    cfg = select(a.config)[0]
    host = make_host(a)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    host.base.mkdir(parents=True, exist_ok=True)
    stop_leftover(host.base / "lane.pid")
    logdir = out / "logs"
    logdir.mkdir(exist_ok=True)
    result: dict[str, Any] = {
        "profile": a.profile,
        "model": a.model,
        "config": cfg.name,
        "base": str(host.base),
        "pythonpath": host.pythonpath,
        "sizes_before": cache_sizes(host.base),
        "variants": [],
    }
    t_all = time.monotonic()
    for v in variants:
        if a.budget_s and time.monotonic() - t_all > a.budget_s:
            result["variants"].append({"variant": v.name, "error": "skipped: --budget-s spent"})
            continue
        print(f"== {v.name}: {v.why}", flush=True)
        rec = run_cache_variant(host, cfg, v, logdir, a.start_timeout)
        result["variants"].append(rec)
        print(
            f"   ready {rec.get('ready_s')} s, first TTFT "
            f"{(rec.get('first_request') or {}).get('ttft_s')} s, error {rec.get('error')}",
            flush=True,
        )
        (out / "caches.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
        if rec.get("interrupted"):
            break
    result["seconds"] = round(time.monotonic() - t_all, 1)
    (out / "caches.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    (out / "caches.md").write_text(caches_md(result), encoding="utf-8")
    with tarfile.open(out / "cache-logs.tar.gz", "w:gz") as tar:
        tar.add(logdir, arcname="logs")
    shutil.rmtree(logdir)
    print(caches_md(result))
    return 0


# --------------------------------------------------------------------------- report


@dataclass
class TermRow:
    config: str
    term: str
    planner: float | None
    vllm: float | None
    # the log_terms key of a figure vLLM logs only at DEBUG that `vllm` comes from
    debug_key: str | None = None

    @property
    def error_pct(self) -> float | None:
        if self.planner is None or self.vllm is None or self.vllm == 0:
            return None
        return 100.0 * (self.planner - self.vllm) / self.vllm


def replan_sets(rec: dict[str, Any]) -> list[str]:
    """The configuration's settings for planning it again, with the graph mode it ran with
    where its settings left that to the rules: a rule default that changed since (cudagraphs,
    49b821b: FULL_AND_PIECEWISE without MTP) must not re-plan an older run in another mode."""
    sets = list(rec["sets"])
    if any(s.startswith("cudagraph_mode=") for s in sets) or not rec.get("vllm_yaml"):
        return sets
    import yaml

    try:
        conf = yaml.safe_load(rec["vllm_yaml"]) or {}
    except yaml.YAMLError:
        return sets
    cc = conf.get("compilation-config") if isinstance(conf, dict) else None
    if isinstance(cc, str):  # vLLM also takes it as a JSON string
        with contextlib.suppress(ValueError):
            cc = json.loads(cc)
    mode = cc.get("cudagraph_mode") if isinstance(cc, dict) else None
    return [*sets, f"cudagraph_mode={mode}"] if isinstance(mode, str) else sets


def planner_rows(
    rec: dict[str, Any], profile: str, model: str, total_bytes: int | None = None
) -> list[TermRow]:
    """vfleet's planner for the configuration beside the terms vLLM logged."""
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.engine.compile import resolve
    from vfleet.engine.planner import plan_launch

    launch = resolve(profile, model, sets=replan_sets(rec), strict_memory=False)
    plan = plan_launch(launch)
    t = rec.get("log_terms", {})
    gpu = plan.gpu
    # vLLM: available KV = requested - (weights + activation peak + non-torch) - CUDA graph
    # estimate, so everything in the budget but weights and KV is requested - available -
    # weights. Requested is logged at DEBUG; else util x the total memory torch reports.
    requested = t.get("requested_gib")
    util = launch.config_values().get("gpu-memory-utilization")
    if requested is None and total_bytes and util:
        requested = float(util) * total_bytes / GIB
    logged_reserve = None
    if requested is not None and t.get("available_kv_gib") is not None and t.get("weights_gib"):
        logged_reserve = requested - t["available_kv_gib"] - t["weights_gib"]
    info = rec.get("cache_info", {})
    blocks = int(info["num_gpu_blocks"]) if info.get("num_gpu_blocks") else None
    # The page math alone: vLLM's own block count through the planner's blocks per request.
    from_blocks = int(blocks / plan.kv.blocks_per_request * plan.max_model_len) if blocks else None
    return [
        TermRow(
            rec["name"],
            "block size (tokens)",
            plan.kv.block_size,
            float(info["block_size"]) if info.get("block_size") else None,
        ),
        TermRow(rec["name"], "KV tokens from vLLM's block count", from_blocks, t.get("kv_tokens")),
        TermRow(rec["name"], "KV tokens", plan.kv.kv_cache_tokens, t.get("kv_tokens")),
        TermRow(
            rec["name"],
            "KV memory GiB",
            gpu.kv_bytes / GIB if gpu else None,
            t.get("available_kv_gib"),
        ),
        TermRow(
            rec["name"],
            "weights GiB",
            gpu.weights_bytes / GIB if gpu else None,
            t.get("weights_gib"),
        ),
        TermRow(
            rec["name"],
            "non-KV in budget (reserve) GiB",
            gpu.reserve_bytes / GIB if gpu else None,
            logged_reserve,
        ),
        *term_rows(rec, gpu.terms if gpu else [], total_bytes),
    ]


# vfleet plan's terms beside the figure vLLM logs for each (GiB, 2 decimals; the activation
# peak, non-torch memory and the requested memory only at DEBUG).
TERM_LOGS = (
    ("weight", "weights_gib", "weights MiB"),
    ("peak activation", "torch_peak_gib", "peak activation MiB"),
    ("non-torch memory", "non_torch_gib", "non-torch memory MiB"),
    ("CUDAGraph memory", "cudagraph_estimate_gib", "CUDA graph estimate MiB"),
    ("CUDAGraph memory", "graph_pool_gib", "CUDA graph pool (captured) MiB"),
)
# The figures vLLM 0.24.0 logs only at DEBUG, and what `report` says in place of one missing
# from a run at INFO (`main` and others run at INFO on purpose: LaneConfig.debug_log).
DEBUG_ONLY_TERMS = (
    "torch_peak_gib",
    "non_torch_gib",
    "non_kv_gib",
    "requested_gib",
    "initial_free_gib",
)
NOT_LOGGED = "not logged (INFO; --set extra_env.VLLM_LOGGING_LEVEL=DEBUG)"


def term_rows(rec: dict[str, Any], terms: Sequence[Any], total_bytes: int | None) -> list[TermRow]:
    """Each planner term in MiB against vLLM's logged figure (MiB); the CUDA context against
    the card's total less vLLM's 'Initial free memory' (what was in use before its snapshot)."""
    t = rec.get("log_terms", {})
    mib = float(1 << 20)

    def planned(name: str) -> float | None:
        hit = [x.bytes for x in terms if x.name == name]
        return sum(hit) / mib if hit else None

    def logged(key: str) -> float | None:
        v = t.get(key)
        return None if v is None else float(v) * 1024

    rows = [
        TermRow(rec["name"], label, planned(n), logged(k), k if k in DEBUG_ONLY_TERMS else None)
        for n, k, label in TERM_LOGS
    ]
    free = t.get("initial_free_gib")
    context = None
    if free is not None and total_bytes:
        context = total_bytes / mib - float(free) * 1024
    # without the card's total the context is missing whatever the log level
    key = "initial_free_gib" if total_bytes else None
    rows.append(TermRow(rec["name"], "CUDA context MiB", planned("CUDA context"), context, key))
    return rows


def ran_at_info(rec: dict[str, Any]) -> bool:
    """Whether the configuration's vLLM logged at INFO (its DEBUG-only terms absent by design).

    `run` records it as ``debug_log``. An older record without it is inferred from its log,
    and only where that is safe: vLLM 0.24.0 logs "Available KV cache memory" (INFO) in the
    same call as "Initial free memory" and the profiling line (DEBUG; gpu_worker.py 496-508),
    so the first without any of the second is a run at INFO (every H200 record before the
    field agrees with its configuration's level). Another vLLM version, or a log without that
    line, is not inferred: its missing terms keep `-`."""
    if "debug_log" in rec:
        return not rec["debug_log"]
    t = rec.get("log_terms", {})
    return (
        rec.get("vllm_version") == "0.24.0"
        and t.get("available_kv_gib") is not None
        and all(t.get(k) is None for k in DEBUG_ONLY_TERMS)
    )


def logged_md(rec: dict[str, Any], row: TermRow) -> str:
    """vLLM's figure of `row`, or why a DEBUG-only figure is missing from a run at INFO."""
    key = row.debug_key
    missing = row.vllm is None and key is not None and rec.get("log_terms", {}).get(key) is None
    return NOT_LOGGED if missing and ran_at_info(rec) else _fmt(row.vllm)


def roofline(rec: dict[str, Any], profile: str, model: str, copy_gbps: float) -> dict[str, Any]:
    """Single-stream decode without speculation against the HBM roofline: the bytes one decode
    step must read (every weight but the embedding, which is gathered, and the unloaded MTP
    module; the GDN layers' recurrent state read and written; the KV of the context is left
    out: a few MB at these lengths) over the measured copy bandwidth."""
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.engine.compile import resolve
    from vfleet.engine.gpu_memory import weight_bytes
    from vfleet.engine.planner import plan_launch

    launch = resolve(profile, model, sets=replan_sets(rec), strict_memory=False)
    plan = plan_launch(launch)
    prof = launch.profile
    parts = weight_bytes(launch.model.arch, launch.model.quantization, prof.accelerator.sm)
    weights = sum(v for k, v in parts.items() if k not in ("embedding", "mtp"))
    state = 2 * plan.kv.gdn_layers * plan.kv.mamba_state_bytes
    step = weights + state
    floor_ms = step / (copy_gbps * 1e9) * 1e3
    tps = rec.get("decode", {}).get("median_tokens_per_s")
    return {
        "config": rec["name"],
        "weights_read_bytes": weights,
        "gdn_state_bytes": state,
        "step_bytes": step,
        "copy_gbps": copy_gbps,
        "floor_ms": round(floor_ms, 3),
        "roofline_tokens_per_s": round(1e3 / floor_ms, 1),
        "measured_tokens_per_s": tps,
        "measured_ms": round(1e3 / tps, 3) if tps else None,
        "of_roofline": round(tps * floor_ms / 1e3, 3) if tps else None,
    }


def report_md(result: dict[str, Any]) -> str:
    lines = [
        "| config | term | planner | vLLM logged | error |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rec in result["configs"]:
        if "log_terms" not in rec or rec["log_terms"].get("kv_tokens") is None:
            continue
        total = result.get("machine", {}).get("total_memory")
        for row in planner_rows(rec, result["profile"], result["model"], total):
            err = row.error_pct
            lines.append(
                f"| {row.config} | {row.term} | {_fmt(row.planner)} | {logged_md(rec, row)} | "
                f"{'-' if err is None else f'{err:+.2f}%'} |"
            )
    bw = result.get("machine", {}).get("copy_gbps")
    roof = [
        roofline(rec, result["profile"], result["model"], float(bw))
        for rec in result["configs"]
        if bw and rec.get("decode") and "speculative.method=none" in rec.get("sets", [])
    ]
    if roof:
        lines += [
            "",
            "| config | bytes a step reads (weights + GDN state) | copy GB/s | floor ms | "
            "roofline tok/s | measured tok/s | of the roofline |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in roof:
            gb = {k: r[k] / 1e9 for k in ("step_bytes", "weights_read_bytes", "gdn_state_bytes")}
            lines.append(
                f"| {r['config']} | {gb['step_bytes']:.2f} GB ({gb['weights_read_bytes']:.2f} + "
                f"{gb['gdn_state_bytes']:.3f}) | {r['copy_gbps']} | {r['floor_ms']} | "
                f"{r['roofline_tokens_per_s']} | {r['measured_tokens_per_s']} | "
                f"{r['of_roofline']} |"
            )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Spread:
    """Median and range of repeated measurements."""

    n: int
    median: float | None
    low: float | None
    high: float | None

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread:
        xs = sorted(v for v in values if v is not None)
        if not xs:
            return cls(0, None, None, None)
        mid = len(xs) // 2
        med = xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
        return cls(len(xs), med, xs[0], xs[-1])

    def text(self, unit: str = "s") -> str:
        if self.median is None:
            return "-"
        if self.n == 1:
            return f"{self.median:.2f} {unit}"
        return f"{self.median:.2f} {unit} ({self.low:.2f}-{self.high:.2f}, n={self.n})"


@dataclass(frozen=True)
class SleepRow:
    """One way of taking a model off the GPU and back, with the first token after it."""

    what: str
    off_s: Spread  # /sleep, or stopping the server
    on_s: Spread  # the wake (and weight reload), or start to /health
    first_token_s: Spread  # TTFT of the first request after it
    total_s: Spread  # off + on + first token
    freed_mib: Spread  # nvidia-smi: used before - used asleep (a stopped server frees all)
    greedy_same: bool | None  # greedy texts after it equal those before
    acceptance: float | None  # MTP acceptance of the greedy replies after it (lowest)


def _ttft(r: dict[str, Any]) -> float | None:
    first = r.get("first_request") or {}
    value = first.get("ttft_s")
    return float(value) if value is not None else None


def sleep_rows(rec: dict[str, Any]) -> list[SleepRow]:
    """The `sleep` configuration's cycles and restarts, summarised per kind."""
    rows: list[SleepRow] = []
    cycles = rec.get("sleep", {}).get("cycles", [])
    kinds = (
        ("level 1 sleep + wake", 1, True),
        ("level 2 sleep + wake + reload_weights", 2, True),
        ("level 2 sleep + plain wake (no reload)", 2, False),
    )
    for what, level, reload in kinds:
        cs = [c for c in cycles if c["level"] == level and c["reload"] == reload]
        if not cs:
            continue
        offs = [c["sleep"]["seconds"] for c in cs]
        ons = [c["wake_total_s"] for c in cs]
        firsts = [_ttft(c) for c in cs]
        freed = [
            c["mib_before"] - c["mib_asleep"]
            for c in cs
            if c.get("mib_before") is not None and c.get("mib_asleep") is not None
        ]
        accs = [c["acceptance"] for c in cs if c.get("acceptance") is not None]
        rows.append(
            SleepRow(
                what,
                Spread.of(offs),
                Spread.of(ons),
                Spread.of(firsts),
                Spread.of([a + b + (f or 0.0) for a, b, f in zip(offs, ons, firsts, strict=True)]),
                Spread.of(freed),
                all(c.get("greedy_same") for c in cs),
                min(accs) if accs else None,
            )
        )
    restarts = [r for r in rec.get("restarts", []) if r.get("ready_s") is not None]
    if restarts:
        rows.append(
            SleepRow(
                "full restart (stop, start, /health)",
                Spread.of([r["stop_s"] for r in restarts]),
                Spread.of([r["ready_s"] for r in restarts]),
                Spread.of([_ttft(r) for r in restarts]),
                Spread.of([r["to_first_token_s"] for r in restarts]),
                Spread.of([rec.get("gpu_used_mib")]),
                None,
                None,
            )
        )
    return rows


def sleep_md(result: dict[str, Any]) -> str:
    lines = [
        "| config | how | off | back on | first token | total | GPU MiB freed | greedy same | "
        "acceptance after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rec in result["configs"]:
        for row in sleep_rows(rec):
            same = "-" if row.greedy_same is None else ("yes" if row.greedy_same else "NO")
            acc = "-" if row.acceptance is None else f"{row.acceptance:.3f}"
            lines.append(
                f"| {rec['name']} | {row.what} | {row.off_s.text()} | {row.on_s.text()} | "
                f"{row.first_token_s.text()} | {row.total_s.text()} | "
                f"{row.freed_mib.text('MiB')} | {same} | {acc} |"
            )
    return "\n".join(lines) + "\n"


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3f}"


def cmd_report(a: argparse.Namespace) -> int:
    result = json.loads(Path(a.result).read_text(encoding="utf-8"))
    text = report_md(result)
    if any(sleep_rows(rec) for rec in result["configs"]):
        text += "\n" + sleep_md(result)
    if a.md:
        Path(a.md).write_text(text, encoding="utf-8")
    print(text)
    return 0


def _host_args(r: argparse.ArgumentParser) -> None:
    r.add_argument("--profile", default=DEFAULT_PROFILE)
    r.add_argument("--model", default=DEFAULT_MODEL)
    r.add_argument("--base-dir", default="~/vfleet-gpu-lane", help="vfleet base folder to use")
    r.add_argument("--python", default=sys.executable, help="the python that imports vLLM")
    r.add_argument("--pythonpath", help="prepended to PYTHONPATH for vLLM (a --target install)")
    r.add_argument("--model-dir", help="a built model (default: build it into the base folder)")
    r.add_argument(
        "--dummy-weights",
        action="store_true",
        help="serve a preset of a real checkpoint (the 27B ones) at its own size from a "
        "config-only folder (config.json + tokenizer, written if --model-dir has none) with "
        "random weights: adds extra_args.load-format=dummy (and language_model_only=true for a "
        "multimodal preset) and drops the tiny models' max_model_len=4096",
    )
    r.add_argument("--cuda-home", help="CUDA toolkit for JIT (default: from nvcc on PATH)")
    r.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a vfleet setting added to every configuration (repeatable)",
    )
    r.add_argument("--start-timeout", type=float, default=900, help="seconds to /health")
    r.add_argument("--budget-s", type=float, default=0, help="start nothing new after this long")
    r.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="sleep/wake cycles per level and full restarts in the `sleep` configuration",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="gpu_lane.py",
        description="Serve vfleet's rendered configurations on a CUDA GPU with real vLLM and "
        "measure them (docs/GPU.md).",
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="render, serve and measure each configuration (needs a GPU)")
    r.add_argument("--out", required=True, help="folder for lane.json, lane.md, logs.tar.gz")
    r.add_argument("--only", help=f"comma-separated configurations of: {[c.name for c in MATRIX]}")
    _host_args(r)
    r.set_defaults(fn=cmd_run)
    c = sub.add_parser(
        "caches",
        help="restarts of one configuration with one cache taken away at a time, a cold start "
        "with and without the warmup set, and a fresh base folder with the caches carried in "
        "(needs a GPU; run `run` first so that the caches exist)",
    )
    c.add_argument("--out", required=True, help="folder for caches.json, caches.md")
    c.add_argument("--config", default="main", help="the configuration to restart")
    c.add_argument(
        "--variants", help=f"comma-separated variants of: {[v.name for v in CACHE_VARIANTS]}"
    )
    _host_args(c)
    c.set_defaults(fn=cmd_caches)
    p = sub.add_parser("report", help="planner vs vLLM's logged memory terms (no GPU)")
    p.add_argument("result", help="lane.json from `run`")
    p.add_argument("--md", help="also write the table to this file")
    p.set_defaults(fn=cmd_report)
    a = ap.parse_args(argv)
    rc: int = a.fn(a)
    return rc


if __name__ == "__main__":
    sys.exit(main())
