"""What `vfleet tune` measures on each candidate, and the objective that ranks them.

Each candidate is measured with the same client and scenario code as `vfleet bench`
(src/vfleet/benchmark): `repeats` batches of `concurrency` simultaneous requests, each a short
prompt generating `decode_tokens`, after one warm-up request; MTP figures from vLLM's /metrics
deltas through the sidecar's window. It must be the server's only client (the host is drained
from its balancer while tuning).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from vfleet.errors import VfleetError
from vfleet.measure.client import BenchError, Client
from vfleet.measure.prompts import PromptBuilder, vllm_counter
from vfleet.measure.scenarios import Bench, Metrics, Run, Settings
from vfleet.measure.server import served_model, server_version

ObjectiveKind = Literal["decode", "throughput"]
OBJECTIVES: tuple[ObjectiveKind, ...] = ("decode", "throughput")


@dataclass(frozen=True)
class BenchPlan:
    """How each candidate is measured (part of the state file's identity: a re-run with other
    figures would compare candidates measured differently)."""

    concurrency: int = 1
    decode_tokens: int = 256
    prompt_tokens: int = 256
    repeats: int = 3
    time_limit_s: float = 300.0


@dataclass(frozen=True)
class Measurement:
    # The fastest of the repeats (see summarize: load only ever slows a repeat down).
    decode_tps: float  # per stream: tokens after the first / time after the first
    aggregate_tps: float  # generated tokens of a batch / its wall time (prefill included)
    ttft_p95_s: float | None  # over every request (nearest rank)
    requests: int
    failed_requests: int
    acceptance_rate: float | None = None
    tokens_per_step: float | None = None  # generated tokens per engine step (all streams)
    # Seconds per engine step: tokens_per_step / (concurrency x decode_tps). What the sidecar's
    # recommended depth divides by (the step-times file).
    step_time_s: float | None = None
    bench_s: float = 0.0


@dataclass(frozen=True)
class Objective:
    kind: ObjectiveKind
    concurrency: int
    ttft_slo_s: float | None = None

    def describe(self) -> str:
        what = (
            f"decode tok/s at concurrency {self.concurrency} (streams x per-stream decode speed)"
            if self.kind == "decode"
            else f"throughput at concurrency {self.concurrency} (generated tok/s, prefill included)"
        )
        if self.ttft_slo_s is not None:
            what += f", TTFT p95 <= {self.ttft_slo_s:g} s"
        return what

    def score(self, m: Measurement) -> tuple[float | None, str | None]:
        """(the figure to maximise, or None with why the candidate cannot win)."""
        if m.failed_requests:
            return None, f"{m.failed_requests} of {m.requests} requests failed"
        if self.ttft_slo_s is not None:
            if m.ttft_p95_s is None:
                return None, "no TTFT measured: the SLO cannot be checked"
            if m.ttft_p95_s > self.ttft_slo_s:
                return None, f"TTFT p95 {m.ttft_p95_s:.3f} s > SLO {self.ttft_slo_s:g} s"
        if self.kind == "decode":
            return self.concurrency * m.decode_tps, None
        return m.aggregate_tps, None


def objective_from(kind: str, concurrency: int, slo: float | None) -> Objective:
    if kind not in OBJECTIVES:
        raise VfleetError(
            f"unknown objective {kind!r}", key="--objective", fix=f"one of: {', '.join(OBJECTIVES)}"
        )
    if concurrency < 1:
        raise VfleetError("--concurrency must be >= 1", key="--concurrency", fix="e.g. 1")
    if slo is not None and slo <= 0:
        raise VfleetError("--ttft-slo must be > 0 seconds", key="--ttft-slo", fix="e.g. 2.5")
    if kind == "throughput" and slo is None:
        raise VfleetError(
            "the throughput objective needs a TTFT SLO",
            key="--ttft-slo",
            fix="e.g. --objective throughput --ttft-slo 2.5 (seconds, p95)",
        )
    return Objective(kind, concurrency, slo)


def p95(values: Sequence[float]) -> float | None:
    """Nearest-rank 95th percentile: a value that was measured, never interpolated."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def _mean(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.fmean(got) if got else None


