"""The `vfleet` command line."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from vfleet import __version__
from vfleet.checks.stacks import add_parser as add_stacks_parser
from vfleet.checks.vllm_check import check_launch, check_launch_engine, model_config_json
from vfleet.cli.bench import add_parser as add_bench_parser
from vfleet.cli.containers import add_parsers as add_container_parsers
from vfleet.config.apikey import refuse_key_in_sets
from vfleet.config.defaults import PROMETHEUS_HOST_DIR, PROMETHEUS_LISTEN
from vfleet.config.pins import pins, venv_name
from vfleet.config.profiles import (
    list_models,
    list_profiles,
    load_model,
    profiles_dir,
    validation_error,
)
from vfleet.config.schema import HostVars, ModelPreset, ModelSource
from vfleet.engine.compile import Launch, resolve
from vfleet.engine.decode_cost import DecodeCost, decode_cost
from vfleet.engine.planner import alternatives, arch_from_config, plan_launch
from vfleet.engine.rules import RULES
from vfleet.errors import VfleetError
from vfleet.fleet.balancer import add_parser as add_balancer_parser
from vfleet.fleet.caches import add_parser as add_caches_parser
from vfleet.fleet.doctor import add_parser as add_doctor_parser
from vfleet.fleet.perfgate_run import add_parser as add_perfgate_parser
from vfleet.fleet.releases import add_parser as add_releases_parser
from vfleet.fleet.status import add_parser as add_status_parser
from vfleet.fleet.swap import add_parser as add_swap_parser
from vfleet.fleet.switch import add_parser as add_switch_parser
from vfleet.fleet.tune import add_parser as add_tune_parser
from vfleet.hostside.tinymodels import TinyModelError, parse_draft_acceptance
from vfleet.paths import DASHBOARDS_DIR, hostside_script, tools_dir
from vfleet.render.monitoring import committed_rules_path, prometheus_files, scrape_target
from vfleet.render.promrules import rules_yaml
from vfleet.render.release import release_id, render_files, write_atomic

EPILOG = """\
examples:
  vfleet render --profile cpu --model tiny-hybrid-mtp --out out/
  vfleet explain -p 2x2080ti-22g -m qwen3.6-27b-fp8 --set stack=vllm-0.24.0
  vfleet model make tiny-hybrid-mtp /tmp/tiny-hybrid-mtp
  vfleet profiles

