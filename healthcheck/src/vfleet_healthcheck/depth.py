"""The MTP depth that maximises expected decode speed, from live acceptance and step times.

Standard library only: the sidecar (vfleet-exporter) and vfleet (`vfleet status`, `vfleet tune`,
the benchmark) use this one module, so the formula and the step-time file format exist once.

The formula (docs/TUNE.md, "Recommended depth"). With per-position acceptance rates r_1, r_2, ...
as vLLM counts them (unconditional: drafts whose token at position i was accepted / drafts, so
r_i already includes every earlier position being accepted), one verify step at depth k yields

    tokens_per_step(k) = 1 + r_1 + ... + r_k        (the target's own token, plus the accepted)
    tokens_per_second(k) = tokens_per_step(k) / step_seconds(k)

where step_seconds(k) is the measured time of one decode step at depth k (target forward over
1 + k tokens plus k draft forwards), from a step-time table (below). The recommended depth is
the table's depth with the highest tokens_per_second(k); a tie goes to the smaller depth.

Positions beyond the running depth are not measured live. Where the step-time table holds the
acceptance `vfleet tune` measured at each depth (``accepted_per_draft``: A(k) = accepted draft
tokens per draft at depth k, so the table's own rate at position j is A(j) - A(j - 1)), a
further position keeps the table's conditional rate: c_j = (A(j) - A(j-1)) / (A(j-1) - A(j-2)),
r_j = r_{j-1} * c_j (live rates first, the table's decline after them). Elsewhere they are
extrapolated conservatively: with conditional rates c_i = r_i / r_{i-1} (r_0 = 1), each further
position keeps falling by the last observed decline, d = c_k / c_{k-1} capped at 1 (with one
observed position, d = c_1), so c_{k+1} = c_k * d, c_{k+2} = c_{k+1} * d, ... Drafts of drafts
compound the head's errors, so acceptance falls with position in every model we measured;
continuing the last decline (never a rise) gives deeper positions less credit than a flat
continuation would, but it is a guess: on the test model it credits position 2 three times
what the table measured (docs/TUNE.md).

The step-time table is a JSON file (``step-times.json`` in the instance folder: the sidecar
finds its path in sidecar.json; written by `vfleet tune` or bench/mtp_depth.py through
:func:`save_step_times`)::

    {"kind": "vfleet-step-times", "schema_version": 1,
     "measured_at": "2026-12-01T16:40:00Z",          # UTC, when the sweep ended
     "method": "bench decode, 800 tokens, ...",       # how: tool, command, workload
     "concurrency": 1,                                # requests in flight while measured
     "seconds_per_step": {"0": 0.0101, "1": 0.0123, ...},   # MTP depth -> seconds per step
     "accepted_per_draft": {"1": 0.72, "2": 0.84, ...}}     # optional: depth -> A(k)
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

STEP_TIMES_KIND = "vfleet-step-times"
STEP_TIMES_SCHEMA = 1
#: Deepest MTP depth a table may hold (vLLM's MTP on these models runs 1..5; a typo guard).
MAX_DEPTH = 16


class StepTimesError(ValueError):
    """A step-time file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class StepTimes:
    """Measured seconds per decode step at each MTP depth (0 = no speculative decoding)."""

    seconds_per_step: Mapping[int, float]
    measured_at: str  # ISO 8601 UTC
    method: str  # how it was measured: the tool or command and the workload
    concurrency: int = 1
    # Accepted draft tokens per draft (per verify step) measured at each depth >= 1, beside the
    # step time: what carries the recommendation past the running depth (module docstring).
    accepted_per_draft: Mapping[int, float] = field(default_factory=dict)

    @classmethod
    def measured(
        cls,
        seconds_per_step: Mapping[int, float],
        *,
        method: str,
        concurrency: int = 1,
        accepted_per_draft: Mapping[int, float] | None = None,
    ) -> StepTimes:
        """A table measured just now."""
        now = datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")
        accepted = dict(sorted((accepted_per_draft or {}).items()))
        return cls(dict(sorted(seconds_per_step.items())), now, method, concurrency, accepted)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "kind": STEP_TIMES_KIND,
            "schema_version": STEP_TIMES_SCHEMA,
            "measured_at": self.measured_at,
            "method": self.method,
            "concurrency": self.concurrency,
            "seconds_per_step": {str(k): v for k, v in sorted(self.seconds_per_step.items())},
        }
        if self.accepted_per_draft:
            doc["accepted_per_draft"] = {
                str(k): v for k, v in sorted(self.accepted_per_draft.items())
            }
        return doc

    @classmethod
    def from_json(cls, data: Any, where: str) -> StepTimes:
        def bad(key: str, why: str) -> StepTimesError:
            return StepTimesError(f"{where}: {key}: {why}")

        if not isinstance(data, dict):
            raise bad("(top)", "expected a JSON object")
        if data.get("kind") != STEP_TIMES_KIND:
            raise bad("kind", f"expected {STEP_TIMES_KIND!r}, got {data.get('kind')!r}")
        if data.get("schema_version") != STEP_TIMES_SCHEMA:
            raise bad(
                "schema_version",
                f"this reader knows {STEP_TIMES_SCHEMA}, got {data.get('schema_version')!r}",
            )
        measured_at = data.get("measured_at")
        if not isinstance(measured_at, str) or _timestamp(measured_at) is None:
            raise bad("measured_at", f"expected an ISO 8601 UTC time, got {measured_at!r}")
        method = data.get("method")
        if not isinstance(method, str) or not method:
            raise bad("method", "expected a non-empty string saying how it was measured")
        concurrency = data.get("concurrency", 1)
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise bad("concurrency", f"expected an integer >= 1, got {concurrency!r}")
        table = data.get("seconds_per_step")
        if not isinstance(table, dict) or not table:
            raise bad("seconds_per_step", "expected a non-empty object {depth: seconds}")
        steps: dict[int, float] = {}
        for key, value in table.items():
            if not (isinstance(key, str) and key.isdigit() and int(key) <= MAX_DEPTH):
                raise bad(f"seconds_per_step.{key}", f"a depth is an integer 0..{MAX_DEPTH}")
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not (math.isfinite(value) and value > 0):
                raise bad(f"seconds_per_step.{key}", f"expected seconds > 0, got {value!r}")
            steps[int(key)] = float(value)
        accepted: dict[int, float] = {}
        extra = data.get("accepted_per_draft", {})
        if not isinstance(extra, dict):
            raise bad("accepted_per_draft", "expected an object {depth: accepted per draft}")
        for key, value in extra.items():
            if not (isinstance(key, str) and key.isdigit() and 1 <= int(key) <= MAX_DEPTH):
                raise bad(f"accepted_per_draft.{key}", f"a depth is an integer 1..{MAX_DEPTH}")
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not (math.isfinite(value) and 0 <= value <= int(key)):
                raise bad(
                    f"accepted_per_draft.{key}",
                    f"expected accepted draft tokens per draft, 0..{key}, got {value!r}",
                )
            accepted[int(key)] = float(value)
        return cls(dict(sorted(steps.items())), measured_at, method, concurrency, accepted)

    @property
    def measured_at_unix(self) -> float:
        t = _timestamp(self.measured_at)
        assert t is not None  # checked on load / construction by from_json
        return t