def _best(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return max(got) if got else None


# Why a bench gave no Measurement when no repeat had a decode speed (every stream read late:
# vfleet.measure.client), or none succeeded.
NO_DECODE = "no decode speed measured"
# Benches of one candidate, in all, while they give no decode speed (tune.try_candidate).
BENCH_TRIES = 3


def summarize(runs: Sequence[object], concurrency: int, bench_s: float) -> Measurement | str:
    """A Measurement from the bench's runs (benchmark.scenarios.Run), or why there is none.

    The speeds are the fastest repeat's, not the mean: the machine's other work only ever
    slows a repeat down, never speeds it up, so the fastest repeat is the one least disturbed
    (timeit's reasoning). On the shared 2-core test machine the mean of 5 repeats moved the
    step time of one depth 3x between candidates measured minutes apart (docs/TUNE.md) and
    decided the ranking; the counts (tokens per step, acceptance) are not timed and stay means.
    """

    ok = [r for r in runs if isinstance(r, Run) and r.error is None]
    failed = sum(r.concurrency for r in runs if isinstance(r, Run) and r.error is not None)
    decode = _best([r.decode_tps for r in ok])
    aggregate = _best([r.aggregate_tps for r in ok])
    if decode is None or aggregate is None:
        errors = [r.error for r in runs if isinstance(r, Run) and r.error]
        return NO_DECODE + (f": {errors[-1]}" if errors else "")
    tps = _mean([r.tokens_per_step for r in ok])
    return Measurement(
        decode_tps=round(decode, 3),
        aggregate_tps=round(aggregate, 3),
        ttft_p95_s=p95([t for r in ok for t in r.ttfts_s]),
        requests=sum(r.concurrency for r in ok) + failed,
        failed_requests=failed,
        acceptance_rate=_mean([r.acceptance_rate for r in ok]),
        tokens_per_step=tps,
        step_time_s=tps / (concurrency * decode) if tps and decode else None,
        bench_s=round(bench_s, 1),
    )


def until_decoded(
    bench: Callable[[], Measurement | str], say: Callable[[str], None]
) -> Measurement | str:
    """`bench()`, again while no repeat's stream was read as it was generated (the box fell
    behind for the whole bench, seconds: no decode speed to judge by), BENCH_TRIES in all.
    Any other answer (a Measurement, or another reason) is returned at once."""
    got = bench()
    tries = 1
    while isinstance(got, str) and got.startswith(NO_DECODE) and tries < BENCH_TRIES:
        tries += 1
        say(f"{got}; bench {tries} of at most {BENCH_TRIES}")
        got = bench()
    return got


def measure(url: str, api_key: str | None, plan: BenchPlan) -> Measurement | str:
    """Measure the server at `url` once (a string says why it could not be measured)."""
    from vfleet_healthcheck.vllm_metrics import DEFAULT_VERSION, UnsupportedVersion, families

    client = Client(url, timeout=plan.time_limit_s, api_key=api_key)
    try:
        model, max_model_len = served_model(client, None, None)
    except VfleetError as exc:
        return f"the server did not answer: {exc.message}"
    version = server_version(client)
    try:
        metrics: Metrics | None = Metrics(url, families(version or DEFAULT_VERSION))
    except UnsupportedVersion:
        metrics = None
    settings = Settings(
        scenarios=("concurrency",),
        concurrency=(plan.concurrency,),
        concurrency_context=plan.prompt_tokens,
        decode_tokens=plan.decode_tokens,
        repeats=plan.repeats,
        time_limit_s=plan.time_limit_s,
        request_timeout_s=plan.time_limit_s,
        # Every generation runs to decode_tokens: the speed of equal work, whatever the text.
        ignore_eos=True,
    )
    bench = Bench(
        client,
        model,
        settings,
        PromptBuilder(vllm_counter(client, model)),
        metrics=metrics,
        max_model_len=max_model_len,
    )
    try:
        outcome = bench.run()
    except BenchError as exc:
        return f"bench failed: {exc}"
    return summarize(outcome.runs, plan.concurrency, outcome.duration_s)