Settings are layered: hardware profile < model preset < --deployment FILE < --set key=value.
Bad input exits 2 and names the file, key and fix; nothing is written.
"""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--profiles-dir",
        metavar="DIR",
        help="load profiles from DIR (default: the repository's profiles/)",
    )


def _deployment_args(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--profile", "-p", help="hardware profile (see `vfleet profiles`)")
    p.add_argument("--model", "-m", help="model preset (see `vfleet profiles`)")
    p.add_argument(
        "--deployment",
        "-d",
        type=Path,
        metavar="FILE",
        help="deployment YAML: {profile, model, settings}",
    )
    p.add_argument(
        "--set",
        "-s",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a setting, e.g. --set max_model_len=8192 "
        "--set speculative.num_speculative_tokens=4 (repeatable)",
    )
    p.add_argument(
        "--base-dir",
        default=HostVars().base_dir,
        metavar="DIR",
        help="where vfleet lives on the serving host (default: %(default)s)",
    )


# Where a key goes instead of --set (render, explain, plan, check-args).
KEY_FIX = (
    "api_key in a deployment file (--deployment FILE, chmod 600), or API_KEY_FILE=FILE at "
    "make deploy (docs/SECURITY.md)"
)


def _launch(a: argparse.Namespace) -> Launch:
    if not a.deployment and not (a.profile and a.model):
        raise VfleetError(
            "missing --profile and --model (or --deployment FILE)",
            fix="e.g. --profile cpu --model tiny-hybrid-mtp",
        )
    refuse_key_in_sets(a.sets, fix=KEY_FIX)
    return resolve(
        a.profile,
        a.model,
        deployment=a.deployment,
        sets=a.sets,
        root=Path(a.profiles_dir) if a.profiles_dir else None,
        host=HostVars(base_dir=a.base_dir),
    )


def cmd_render(a: argparse.Namespace) -> int:
    launch = _launch(a)
    files = render_files(launch)
    write_atomic(files, Path(a.out))
    rid = release_id(files)
    for n in launch.notes:
        if n.level == "warn":
            print(f"warning [{n.rule}]: {n.message}", file=sys.stderr)
    print(f"rendered release {rid} for instance {launch.instance} into {a.out}:")
    for f in files:
        print(f"  {f.name:<32} mode {f.mode:o}")
    return 0


def _wrap(text: str, width: int, indent: str) -> str:
    return textwrap.fill(text, width=width, initial_indent=indent, subsequent_indent=indent)


def cmd_explain(a: argparse.Namespace) -> int:
    launch = _launch(a)
    if a.json:
        out: dict[str, Any] = {
            "profile": launch.profile.name,
            "model": launch.model.name,
            "stack": launch.stack_name,
            "vllm": launch.stack.vllm,
            "decisions": [
                {
                    "kind": e.kind,
                    "key": e.key,
                    "value": "<secret>" if e.secret else e.value,
                    "rule": e.rule,
                    "reason": e.reason,
                    "source": e.source,
                }
                for e in [*launch.args, *launch.env]
            ],
            "notes": [n.__dict__ for n in launch.notes],
            "settings_origin": launch.origin,
        }
        print(json.dumps(out, indent=2, default=str))
        return 0
    width = shutil.get_terminal_size((100, 20)).columns
    st = launch.stack
    print(
        f"{launch.model.name} on {launch.profile.name} — stack {launch.stack_name}: vLLM "
        f"{st.vllm} ({st.vllm_package}), torch {st.torch}"
        + (f", CUDA {st.cuda}" if st.cuda else "")
        + (f", FlashInfer {st.flashinfer}" if st.flashinfer else "")
        + (f", plugin {st.plugin}" if st.plugin else "")
    )
    print(f"command: {launch.venv}/bin/python -m {launch.server_module} --config vllm.yaml\n")
    for title, entries, prefix in (
        ("arguments", launch.args, "--"),
        ("environment", launch.env, ""),
    ):
        print(f"{title}:")
        for e in entries:
            value = (
                "<secret>"
                if e.secret
                else (json.dumps(e.value) if isinstance(e.value, dict | list) else str(e.value))
            )
            print(f"  {prefix}{e.key} = {value or repr('')}")
            print(_wrap(f"[{e.rule}] {e.reason}", width, "      "))
            print(_wrap(f"source: {e.source}", width, "      "))
        print()
    if launch.notes:
        print("notes:")
        for n in launch.notes:
            print(_wrap(f"{n.level} [{n.rule}]: {n.message}", width, "  "))
    if launch.origin:
        print("\nsettings came from:")
        for key, where in sorted(launch.origin.items()):
            print(f"  {key}: {where}")
    return 0


def _plan_sets(a: argparse.Namespace) -> list[str]:
    refuse_key_in_sets(a.sets, fix=KEY_FIX)
    sets = list(a.sets)
    for flag, key in (
        ("kv_space_gib", "kv_space_gib"),
        ("max_model_len", "max_model_len"),
        ("max_num_seqs", "max_num_seqs"),
        ("kv_cache_dtype", "kv_cache_dtype"),
        ("gpu_memory_utilization", "gpu_memory_utilization"),
        ("tensor_parallel_size", "tensor_parallel_size"),
        ("num_speculative_tokens", "speculative.num_speculative_tokens"),
    ):
        value = getattr(a, flag)
        if value is not None:
            sets.append(f"{key}={value}")
    if a.no_speculative:
        sets.append("speculative.method=none")
    if a.no_prefix_caching:
        sets.append("prefix_caching=false")
    return sets


def _fmt_bytes(n: int) -> str:
    return f"{n / (1 << 30):8.2f} GiB"


def cmd_plan(a: argparse.Namespace) -> int:

    root = Path(a.profiles_dir) if a.profiles_dir else None
    preset = None
    if a.model_dir:
        cfg_path = Path(a.model_dir) / "config.json"
        try:
            cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise VfleetError(
                f"cannot read config.json: {exc}",
                where=str(cfg_path),
                fix="point --model-dir at a model folder",
            ) from None
        arch = arch_from_config(cfg, str(cfg_path))
        name = Path(a.model_dir).resolve().name.lower()
        preset = ModelPreset(
            name=name if name[0].isalnum() else "model",
            description=f"from {cfg_path}",
            source=ModelSource(),
            served_model_name=name,
            arch=arch,
        )
    elif not a.model:
        raise VfleetError("missing --model or --model-dir", fix="e.g. --model tiny-hybrid-mtp")
    if not a.profile:
        raise VfleetError("missing --profile", fix="see `vfleet profiles`")
    sets = _plan_sets(a)

    def resolve_with(extra: list[str]) -> Launch:
        return resolve(
            a.profile,
            preset.name if preset else a.model,
            sets=sets + extra,
            root=root,
            preset=preset,
            strict_memory=False,
        )

    layouts: list[tuple[str, list[str]]] = [("", [])]
    if a.layouts:
        count = resolve_with([]).profile.accelerator.count
        layouts += [
            (f"{count // tp} replicas x TP {tp}", [f"tensor_parallel_size={tp}"])
            for tp in (1, 2, 4, 8)
            if tp < count and count % tp == 0
        ]
    results = []
    for label, extra in layouts:
        launch = resolve_with(extra)
        plan = plan_launch(launch)
        alts = (
            alternatives(launch, lambda more, extra=extra: resolve_with(extra + more))
            if not plan.fits or plan.warnings
            else []
        )
        results.append((label or f"1 x TP {plan.tp}", plan, alts, decode_cost(launch)))
    if a.standby_model:
        return _plan_pair(a, results[0][1], root)
    if a.json:
        out = [
            dict(
                p.as_dict(),
                layout=label,
                fixes=[{"set": c, "kv_cache_tokens": q.kv.kv_cache_tokens} for c, q in alts],
                decode_cost=_decode_json(dc, p.num_speculative_tokens),
            )
            for label, p, alts, dc in results
        ]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2, default=str))
    else:
        for label, p, alts, dc in results:
            _print_plan(label, p, alts, dc)
    return 0 if results[0][1].fits else 1


def _plan_pair(a: argparse.Namespace, active: Any, root: Path | None) -> int:
    """`--standby-model`: the standby planned on the same GPUs, then both sleep orders."""
    from vfleet.engine.resident import SLEEPER_GPU_KNOWN, plan_pair

    if a.layouts:
        raise VfleetError("--layouts and --standby-model together", fix="use one of them")
    refuse_key_in_sets(a.standby_sets, fix=KEY_FIX)
    standby = plan_launch(
        resolve(a.profile, a.standby_model, sets=a.standby_sets, root=root, strict_memory=False)
    )
    ram = None if a.host_ram_gib is None else int(a.host_ram_gib * (1 << 30))
    try:
        pair = plan_pair(active, standby, a.sleep_level, ram)
    except ValueError as exc:
        raise VfleetError(
            str(exc), where=f"--profile {a.profile}", fix="plan a resident pair on a GPU profile"
        ) from None
    if a.json:
        doc = asdict(pair)
        doc["active"], doc["standby"] = active.as_dict(), standby.as_dict()
        print(json.dumps(doc, indent=2, default=str))
        return 0 if pair.fits else 1
    _print_plan("active", active, [])
    _print_plan("standby", standby, [])
    mib = 1 << 20
    print(
        f"resident pair, sleep level {pair.level}: a sleeper keeps "
        f"{pair.sleeper_gpu_bytes / mib:,.0f} +/- {pair.sleeper_gpu_uncertainty_bytes / mib:,.0f} "
        f"MiB per GPU ({SLEEPER_GPU_KNOWN}; docs/PLANNER.md)"
    )
    for o in pair.orders:
        print(
            f"  {o.awake} awake, {o.asleep} asleep: its headroom {o.headroom_bytes / mib:,.0f} "
            f"MiB per GPU -> {'fits' if o.fits else 'DOES NOT FIT'}"
        )
    for model, n in pair.host_bytes.items():
        print(f"  host memory of {model} once it has slept: {n / (1 << 30):.1f} GiB")
    print(f"  host memory of the pair: {sum(pair.host_bytes.values()) / (1 << 30):.1f} GiB")
    for note in pair.notes:
        print(f"  note: {note}")
    for problem in pair.problems:
        print(f"  DOES NOT FIT: {problem}")
    return 0 if pair.fits else 1


def _decode_json(dc: DecodeCost, depth: int) -> dict[str, Any]:
    floor = dc.floor_s(depth)
    return dict(
        asdict(dc),
        step_bytes=dc.step_bytes(depth),
        floor_ms=None if floor is None else round(floor * 1e3, 3),
    )


def _print_plan(
    label: str, p: Any, alts: list[tuple[str, Any]], dc: DecodeCost | None = None
) -> None:
    kv = p.kv
    print(
        f"{p.model} on {p.profile} ({label}): max_model_len {p.max_model_len}, "
        f"max_num_seqs {p.max_num_seqs}, KV {p.kv_cache_dtype}, MTP/spec "
        f"{p.num_speculative_tokens}, prefix caching {'on' if p.prefix_caching else 'off'}"
    )
    if p.gpu is not None:
        g = p.gpu
        how = (
            f"utilisation {p.gpu_memory_utilization}: vLLM measures the profiled terms"
            if p.gpu_memory_utilization
            else "explicit kv_cache_memory_bytes: vLLM measures nothing"
        )
        print(
            f"  per GPU (x{p.tp}): {g.total_bytes / (1 << 20):,.0f} MiB as torch reports it "
            f"({g.card_known}); vLLM budget {g.budget_bytes / (1 << 20):,.0f} MiB ({how})"
        )
        rows = [(t.name, t.bytes, t.uncertainty, f"{t.where}, {t.known}") for t in g.terms]
        rows.append(("Available KV cache memory", g.kv_bytes, g.kv_uncertainty_bytes, ""))
        rows.append(
            ("headroom (left on the card)", g.headroom_bytes, g.headroom_uncertainty_bytes, "")
        )
        for name, n, unc, how_known in rows:
            print(
                f"    {name:<40} {n / (1 << 20):8,.0f} +/- {unc / (1 << 20):5,.0f} MiB  "
                f"{how_known}".rstrip()
            )
    print(
        f"  KV: {kv.attn_bytes_per_token} B/token/attention layer, GDN state "
        f"{kv.mamba_state_bytes} B/sequence/layer, block {kv.block_size} tokens, page "
        f"{kv.page_bytes} B (GDN page padded {kv.mamba_padding_pct}%)"
    )
    print(
        f"  groups: {kv.attention_layers} attention + {kv.gdn_layers} GDN layers, "
        f"{kv.group_size} per group; {kv.num_blocks} blocks of "
        f"{kv.bytes_per_block / (1 << 20):.1f} MiB; {kv.blocks_per_request} per max-length request"
    )
    print(
        f"  => {'CPU' if p.device == 'cpu' else 'GPU'} KV cache size: {kv.kv_cache_tokens:,} "
        f"tokens, max concurrency {kv.max_concurrency:.2f}x at {p.max_model_len} tokens"
    )
    if dc is not None:
        unit = "CPU worker" if p.device == "cpu" else "GPU"
        print(f"  decode: {dc.summary(p.num_speculative_tokens, unit)}")
    for note in kv.notes:
        print(f"  note: {note}")
    for problem in p.problems:
        print(f"  DOES NOT FIT: {problem}")
    for warning in p.warnings:
        print(f"  warning: {warning}")
    for change, q in alts:
        print(
            f"  fits with --set {change}: {q.kv.kv_cache_tokens:,} tokens, "
            f"{q.kv.max_concurrency:.2f}x"
        )
    print()


def cmd_rules(a: argparse.Namespace) -> int:
    for r in RULES:
        print(f"{r.name}: {r.summary}")
        print(f"    source: {r.source}")
    return 0


def cmd_profiles(a: argparse.Namespace) -> int:
    root = profiles_dir(a.profiles_dir)
    print("hardware profiles:")
    for name in list_profiles(root):
        print(f"  {name}")
    print("model presets:")
    for name in list_models(root):
        print(f"  {name}")
    return 0


def _has_torch(python: str) -> bool:
    if python == sys.executable:
        return all(importlib.util.find_spec(m) for m in ("torch", "transformers", "tokenizers"))
    try:
        r = subprocess.run(
            [python, "-c", "import torch, transformers, tokenizers"],
            capture_output=True,
            check=False,
        )
    except OSError as exc:
        raise VfleetError(
            f"cannot run {python}: {exc.strerror}",
            key="--python",
            fix="give the python of a virtualenv with torch, transformers and tokenizers "
            f"(e.g. {tools_dir() / 'venvs' / venv_name(pins().host) / 'bin' / 'python'} "
            "after `make tools`)",
        ) from None
    return r.returncode == 0


def _check_draft_acceptance(a: argparse.Namespace, generator: str) -> None:

    if generator != "tiny-hybrid-mtp" or a.unwired:
        raise VfleetError(
            f"--draft-acceptance shapes the MTP head of tiny-hybrid-mtp, not {a.name}"
            + (" --unwired" if a.unwired else ""),
            key="--draft-acceptance",
            fix="build tiny-hybrid-mtp (wired) with it, or leave it out",
        )
    try:
        parse_draft_acceptance(a.draft_acceptance)
    except TinyModelError as exc:
        raise VfleetError(
            str(exc),
            key="--draft-acceptance",
            fix="give 1..8 non-increasing rates in [0, 1], e.g. 0.8,0.55,0.3,0.15",
        ) from None


def _generated_models(root: Path) -> list[str]:
    """The presets `model make` builds: those whose source names a generator (a preset that
    does not load is left out here; loading it by name says what is wrong)."""
    names = []
    for name in list_models(root):
        try:
            if load_model(name, root).source.generator is not None:
                names.append(name)
        except VfleetError:
            continue
    return names


def _config_only_models(root: Path) -> list[str]:
    """The presets `model make --config-only` writes: those not generated (real checkpoints)."""
    names = []
    for name in list_models(root):
        try:
            if load_model(name, root).source.generator is None:
                names.append(name)
        except VfleetError:
            continue
    return names


def _new_model_dir(a: argparse.Namespace) -> Path:
    """The folder `vfleet model make` writes: new or empty, or rebuilt with --force."""
    dest = Path(a.dir)
    if dest.exists() and any(dest.iterdir()) and not a.force:
        raise VfleetError(
            "folder exists and is not empty",
            where=str(dest),
            fix="choose a new folder, or pass --force to rebuild it",
        )
    return dest


def _model_make_config_only(a: argparse.Namespace, preset: ModelPreset) -> int:
    """config.json of the preset's architecture and quantisation, a tokenizer of its vocabulary
    size, no weights: for vLLM's --load-format dummy (bench/gpu_lane.py --dummy-weights)."""
    if a.unwired or a.draft_acceptance is not None or a.seed:
        raise VfleetError(
            "--config-only writes no weights",
            key="--config-only",
            fix="leave out --unwired, --draft-acceptance and --seed",
        )
    dest = _new_model_dir(a)
    python = a.python or sys.executable
    script = hostside_script("tinymodels")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(model_config_json(preset), fh)
        config_json = fh.name
    try:
        cmd = [python, str(script), "config-only", str(dest), "--config-json", config_json]
        if a.force:
            cmd.append("--force")
        rc = subprocess.run(cmd, check=False).returncode
    finally:
        os.unlink(config_json)
    return 0 if rc == 0 else 2


