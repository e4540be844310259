"""The performance gate: is a new release as fast as the one it replaces, on the same host?

`vfleet swap` runs it on each host after the health gates (ansible/swap.yml, the canary first):
a short bench through `vfleet bench`'s client (output tok/s per stream at the operator's
concurrency, TTFT p95, MTP acceptance, tokens per engine step) is compared with what the
previous release measured on that host at its own rollout (its perf.json, written by
vfleet_healthcheck.perf_record), or with the saved baseline of the new release's profile x
model x stack when there is none. A figure worse than its tolerance fails the gate, and the
swap rolls the host back as for a failed health gate. Nothing to compare (a first deploy, a new
model with no baseline): the gate is off and says so; the figures are still stored for the next
swap.

The decision is a pure function (`decide`) so `vfleet tune` and the tests can call it on
recorded figures. Tolerances are relative and derived from measured run-to-run noise
(docs/SWAP.md, "Performance gate"; the measurement in docs/BENCHMARKS.md).
"""

from __future__ import annotations

import random
import statistics
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, fields
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from vfleet.config.profiles import find_baseline
from vfleet.errors import VfleetError
from vfleet.measure.client import BenchError, Client, StreamResult
from vfleet.measure.prompts import PromptBuilder, vllm_counter
from vfleet.measure.scenarios import Metrics, Run
from vfleet.measure.stats import percentile

_IMPORT_ERROR: ImportError | None = None
try:  # the perf.json format, shared with the sidecar; `make venv` installs it
    from vfleet_healthcheck.perf_record import (
        BenchShape,
        PerfFigures,
        PerfRecord,
        figure_problem,
    )
except ImportError as exc:  # a bare `pip install vfleet`: the gate cannot run, the CLI can
    _IMPORT_ERROR = exc


def require() -> None:
    if _IMPORT_ERROR is not None:
        raise VfleetError(
            f"the performance gate needs the vfleet-healthcheck package: {_IMPORT_ERROR}",
            where="vfleet perf-gate",
            fix="pip install -e ./healthcheck (`make venv` does), or pass --no-perf-gate",
        )


# The short bench. On the CPU reference profile 5 rounds of 64 tokens take about 10 s with
# the tiny model; on a GPU box a round is a few seconds.
DEFAULT_CONCURRENCY, DEFAULT_ROUNDS, DEFAULT_MAX_TOKENS, DEFAULT_PROMPT_TOKENS = 1, 10, 64, 64


def default_shape(concurrency: int = DEFAULT_CONCURRENCY) -> BenchShape:
    return BenchShape(concurrency, DEFAULT_ROUNDS, DEFAULT_MAX_TOKENS, DEFAULT_PROMPT_TOKENS)


# What "worse" means per figure: a drop for speeds, acceptance and tokens per step; a rise
# for TTFT.
LOWER_IS_BETTER = frozenset({"ttft_p95_s"})
LABELS = {
    "output_tps": "output tok/s",
    "ttft_p95_s": "TTFT p95 s",
    "acceptance_rate": "MTP acceptance",
    "tokens_per_step": "tokens/step",
}


@dataclass(frozen=True)
class Tolerances:
    """The largest relative change in the worse direction that still passes, per figure.

    Defaults from 12 short benches of one unchanged release at concurrency 1 and 12 at 4 on
    the CPU reference profile (docs/BENCHMARKS.md, "Performance gate noise"): the largest
    change between any two of them x 1.25, rounded up to 5 points. Output tok/s varied by up
    to 41 % on the shared 2-core machine, so 0.55; tokens per step by 23 % (at concurrency 4,
    where the batch varies), so 0.30. TTFT p95 of a 64-token prompt is tens of ms and jumped
    by up to 0.15 s (5.5x): it fails only when it at least doubled AND rose by more than
    `ttft_slack_s`: 0.5 s, because CI on a loaded machine saw an as-fast release's TTFT p95 rise
    0.21 -> 0.47 s in two benches in a row (and 0.09 -> 1.41 s once, gone at the second).
    The wired test model always accepts its draft, so acceptance showed no noise: 0.10 is a
    judgement, not a measurement.

    These are for a box that only serves. During a fleet run on the same machine (load average
    up to 35 on 2 cores) an unchanged release's output tok/s fell by up to 78 % and its TTFT
    p95 rose by up to 1.31 s between benches, while tokens per step moved by 13 % at most: the
    fleet test passes wider timing tolerances measured there (docs/SWAP.md, "Timing figures
    under load"), and a failed bench is measured again (perfgate_run._confirmed)."""

    output_tps: float = 0.55
    ttft_p95_s: float = 1.00
    acceptance_rate: float = 0.10
    tokens_per_step: float = 0.30
    ttft_slack_s: float = 0.50  # seconds TTFT p95 may rise whatever the ratio (CI: +0.25 s)

    def of(self, figure: str) -> float:
        value: float = getattr(self, figure)
        return value