def _timestamp(text: str) -> float | None:
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    return t.timestamp() if t.tzinfo is not None else None


def load_step_times(path: str | os.PathLike[str]) -> StepTimes:
    """Read a step-time file. OSError if it cannot be read, StepTimesError if it is bad."""
    where = str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as exc:
        raise StepTimesError(f"{where}: not JSON: {exc}") from None
    return StepTimes.from_json(data, where)


def save_step_times(path: str | os.PathLike[str], table: StepTimes) -> None:
    """Write a step-time file atomically (a reader sees the old file or the new one)."""
    StepTimes.from_json(table.to_json(), str(path))  # never write what load would refuse
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(json.dumps(table.to_json(), indent=2) + "\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# --------------------------------------------------------------------------- the formula


def table_conditional(accepted_per_draft: Mapping[int, float], position: int) -> float | None:
    """The conditional rate at ``position`` (>= 2) from a table's accepted tokens per draft
    A(k): (A(j) - A(j-1)) / (A(j-1) - A(j-2)), A(0) = 0, clipped to 0..1 (a count's noise
    must not make a deeper draft look likelier than the one before it); None when the table
    lacks a depth it needs."""
    a = {0: 0.0, **accepted_per_draft}
    if any(k not in a for k in (position, position - 1, position - 2)):
        return None
    here = a[position] - a[position - 1]
    before = a[position - 1] - a[position - 2]
    if before <= 0:
        return 0.0
    return min(1.0, max(0.0, here / before))


def extrapolate(
    rates: Sequence[float], depth: int, accepted_per_draft: Mapping[int, float] | None = None
) -> tuple[tuple[float, ...], int]:
    """Unconditional rates for positions 1..depth: the measured ones, then the positions
    beyond them: from the table's conditional rates where ``accepted_per_draft`` has them,
    else extrapolated (the module docstring says how). Returns (rates, how many were not
    measured)."""
    known = [min(1.0, max(0.0, float(r))) for r in rates]
    for i in range(1, len(known)):  # accepted at i + 1 implies accepted at i
        known[i] = min(known[i], known[i - 1])
    if depth <= len(known):
        return tuple(known[:depth]), 0
    if not known:
        raise ValueError("no measured position to extrapolate from")
    out = list(known)
    table = accepted_per_draft or {}
    while len(out) < depth:
        measured = table_conditional(table, len(out) + 1)
        if measured is None:
            break
        out.append(out[-1] * measured)
    conditional = [out[0]] + [
        out[i] / out[i - 1] if out[i - 1] > 0 else 0.0 for i in range(1, len(out))
    ]
    last = conditional[-1]
    if len(conditional) >= 2 and conditional[-2] > 0:
        decline = min(1.0, last / conditional[-2])
    else:
        decline = last
    while len(out) < depth:
        last *= decline
        out.append(out[-1] * last)
    return tuple(out), depth - len(known)


@dataclass(frozen=True)
class DepthEstimate:
    depth: int
    rates: tuple[float, ...]  # positions 1..depth, measured then extrapolated
    extrapolated: int  # how many of ``rates`` are extrapolated
    tokens_per_step: float
    seconds_per_step: float
    tokens_per_second: float


@dataclass(frozen=True)
class Recommendation:
    running_depth: int
    recommended_depth: int
    estimates: tuple[DepthEstimate, ...]  # one per depth of the step-time table

    def estimate(self, depth: int) -> DepthEstimate | None:
        return next((e for e in self.estimates if e.depth == depth), None)

    @property
    def gain(self) -> float | None:
        """Expected tok/s at the recommended depth / at the running depth - 1 (0.12: 12 %
        faster); None when the table has no step time for the running depth."""
        running, best = self.estimate(self.running_depth), self.estimate(self.recommended_depth)
        if running is None or best is None:
            return None
        return best.tokens_per_second / running.tokens_per_second - 1.0


def tokens_per_step(rates: Sequence[float]) -> float:
    """1 + the sum of the unconditional acceptance rates of the positions drafted."""
    return 1.0 + sum(rates)


def recommend(rates: Sequence[float], running_depth: int, table: StepTimes) -> Recommendation:
    """The depth of ``table`` with the highest expected tok/s, given the acceptance ``rates``
    measured at ``running_depth`` (position 1 first; at least one position)."""
    if not rates:
        raise ValueError("no acceptance measured: nothing to recommend from")
    estimates = []
    for depth, seconds in sorted(table.seconds_per_step.items()):
        used, guessed = extrapolate(rates, depth, table.accepted_per_draft)
        per_step = tokens_per_step(used)
        estimates.append(DepthEstimate(depth, used, guessed, per_step, seconds, per_step / seconds))
    best = max(estimates, key=lambda e: (e.tokens_per_second, -e.depth))
    return Recommendation(running_depth, best.depth, tuple(estimates))


# --------------------------------------------------------------------------- live advice

#: Why there is (or is not) a recommendation: the sidecar's and `vfleet status`'s state label.
STATES = {
    "ok": "recommended from the window's acceptance and the step-time table",
    "modelled": "recommended from the window's acceptance and step times the decode cost model "
    "gives from the live step (no step-time table; docs/TUNE.md, The cost model)",
    "speculation_off": "no speculative decoding runs: no acceptance to judge depths by",
    "no_drafts": "no drafts in the window (no traffic): nothing measured to judge by",
    "no_step_times": "no step-time table for this instance (run `vfleet tune`)",
    "bad_step_times": "the step-time table cannot be read (see the sidecar's log)",
}


class StepTimesSource:
    """A step-time file, read again only when it changes (the sidecar asks at every scrape)."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = Path(path) if path else None
        self._seen: tuple[int, int] | None = None
        self._result: tuple[StepTimes | None, str, str] = (None, "no_step_times", "")

    def get(self) -> tuple[StepTimes | None, str, str]:
        """(table or None, state, detail); state is "ok", "no_step_times" or "bad_step_times"."""
        if self.path is None:
            return None, "no_step_times", "no step-time file configured"
        try:
            st = self.path.stat()
        except FileNotFoundError:
            self._seen = None
            return None, "no_step_times", f"{self.path} does not exist"
        except OSError as exc:
            self._seen = None
            return None, "bad_step_times", f"{self.path}: {exc}"
        key = (st.st_mtime_ns, st.st_size)
        if key != self._seen:
            self._seen = key
            try:
                self._result = (load_step_times(self.path), "ok", "")
            except (OSError, StepTimesError) as exc:
                self._result = (None, "bad_step_times", str(exc))
        return self._result


@dataclass(frozen=True)
class Advice:
    state: str  # a key of STATES
    running_depth: int | None
    recommendation: Recommendation | None = None
    table: StepTimes | None = None
    detail: str = ""


def rates_from_positions(positions: Mapping[str, float]) -> tuple[float, ...]:
    """The window's per-position rates ({"0": r_1, "1": r_2, ...}, vLLM's 0-based position
    label) as r_1, r_2, ...: the unbroken run from position 0."""
    out: list[float] = []
    while str(len(out)) in positions:
        out.append(positions[str(len(out))])
    return tuple(out)


def advise(
    positions: Mapping[str, float],
    running_depth: int | None,
    source: StepTimesSource,
    step_s: float | None = None,
    cost: StepCost | None = None,
    concurrency: int = 1,
) -> Advice:
    """The recommendation for one instance now. ``running_depth``: the rendered
    num_speculative_tokens (0 without speculative decoding); None when unknown, then the number
    of positions vLLM reports stands in for it. Without a step-time table, ``cost`` (the
    release's decode cost) and ``step_s`` (the window's live step) model one; a measured table
    always wins."""
    rates = rates_from_positions(positions)
    depth = running_depth if running_depth is not None else (len(rates) or None)
    if depth == 0:
        return Advice("speculation_off", 0)
    table, state, detail = source.get()
    # Only MTP has a draft the model knows (ngram drafts on the host: no bytes to model).
    mtp = cost is not None and cost.draft_layers > 0
    if table is None and state == "no_step_times" and cost is not None and mtp and step_s and depth:
        if not rates:
            return Advice("no_drafts", depth, detail=detail)
        modelled = cost.table(step_s, depth, concurrency)
        return Advice("modelled", depth, recommend(rates[:depth], depth, modelled), modelled)
    if table is None:
        return Advice(state, depth, detail=detail)
    if not rates or depth is None:
        return Advice("no_drafts", depth, table=table)
    return Advice("ok", depth, recommend(rates[:depth], depth, table), table)


# --------------------------------------------------------------------------- the cost model

#: Bounds on a stated memory bandwidth, GB/s (the hardware profile's schema uses the same).
MIN_GBS, MAX_GBS = 0.001, 1e6


@dataclass(frozen=True)
class StepCost:
    """What one decode step reads, per GPU, and what one more MTP depth adds (sidecar.json
    ``decode_cost``, written by vfleet from vfleet.engine.decode_cost)."""

    base_bytes: int  # a step without speculative decoding
    per_depth_bytes: int  # one more depth: a draft call and the verify's extra state
    target_layers: int
    draft_layers: int
    bandwidth_gbs: float
    graph_mode: str

    @classmethod
    def from_json(cls, data: Any, where: str) -> StepCost:
        def bad(key: str, why: str) -> StepTimesError:
            return StepTimesError(f"{where}: decode_cost.{key}: {why}")

        if not isinstance(data, dict):
            raise bad("(top)", "expected a JSON object")

        def number(key: str, lo: float, hi: float, integer: bool) -> float:
            v = data.get(key)
            kinds = (int,) if integer else (int, float)
            if isinstance(v, bool) or not isinstance(v, kinds) or not math.isfinite(v):
                raise bad(key, f"expected a number, got {v!r}")
            if not lo <= v <= hi:
                raise bad(key, f"expected {lo:g}..{hi:g}, got {v!r}")
            return float(v)

        mode = data.get("graph_mode")
        if not (
            isinstance(mode, str)
            and 0 < len(mode) <= 32
            and all(c.isupper() or c == "_" for c in mode)
        ):
            raise bad("graph_mode", f"expected a CUDA graph mode name (FULL, ...), got {mode!r}")
        cost = cls(
            int(number("base_bytes", 1, 1e13, True)),
            int(number("per_depth_bytes", 0, 1e13, True)),
            int(number("target_layers", 1, 10_000, True)),
            int(number("draft_layers", 0, 100, True)),
            number("bandwidth_gbs", MIN_GBS, MAX_GBS, False),
            mode,
        )
        if (cost.draft_layers == 0) != (cost.per_depth_bytes == 0):
            raise bad("draft_layers", "a depth with bytes needs draft layers, and no bytes none")
        return cost

    def floor_s(self, depth: int) -> float:
        """Seconds the step's bytes take at the card's bandwidth."""
        return (self.base_bytes + depth * self.per_depth_bytes) / (self.bandwidth_gbs * 1e9)

    def layers(self, depth: int) -> int:
        return self.target_layers + depth * self.draft_layers

    def per_layer_s(self, step_s: float, depth: int) -> float:
        """What a measured step took beyond its floor, per layer it ran (never below 0)."""
        return max(0.0, step_s - self.floor_s(depth)) / self.layers(depth)

    def step_s(self, measured_s: float, measured_depth: int, depth: int) -> float:
        """Depth ``depth``'s step modelled from one measured at ``measured_depth``."""
        per_layer = self.per_layer_s(measured_s, measured_depth)
        return self.floor_s(depth) + per_layer * self.layers(depth)

    def depths(self, running: int) -> range:
        """The depths modelled from a step at ``running``: it and the shallower ones. Against
        every measured pair the model under-costs a depth (1.3x with full decode graphs on the
        H200, 2.3-4.3x under PIECEWISE; vLLM 0.24.0 runs the drafter's own calls PIECEWISE
        even with full graphs, llm_base_proposer.py initialize_cudagraph_keys), so a deeper
        depth is never modelled: the advice leans to the running depth, not past it."""
        return range(0, running + 1)

    def errors(self, measured: Mapping[int, float], base: int) -> dict[int, float]:
        """How far the model is off on measured steps: each other depth modelled from
        ``base``'s step, as (modelled / measured - 1) by depth (`vfleet tune`'s check)."""
        return {
            d: self.step_s(measured[base], base, d) / s - 1.0
            for d, s in sorted(measured.items())
            if d != base and s > 0
        }

    def table(self, measured_s: float, running: int, concurrency: int = 1) -> StepTimes:
        """A step-time table modelled from one measured step (the sidecar's live step, at the
        window's ``concurrency``: the bytes are for one sequence, the rest per layer absorbs
        what a larger batch adds)."""
        steps = {d: self.step_s(measured_s, running, d) for d in self.depths(running)}
        return StepTimes.measured(
            steps,
            method=(
                f"modelled from the live step at MTP {running} ({measured_s * 1e3:.2f} ms): "
                f"bytes at {self.bandwidth_gbs:g} GB/s plus the rest per layer"
            ),
            concurrency=concurrency,
        )