def cmd_model_make(a: argparse.Namespace) -> int:
    preset = load_model(a.name, profiles_dir(a.profiles_dir))
    if a.config_only:
        return _model_make_config_only(a, preset)
    gen = preset.source.generator
    if gen is None:
        raise VfleetError(
            f"{a.name} is not a generated model (it comes from "
            f"{preset.source.hf_repo or 'elsewhere'})",
            key="name",
            fix="vfleet model make builds weights only for generated presets ("
            + ", ".join(_generated_models(profiles_dir(a.profiles_dir)))
            + "); --config-only writes this one's config.json and a tokenizer without weights, "
            "for vLLM's --load-format dummy",
        )
    if a.draft_acceptance is not None:
        _check_draft_acceptance(a, gen)
    dest = _new_model_dir(a)
    python = a.python or sys.executable
    if not _has_torch(python):
        raise VfleetError(
            f"{python} cannot import torch, transformers and tokenizers",
            key="--python",
            fix="pass --python with a vLLM virtualenv's python, e.g. "
            f"{HostVars().base_dir}/venvs/{venv_name(pins().host)}/bin/python",
        )
    script = hostside_script("tinymodels")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(preset.arch.model_dump(), fh)
        arch_json = fh.name
    try:
        cmd = [python, str(script), gen, str(dest), "--arch-json", arch_json, "--seed", str(a.seed)]
        if a.force:
            cmd.append("--force")
        if a.unwired:
            cmd.append("--unwired")
        if a.draft_acceptance:
            cmd += ["--draft-acceptance", a.draft_acceptance]
        rc = subprocess.run(cmd, check=False).returncode
    finally:
        os.unlink(arch_json)
    return 0 if rc == 0 else 2