DEFAULT_TOLERANCES = Tolerances()
TOLERANCE_KEYS = tuple(f.name for f in fields(Tolerances))
# perf.json's figures, in its order (vfleet_healthcheck.perf_record.FIGURES; a test checks).
FIGURES = ("output_tps", "ttft_p95_s", "acceptance_rate", "tokens_per_step")


@dataclass(frozen=True)
class Reference:
    """What the new release is compared with, and where that came from."""

    source: str  # e.g. "release 3f2a... measured at its rollout, 2026-12-01T16:00Z"
    figures: PerfFigures
    shape: BenchShape | None  # None: a baseline, measured by `vfleet bench`, not by this gate
    speculative: str | None  # the reference's --speculative-config; None: not known


@dataclass(frozen=True)
class Check:
    figure: str
    before: float | None
    after: float | None
    tolerance: float
    change: float | None  # (after - before) / before; None when not compared
    result: str  # ok | worse | not compared
    note: str = ""


@dataclass(frozen=True)
class Verdict:
    state: str  # pass | fail | off
    reasons: tuple[str, ...]
    reference: str | None  # Reference.source
    checks: tuple[Check, ...] = ()
    after: PerfFigures | None = None

    @property
    def passed(self) -> bool:
        return self.state != "fail"

    def text(self) -> str:
        head = f"performance gate: {self.state.upper()}"
        if self.reference:
            head += f" (compared with {self.reference})"
        lines = [head]
        if self.checks:
            rows = [("figure", "before", "after", "change", "tolerance", "result")]
            for c in self.checks:
                worse_way = "+" if c.figure in LOWER_IS_BETTER else "-"
                rows.append(
                    (
                        LABELS[c.figure],
                        _num(c.before),
                        _num(c.after),
                        f"{c.change:+.1%}" if c.change is not None else "-",
                        f"{worse_way}{c.tolerance:.0%}",
                        c.result + (f" ({c.note})" if c.note else ""),
                    )
                )
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            lines += [
                "  " + "  ".join(x.ljust(w) for x, w in zip(r, widths, strict=True)).rstrip()
                for r in rows
            ]
        elif self.after is not None:
            measured = ", ".join(f"{LABELS[k]} {_num(getattr(self.after, k))}" for k in FIGURES)
            lines.append(f"  measured: {measured}")
        lines += [f"  {r}" for r in self.reasons]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, object]:
        return asdict(self) | {"passed": self.passed}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        """What to_dict wrote (the swap reads it back for its report)."""
        after = data.get("after")
        return cls(
            state=str(data["state"]),
            reasons=tuple(str(r) for r in data.get("reasons", ())),
            reference=data.get("reference"),
            checks=tuple(Check(**c) for c in data.get("checks", ())),
            after=PerfFigures(**after) if isinstance(after, dict) else None,
        )