def cmd_check_args(a: argparse.Namespace) -> int:
    from dataclasses import asdict

    launch = _launch(a)
    if a.syntax_only:
        result = check_launch(launch, python=a.python)
        print(
            json.dumps(result, indent=2)
            if a.json
            else f"vLLM {result['vllm']}: "
            + ("accepted" if result["ok"] else f"REJECTED: {result['error']}")
        )
        return 0 if result["ok"] else 1
    engine = check_launch_engine(launch)
    if a.json:
        print(json.dumps(asdict(engine), indent=2, default=str))
    elif engine.ok:
        print(engine.summary())
    else:
        print(engine.summary(), file=sys.stderr)
        print(
            "  fix: change the setting or rule named above (vfleet explain shows each "
            "argument's rule), or the stack (--set stack=...)",
            file=sys.stderr,
        )
    return 0 if engine.ok else 2


def cmd_prometheus_rules(a: argparse.Namespace) -> int:

    path = Path(a.path) if a.path else committed_rules_path()
    text = rules_yaml()
    if a.write:
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        print(f"wrote {path}")
        return 0
    if a.check:
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            print(
                f"{path} differs from src/vfleet/render/promrules.py. "
                "Fix: vfleet prometheus rules --write",
                file=sys.stderr,
            )
            return 1
        print(f"{path} is up to date")
        return 0
    sys.stdout.write(text)
    return 0