def _num(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"


SPECULATIVE_FIGURES = frozenset({"acceptance_rate", "tokens_per_step"})


def decide(
    before: Reference | None,
    after: PerfFigures,
    shape: BenchShape,
    tolerances: Tolerances = DEFAULT_TOLERANCES,
    speculative: str = "",
) -> Verdict:
    """The gate's verdict on the new release's figures.

    - No reference (first deploy, or a model with neither a previous measurement nor a
      baseline): off, nothing to compare.
    - A reference measured at another shape (concurrency, rounds, tokens): off, since those
      figures do not compare; the new figures become the reference for the next swap.
    - No output speed after: fail (the bench did not measure the release at all).
    - Each figure both sides have: worse than its tolerance fails the gate. A figure only
      one side has is listed as not compared (e.g. speculation turned off: no acceptance;
      its effect on speed is what output tok/s measures).
    - Acceptance and tokens per step only between releases with the same speculative config:
      a new depth changes both by design (`vfleet tune` rolls one out through this gate);
      whether it pays off is what output tok/s and TTFT say.
    """
    # Not a measurement on either side: fail closed (a NaN compares as "not worse" with
    # anything, so without this it passed). The CLI refuses a bad reference file earlier.
    unusable = [f"measured {why}" for why in figure_problems(after)]
    if before is not None:
        unusable += [f"reference {why}" for why in figure_problems(before.figures)]
    if unusable:
        return Verdict(
            "fail",
            tuple(f"{why}: not a measurement, so not passed" for why in unusable),
            before.source if before else None,
            after=after,
        )
    if after.output_tps is None:
        return Verdict(
            "fail",
            ("the bench measured no output speed on the new release",),
            before.source if before else None,
            after=after,
        )
    if before is None:
        return Verdict(
            "off",
            (
                "nothing to compare: no earlier measurement on this host and no "
                "saved baseline; these figures are the reference from now on",
            ),
            None,
            after=after,
        )
    if before.shape is not None and before.shape != shape:
        why = (
            f"the reference was measured at {_shape(before.shape)}, this bench at "
            f"{_shape(shape)}: not comparable; these figures are the reference from now on"
        )
        return Verdict("off", (why,), before.source, after=after)
    respec = before.speculative is not None and before.speculative != speculative
    checks = tuple(
        Check(
            f,
            getattr(before.figures, f),
            getattr(after, f),
            tolerances.of(f),
            None,
            "not compared",
            "speculative config changed",
        )
        if respec and f in SPECULATIVE_FIGURES
        else _check(f, before.figures, after, tolerances)
        for f in FIGURES
    )
    worse = [c for c in checks if c.result == "worse"]
    if not any(c.result != "not compared" for c in checks):
        return Verdict(
            "off",
            ("the reference has none of the figures this bench measured",),
            before.source,
            checks,
            after,
        )
    reasons = tuple(
        f"{LABELS[c.figure]} {_num(c.before)} -> {_num(c.after)} ({c.change:+.1%}), beyond "
        f"the tolerance of {c.tolerance:.0%}" + (f" ({c.note})" if c.note else "")
        for c in worse
        if c.change is not None
    )
    return Verdict("fail" if worse else "pass", reasons, before.source, checks, after)


def figure_problems(figures: PerfFigures) -> list[str]:
    """'LABEL: why' for each figure that cannot be a measurement (perf_record.BOUNDS)."""
    found = []
    for key in FIGURES:
        value = getattr(figures, key)
        problem = None if value is None else figure_problem(key, value)
        if problem:
            found.append(f"{LABELS[key]}: {problem}")
    return found


def _shape(s: BenchShape) -> str:
    return f"concurrency {s.concurrency}, {s.rounds} rounds of {s.max_tokens} tokens"


def _check(figure: str, before: PerfFigures, after: PerfFigures, tol: Tolerances) -> Check:
    b, a, tolerance = getattr(before, figure), getattr(after, figure), tol.of(figure)
    if b is None or a is None:
        note = "not measured " + ("before" if b is None else "after")
        if b is None and a is None:
            note = "measured on neither side"
        return Check(figure, b, a, tolerance, None, "not compared", note)
    if b <= 0:
        return Check(figure, b, a, tolerance, None, "not compared", "reference is 0")
    change = (a - b) / b
    if figure == "ttft_p95_s":
        worse = change > tolerance and a - b > tol.ttft_slack_s
        note = f"+{a - b:.2f} s, slack {tol.ttft_slack_s:g} s" if change > tolerance else ""
        return Check(figure, b, a, tolerance, change, "worse" if worse else "ok", note)
    worse = change > tolerance if figure in LOWER_IS_BETTER else change < -tolerance
    return Check(figure, b, a, tolerance, change, "worse" if worse else "ok")


# --------------------------------------------------------------------------- the reference


def reference_from_record(record: PerfRecord) -> Reference:
    return Reference(
        f"release {record.release} measured at its rollout, {record.measured_at}",
        record.figures,
        record.shape,
        record.speculative,
    )


def reference_for(
    previous: PerfRecord | None,
    weights: str,
    profile: str,
    preset: str,
    stack: str,
    root: Path | None = None,
) -> Reference | None:
    """The previous release's own measurement when it served the same weights; else the saved
    baseline of profile x preset x stack (its slowest decode run and lowest acceptance: a
    `vfleet bench` measured it, with longer generations, so only a floor is fair); else None.

    Another model's speed says nothing about this one's, so a model swap compares with the
    baseline."""

    if previous is not None and previous.model == weights:
        return reference_from_record(previous)
    found = find_baseline(profile, preset, stack, root)
    if found is None:
        return None
    path, baseline = found
    decode = baseline.decode_tokens_per_second
    accept = baseline.spec_decode_acceptance_rate
    figures = PerfFigures(
        output_tps=decode.low if decode else None,
        acceptance_rate=accept.low if accept else None,
    )
    for key, name in (
        ("output_tps", "decode_tokens_per_second"),
        ("acceptance_rate", "spec_decode_acceptance_rate"),
    ):
        value = getattr(figures, key)
        problem = None if value is None else figure_problem(key, value)
        if problem:
            raise VfleetError(
                f"not usable as the performance gate's reference: {problem}",
                where=str(path),
                key=f"{name}.low",
                fix="measure it again (`vfleet bench run --save-baseline`) or remove the file",
            )
    return Reference(f"the baseline {path.name} (its slowest run)", figures, None, None)


# --------------------------------------------------------------------------- the bench


class MeasureError(Exception):
    """The new release could not be measured: a failed gate, not bad input."""


@dataclass
class Measurement:
    figures: PerfFigures
    requests: int
    seconds: float
    warnings: list[str] = field(default_factory=list)
    # Requests of others that got their first token while the bench ran (vLLM's TTFT
    # histogram count over the bench, less the bench's own); None: /metrics not read.
    beside: int | None = None


def measure(
    url: str,
    model: str,
    shape: BenchShape,
    *,
    api_key: str | None = None,
    timeout_s: float = 120.0,
    seed: int = 0,
) -> Measurement:
    """`shape.rounds` rounds of `shape.concurrency` simultaneous streamed chat requests, each
    a fresh random prompt of about `shape.prompt_tokens` tokens generating exactly
    `shape.max_tokens` (ignore_eos), after one warm-up request; the MTP figures are the
    server's /metrics counter deltas over all rounds (as `vfleet bench` reads them)."""
    import time

    from vfleet_healthcheck.vllm_metrics import DEFAULT_VERSION, UnsupportedVersion, families

    client = Client(url, timeout=timeout_s, api_key=api_key)
    warnings: list[str] = []
    try:
        version = client.request_json("GET", "/version", timeout=30)
        vllm = str(version.get("version")) if isinstance(version, dict) else DEFAULT_VERSION
    except BenchError as exc:
        raise MeasureError(f"{url} does not answer: {exc}") from None
    try:
        metrics: Metrics | None = Metrics(url, families(vllm))
    except UnsupportedVersion as exc:
        metrics = None
        warnings.append(f"no MTP figures: {exc}")
    builder = PromptBuilder(vllm_counter(client, model))
    rng = random.Random(seed)
    extra = {"ignore_eos": True}  # every request generates max_tokens: rounds compare

    def one(max_tokens: int) -> StreamResult:
        prompt = builder.build(shape.prompt_tokens, rng).text
        return client.chat(model, prompt, max_tokens, extra=extra, timeout=timeout_s)

    t0 = time.monotonic()
    results: list[StreamResult] = []
    try:
        one(8)  # kernels compiled on first use must not land in the first round
        before = metrics.read() if metrics else None
        with ThreadPoolExecutor(max_workers=shape.concurrency) as pool:
            for _ in range(shape.rounds):
                futures = [pool.submit(one, shape.max_tokens) for _ in range(shape.concurrency)]
                results += [f.result() for f in futures]
        after = metrics.read() if metrics else None
    except BenchError as exc:
        raise MeasureError(f"a bench request failed: {exc}") from None
    run = Run("perfgate", shape.prompt_tokens, "cold", 0, shape.max_tokens)
    if metrics is not None:
        metrics.apply(run, before, after)
        if run.error:
            raise MeasureError(run.error)
        if metrics.error:
            warnings.append(f"/metrics not read: {metrics.error}")
    beside = None
    if before is not None and after is not None:
        first = [v[1].values.get("ttft/count") for v in (before, after)]
        if first[0] is not None and first[1] is not None:
            beside = max(0, round(first[1] - first[0]) - len(results))
    speeds = [r.tokens / r.e2e_s for r in results if r.e2e_s > 0 and r.tokens]
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    figures = PerfFigures(
        output_tps=round(statistics.median(speeds), 2) if speeds else None,
        ttft_p95_s=round(percentile(ttfts, 95), 4) if ttfts else None,
        acceptance_rate=_rounded(run.acceptance_rate, 4),
        tokens_per_step=_rounded(run.tokens_per_step, 3),
    )
    return Measurement(figures, len(results), time.monotonic() - t0, warnings, beside)


def _rounded(value: float | None, digits: int) -> float | None:
    return round(value, digits) if value is not None else None


def record_of(
    release: str, weights: str, shape: BenchShape, figures: PerfFigures, speculative: str
) -> PerfRecord:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return PerfRecord(release, weights, now, shape, figures, speculative)