def cmd_prometheus_render(a: argparse.Namespace) -> int:

    launch = _launch(a)
    target = dict(scrape_target(launch), address="127.0.0.1")
    files = prometheus_files(
        [target], prometheus_dir=a.prometheus_dir, listen=a.listen, scrape_interval=a.interval
    )
    write_atomic(files, Path(a.out))
    print(f"rendered Prometheus for {launch.instance} into {a.out} (check: promtool check config)")
    return 0


def cmd_dashboards(a: argparse.Namespace) -> int:
    from vfleet.render import dashboards

    args = ["--write" if a.write else "--check", a.dir]
    return int(dashboards.main(args))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vfleet",
        description="Deploy and operate Qwen3.x-27B hybrid models with MTP on vLLM: typed "
        "profiles -> rules -> rendered units -> deploy -> observe.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"vfleet {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    r = sub.add_parser(
        "render",
        help="render vLLM config, env file, units and launch script",
        description="Render all artefacts of one instance into --out, atomically "
        "(a failure leaves --out as it was).",
    )
    _deployment_args(r)
    r.add_argument("--out", "-o", required=True, metavar="DIR", help="output folder")
    r.set_defaults(fn=cmd_render)

    e = sub.add_parser("explain", help="show every argument and env var with its rule and reason")
    _deployment_args(e)
    e.add_argument("--json", action="store_true", help="machine-readable output")
    e.set_defaults(fn=cmd_explain)

    c = sub.add_parser(
        "check-args",
        help="run the rendered config through the pinned vLLM's own engine code (no GPU needed)",
        description="Run the rendered config through the pinned vLLM version's own code as far "
        "as it goes without a GPU: its argument parser, create_engine_config (model, cache, "
        "parallel, scheduler, speculative and compilation configs) and the attention backend "
        "selection for the model and its MTP draft, with the profile's GPU (compute capability, "
        "memory, count) presented to vLLM's platform layer, the render's VLLM_*/VFLEET_* "
        "environment set and vLLM's general plugins (the SM75 plugin) loaded. Exit 2 when vLLM "
        "refuses, with its message and the vfleet rule that set the offending argument. "
        "Needs `make tools`; docs/VLLM_VERSIONS.md says what runs for real and what is patched.",
    )
    _deployment_args(c)
    c.add_argument(
        "--syntax-only",
        action="store_true",
        help="only vLLM's argument parser and EngineArgs (exit 1 when it rejects)",
    )
    c.add_argument(
        "--python", help="with --syntax-only: python of a virtualenv with the pinned vLLM"
    )
    c.add_argument("--json", action="store_true", help="machine-readable result")
    c.set_defaults(fn=cmd_check_args)

    pl = sub.add_parser(
        "plan",
        help="KV capacity and memory split per GPU, before deploying",
        description="Predict the KV cache capacity exactly as vLLM computes it (block size, "
        "GDN page padding, KV cache groups) and, for GPU profiles, the memory split per GPU: "
        "the terms vLLM's start-up measures (weight, peak activation, non-torch memory, CUDA "
        "graph estimate) and those it never budgets (CUDA context, NCCL, FlashInfer workspace, "
        "unprofiled GDN prefill), each with its +/- and how it is known (docs/PLANNER.md). "
        "Exit 1 when the configuration does not fit (with the smallest changes that do).",
        epilog="examples:\n  vfleet plan -p cpu -m tiny-hybrid-mtp --kv-space-gib 2\n"
        "  vfleet plan -p a100-32g -m qwen3.8-27b-awq-mtp\n"
        "  vfleet plan -p 4x2080ti-22g -m qwen3.6-27b-awq-int4 --layouts\n"
        "  vfleet plan -p h200-141g -m mid-hybrid-mtp --set gpu_memory_utilization=0.45 \\\n"
        "      --standby-model tiny-hybrid-mtp --standby-set gpu_memory_utilization=0.45",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(pl)
    pl.add_argument("--profile", "-p", help="hardware profile")
    pl.add_argument("--model", "-m", help="model preset")
    pl.add_argument("--model-dir", help="read the architecture from DIR/config.json instead")
    pl.add_argument("--kv-space-gib", type=int, help="cpu profile: KV space in GiB")
    pl.add_argument("--max-model-len", type=int)
    pl.add_argument("--max-num-seqs", type=int)
    pl.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    pl.add_argument("--gpu-memory-utilization", type=float)
    pl.add_argument("--tensor-parallel-size", type=int)
    spec = pl.add_mutually_exclusive_group()
    spec.add_argument("--num-speculative-tokens", type=int, metavar="K")
    spec.add_argument("--no-speculative", action="store_true")
    pl.add_argument("--no-prefix-caching", action="store_true")
    pl.add_argument(
        "--layouts",
        action="store_true",
        help="also plan the same GPUs as several smaller TP replicas",
    )
    pl.add_argument("--set", "-s", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    pl.add_argument(
        "--standby-model",
        metavar="MODEL",
        help="also plan MODEL on the same GPUs as a sleeping standby: both must fit awake "
        "beside the other asleep (docs/SWAP.md, docs/PLANNER.md)",
    )
    pl.add_argument(
        "--standby-set",
        dest="standby_sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the standby (repeatable), e.g. gpu_memory_utilization=0.45",
    )
    pl.add_argument(
        "--sleep-level",
        type=int,
        choices=[1, 2],
        default=1,
        help="1: the sleeper's weights wait in host memory; 2: dropped, reloaded from disk",
    )
    pl.add_argument(
        "--host-ram-gib",
        type=float,
        help="the host's memory: refuse a pair whose sleeper does not fit in it",
    )
    pl.add_argument("--json", action="store_true")
    pl.set_defaults(fn=cmd_plan)

    ru = sub.add_parser("rules", help="list the rules of the knowledge base")
    ru.set_defaults(fn=cmd_rules)

    pr = sub.add_parser("profiles", help="list hardware profiles and model presets")
    _common(pr)
    pr.set_defaults(fn=cmd_profiles)

    m = sub.add_parser("model", help="tiny test models")
    msub = m.add_subparsers(dest="model_command", metavar="SUBCOMMAND", required=True)
    generated = ", ".join(_generated_models(profiles_dir(None))) or "none found"
    real = ", ".join(_config_only_models(profiles_dir(None))) or "none found"
    mm = msub.add_parser(
        "make",
        help="build a random-weight test model locally (no downloads)",
        description=f"Build a generated model preset ({generated}) into DIR. Needs a "
        "python with torch, transformers and tokenizers (a vLLM venv has them). With "
        f"--config-only, any preset ({real} too): its config.json (architecture and "
        "quantisation config) and a tokenizer of its vocabulary size, no weights, which vLLM "
        "serves at the real size with --load-format dummy (random weights; docs/GPU.md). That "
        "needs only tokenizers and transformers.",
    )
    _common(mm)
    mm.add_argument(
        "name",
        help=f"a preset whose source names a generator: {generated}; with --config-only also: "
        f"{real}",
    )
    mm.add_argument("dir", help="destination folder")
    mm.add_argument(
        "--config-only",
        action="store_true",
        help="write config.json and a tokenizer only (no weights), for --load-format dummy",
    )
    mm.add_argument("--python", help="python with torch + transformers (default: this one)")
    mm.add_argument("--seed", type=int, default=0, help="weights seed (default: 0)")
    mm.add_argument("--force", action="store_true", help="rebuild a non-empty DIR")
    mm.add_argument(
        "--unwired",
        action="store_true",
        help="keep every weight random: answers are noise and the MTP head's drafts are "
        "rejected (acceptance ~0%%), the case an acceptance-collapse alert must catch",
    )
    mm.add_argument(
        "--draft-acceptance",
        metavar="R1,R2,...",
        help="tiny-hybrid-mtp: make the MTP head's acceptance fall with draft position by "
        "construction; the rates are unconditional, as vLLM's per-position counters give "
        "them (accepted at position i / drafts), e.g. 0.8,0.55,0.3,0.15; positions beyond "
        "the list are never accepted (docs/TUNE.md, The test model)",
    )
    mm.set_defaults(fn=cmd_model_make)

    pr = sub.add_parser(
        "prometheus",
        help="Prometheus rules and config for the fleet",
        description="vfleet's Prometheus recording rules and alerts are generated from "
        "src/vfleet/render/promrules.py; `make deploy` installs them with the fleet's Prometheus.",
    )
    prsub = pr.add_subparsers(dest="prometheus_command", metavar="SUBCOMMAND", required=True)
    prr = prsub.add_parser(
        "rules",
        help="print, check or write the rules file",
        description="Print the generated rules; --check compares them with the committed "
        "observability/prometheus/rules/vfleet.rules.yml (exit 1 if stale); --write updates it.",
    )
    mode = prr.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    mode.add_argument("--write", action="store_true", help="regenerate the file")
    prr.add_argument("--path", help="rules file (default: the committed one)")
    prr.set_defaults(fn=cmd_prometheus_rules)
    prn = prsub.add_parser(
        "render",
        help="render a Prometheus config, rules and targets for one instance",
        description="Render what the fleet's Prometheus would get for this one instance, "
        "for a look or for a Prometheus you run yourself.",
    )
    _deployment_args(prn)
    prn.add_argument("--out", "-o", required=True, metavar="DIR", help="output folder")
    prn.add_argument("--prometheus-dir", default=PROMETHEUS_HOST_DIR, help="its folder on the host")
    prn.add_argument("--listen", default=PROMETHEUS_LISTEN, help="HOST:PORT it listens on")
    prn.add_argument("--interval", default="15s", help="scrape interval (default 15s)")
    prn.set_defaults(fn=cmd_prometheus_render)

    db = sub.add_parser(
        "dashboards",
        help="check or regenerate the Grafana dashboards (needs grafana-foundation-sdk)",
        description="The dashboards are built as code in src/vfleet/render/dashboards.py and "
        "committed as JSON under observability/grafana/dashboards.",
    )
    dbm = db.add_mutually_exclusive_group()
    dbm.add_argument("--check", action="store_true", help="exit 1 if the JSON is stale (default)")
    dbm.add_argument("--write", action="store_true", help="regenerate the JSON")
    db.add_argument(
        "--dir",
        default=str(DASHBOARDS_DIR),
        help="dashboard folder (default: the committed one)",
    )
    db.set_defaults(fn=cmd_dashboards)

    add_status_parser(sub)
    add_doctor_parser(sub)
    add_releases_parser(sub)
    add_caches_parser(sub)
    add_swap_parser(sub)
    add_switch_parser(sub)
    add_tune_parser(sub)
    add_perfgate_parser(sub)
    add_balancer_parser(sub)
    add_bench_parser(sub)
    add_container_parsers(sub, _deployment_args, _launch)
    add_stacks_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        rc: int = a.fn(a)
        return rc
    except VfleetError as exc:
        print(exc.render(), file=sys.stderr)
        return exc.exit_code
    except ValidationError as exc:
        # A value from the command line (--base-dir, --python, ...) that fails the schema.
        err = validation_error(exc, "command line", BaseModel)
        print(err.render(), file=sys.stderr)
        return err.exit_code


if __name__ == "__main__":
    sys.exit(main())
