"""The benchmark scenarios, planned up front and run one request (or batch) at a time.

- context: per context length a cold request (new random first line: nothing cached) then a
  warm one (the same prompt again: the prefix cache can serve it), each generating
  ``decode_tokens``. TTFT, prefill and decode speed and MTP acceptance by context (seed 001 §4.1).
- decode: long generations from a short prompt, for the decode speed and acceptance alone.
- prefill: cold prompts of 2K..32K tokens with 1 output token, fitted as
  TTFT = fixed + N / rate (seed 004).
- concurrency: 1, 2, 4... simultaneous requests; aggregate generated tokens per second.

Around every run /metrics is read before and after, and the counter deltas go through the
sidecar's ``Window`` (vfleet_healthcheck): acceptance, mean acceptance length and tokens per
step are computed exactly as ``vfleet status`` and the exporter compute them. This is only
meaningful when the benchmark is the server's only client.

Every run is bounded: a request budget and an overall time limit. When either is reached the
benchmark stops between runs (a request in flight is cut at the time limit), and the result
says why it stopped.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from vfleet_healthcheck.exporter import UpstreamError, fetch
from vfleet_healthcheck.vllm_metrics import Family, Parsed, parse
from vfleet_healthcheck.window import Window

from vfleet.measure.client import BenchError, Client, StreamResult
from vfleet.measure.prompts import Prompt, PromptBuilder
from vfleet.measure.stats import PrefillFit, fit_prefill

SCENARIOS = ("context", "decode", "prefill", "concurrency")
DEFAULT_SCENARIOS = ("context", "decode", "prefill")
DEFAULT_LENGTHS = (0, 1024, 8192, 32768, 131072)
DEFAULT_PREFILL_LENGTHS = (2048, 4096, 8192, 16384, 32768)
DEFAULT_CONCURRENCY = (1, 2, 4)
MAX_CONSECUTIVE_FAILURES = 3

# Window figure -> record field (the sidecar's names without the spec_decode_ prefix).
FIGURES = {
    "spec_decode_acceptance_rate": "acceptance_rate",
    "spec_decode_mean_acceptance_length": "mean_acceptance_length",
    "tokens_per_step": "tokens_per_step",
}
# Raw counter deltas kept in each record, so a reader can check the figures by hand.
COUNTERS = {
    "spec_drafts": "drafts",
    "spec_draft_tokens": "draft_tokens",
    "spec_accepted_tokens": "accepted_tokens",
    "generation_tokens": "generation_tokens",
    "iteration_tokens/count": "steps",
}


@dataclass
class Settings:
    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    prefill_lengths: tuple[int, ...] = DEFAULT_PREFILL_LENGTHS
    concurrency: tuple[int, ...] = DEFAULT_CONCURRENCY
    concurrency_context: int = 1024
    decode_tokens: int = 800
    repeats: int = 3
    time_limit_s: float = 1800.0
    max_requests: int = 1000
    request_timeout_s: float = 600.0
    margin_tokens: int = 64  # chat template and rounding of prompt sizes
    seed: int = 0
    endpoint: str = "chat"  # or "completions"
    enable_thinking: bool = False
    ignore_eos: bool = False
    warmup: bool = True


@dataclass
class Step:
    scenario: str
    context: int  # target prompt tokens
    mode: str  # cold | warm
    repeat: int
    max_tokens: int
    concurrency: int = 1

    @property
    def label(self) -> str:
        text = f"{self.scenario} {self.context}"
        if self.scenario == "concurrency":
            return f"{text} x{self.concurrency}"
        return f"{text} {self.mode}"


@dataclass
class Run:
    """One record. For a concurrency batch: token counts are totals, times are means."""

    scenario: str
    context: int
    mode: str
    repeat: int
    max_tokens: int
    concurrency: int = 1
    started_s: float = 0.0  # since the benchmark started
    prompt_tokens: int | None = None
    prompt_tokens_target: int | None = None
    prompt_tokens_estimated: bool = False
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    ttft_s: float | None = None
    # Every request's own TTFT (a batch's ttft_s is their mean): percentiles need them.
    ttfts_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    decode_tps: float | None = None
    prefill_tps: float | None = None
    aggregate_tps: float | None = None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    tokens_per_step: float | None = None
    counters: dict[str, float] = field(default_factory=dict)
    finish_reason: str | None = None
    error: str | None = None


@dataclass
class Outcome:
    runs: list[Run] = field(default_factory=list)
    steps_planned: int = 0
    requests_planned: int = 0
    requests_sent: int = 0
    stopped: str | None = None  # why the benchmark ended early; None when it completed
    skipped: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    warmup: dict[str, Any] | None = None
    prefill_fit: PrefillFit | None = None
    duration_s: float = 0.0
    foreign_runs: int = 0  # runs during which the server generated tokens for someone else


def cap_lengths(lengths: tuple[int, ...], limit: int) -> tuple[list[int], list[int]]:
    """(lengths that fit, lengths that do not). When some do not fit, the limit itself is
    measured instead, so the largest context the server takes is still covered."""
    fits = sorted({n for n in lengths if n <= limit})
    dropped = sorted({n for n in lengths if n > limit})
    if dropped and limit > 0 and limit not in fits:
        fits.append(limit)
    return fits, dropped


def plan(settings: Settings, max_model_len: int | None) -> tuple[list[Step], list[dict[str, Any]]]:
    """The steps to run and the lengths skipped because the server's context cannot hold them."""
    steps: list[Step] = []
    skipped: list[dict[str, Any]] = []
    s = settings

    def capped(scenario: str, lengths: tuple[int, ...], max_tokens: int) -> list[int]:
        if max_model_len is None:
            return sorted(set(lengths))
        limit = max_model_len - max_tokens - s.margin_tokens
        fits, dropped = cap_lengths(lengths, limit)
        for n in dropped:
            skipped.append(
                {
                    "scenario": scenario,
                    "context": n,
                    "why": f"max_model_len {max_model_len} - {max_tokens} output tokens - "
                    f"{s.margin_tokens} margin = {limit} tokens of prompt at most",
                    "replaced_by": limit if limit in fits else None,
                }
            )
        return fits

    if "context" in s.scenarios:
        for n in capped("context", s.lengths, s.decode_tokens):
            for r in range(s.repeats):
                steps.append(Step("context", n, "cold", r, s.decode_tokens))
                steps.append(Step("context", n, "warm", r, s.decode_tokens))
    if "decode" in s.scenarios:
        steps += [Step("decode", 0, "cold", r, s.decode_tokens) for r in range(s.repeats)]
    if "prefill" in s.scenarios:
        lengths = capped("prefill", s.prefill_lengths, 1)
        # Repeat-major: each pass covers every length, so drift over time spreads evenly.
        steps += [Step("prefill", n, "cold", r, 1) for r in range(s.repeats) for n in lengths]
    if "concurrency" in s.scenarios:
        for n in capped("concurrency", (s.concurrency_context,), s.decode_tokens):
            for c in sorted(set(s.concurrency)):
                for r in range(s.repeats):
                    steps.append(Step("concurrency", n, "cold", r, s.decode_tokens, c))
    return steps, skipped


class Metrics:
    """Reads vLLM's /metrics around a run; deltas and figures through the sidecar's Window."""

    def __init__(self, base_url: str, table: dict[str, Family], timeout: float = 10.0) -> None:
        self.url = base_url.rstrip("/") + "/metrics"
        self.table = table
        self.timeout = timeout
        self.error: str | None = None  # the last failure, for one warning

    def read(self) -> tuple[float, Parsed] | None:
        try:
            text = fetch(self.url, self.timeout)
        except UpstreamError as exc:
            self.error = str(exc)
            return None
        t = time.monotonic()
        parsed = parse(text, self.table)
        if not parsed.values:
            self.error = f"{self.url} returned no vLLM metrics"
            return None
        return t, parsed

    def apply(
        self, run: Run, before: tuple[float, Parsed] | None, after: tuple[float, Parsed] | None
    ) -> None:
        if before is None or after is None:
            return
        window = Window(math.inf, self.table)
        window.add(*before)
        if window.add(*after):
            run.error = run.error or "vLLM restarted during the run"
            return
        figures = window.figures()
        for name, key in FIGURES.items():
            setattr(run, key, figures.scalars.get(name))
        old, new = window.samples[0].values, window.samples[-1].values
        run.counters = {
            key: new[name] - old[name]
            for name, key in COUNTERS.items()
            if name in new and name in old
        }


Progress = Callable[[int, int, str], None]


class Bench:
    def __init__(
        self,
        client: Client,
        model: str,
        settings: Settings,
        builder: PromptBuilder,
        *,
        metrics: Metrics | None = None,
        max_model_len: int | None = None,
        progress: Progress | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.model = model
        self.s = settings
        self.builder = builder
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.progress = progress
        self.clock = clock
        self.rng = random.Random(settings.seed)
        self._prompts: dict[tuple[str, int, int], Prompt] = {}
        self._t0 = 0.0

    # ------------------------------------------------------------------ limits

    def remaining_s(self) -> float:
        return self.s.time_limit_s - (self.clock() - self._t0)

    def _stop_reason(self, out: Outcome, requests: int) -> str | None:
        if self.remaining_s() <= 0:
            return f"time limit of {self.s.time_limit_s:g} s reached"
        if out.requests_sent + requests > self.s.max_requests:
            return f"request budget of {self.s.max_requests} reached"
        return None

    def _timeout(self) -> float:
        return max(0.001, min(self.s.request_timeout_s, self.remaining_s()))

    # ------------------------------------------------------------------ requests

    def _request(self, prompt: Prompt, max_tokens: int, timeout: float) -> StreamResult:
        extra: dict[str, Any] = {"ignore_eos": True} if self.s.ignore_eos else {}
        if self.s.endpoint == "completions":
            return self.client.complete(
                self.model, prompt.text, max_tokens, extra=extra, timeout=timeout
            )
        return self.client.chat(
            self.model,
            prompt.text,
            max_tokens,
            enable_thinking=self.s.enable_thinking,
            extra=extra,
            timeout=timeout,
        )

    def _prompt(self, step: Step) -> Prompt:
        key = (step.scenario, step.context, step.repeat)
        if step.mode == "warm" and key in self._prompts:
            return self._prompts[key]
        prompt = self.builder.build(step.context, self.rng)
        self._prompts = {key: prompt}  # only the latest cold prompt is ever reused
        return prompt

    def _record(self, step: Step, prompt: Prompt, started: float) -> Run:
        return Run(
            step.scenario,
            step.context,
            step.mode,
            step.repeat,
            step.max_tokens,
            step.concurrency,
            started_s=started,
            prompt_tokens_target=step.context,
            prompt_tokens_estimated=prompt.estimated,
        )

    def _single(self, step: Step) -> Run:
        prompt = self._prompt(step)
        run = self._record(step, prompt, self.clock() - self._t0)
        before = self.metrics.read() if self.metrics else None
        res = self._request(prompt, step.max_tokens, self._timeout())
        after = self.metrics.read() if self.metrics else None
        run.prompt_tokens = res.prompt_tokens
        run.completion_tokens = res.tokens
        run.cached_tokens = res.cached_tokens
        run.ttft_s = res.ttft_s
        run.ttfts_s = [res.ttft_s] if res.ttft_s is not None else []
        run.e2e_s = res.e2e_s
        run.decode_tps = res.decode_tps
        run.prefill_tps = res.prefill_tps
        run.finish_reason = res.finish_reason
        if self.metrics:
            self.metrics.apply(run, before, after)
        return run

    def _batch(self, step: Step) -> Run:
        prompts = [self.builder.build(step.context, self.rng) for _ in range(step.concurrency)]
        run = self._record(step, prompts[0], self.clock() - self._t0)
        timeout = self._timeout()
        before = self.metrics.read() if self.metrics else None
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=step.concurrency) as pool:
            futures = [pool.submit(self._request, p, step.max_tokens, timeout) for p in prompts]
            results = [f.result() for f in futures]  # the first failure fails the batch
        wall = time.perf_counter() - t0
        after = self.metrics.read() if self.metrics else None

        def avg(values: list[float | None]) -> float | None:
            got = [v for v in values if v is not None]
            return sum(got) / len(got) if got else None

        run.prompt_tokens = sum(r.prompt_tokens or 0 for r in results)
        run.completion_tokens = sum(r.tokens for r in results)
        run.ttft_s = avg([r.ttft_s for r in results])
        run.ttfts_s = [r.ttft_s for r in results if r.ttft_s is not None]
        run.e2e_s = avg([r.e2e_s for r in results])
        run.decode_tps = avg([r.decode_tps for r in results])
        run.prefill_tps = avg([r.prefill_tps for r in results])
        run.aggregate_tps = run.completion_tokens / wall if wall > 0 else None
        if self.metrics:
            self.metrics.apply(run, before, after)
        return run

    def _warmup(self, out: Outcome) -> None:
        # Kernels compiled on first use (seed 004: JIT on the first request) must not land
        # in the first measured run.
        prompt = self.builder.build(0, random.Random(-1))
        try:
            res = self._request(prompt, 8, self._timeout())
            out.warmup = {"ttft_s": res.ttft_s, "e2e_s": res.e2e_s, "tokens": res.tokens}
        except BenchError as exc:
            out.warmup = {"error": str(exc)}
            out.warnings.append(f"warm-up request failed: {exc}")

    # ------------------------------------------------------------------ run

    def run(self) -> Outcome:
        self._t0 = self.clock()
        steps, skipped = plan(self.s, self.max_model_len)
        out = Outcome(steps_planned=len(steps), skipped=skipped)
        out.requests_planned = sum(step.concurrency for step in steps)
        if self.builder.estimated:
            out.warnings.append("prompt sizes estimated: the server has no /tokenize")
        if self.s.warmup:
            self._warmup(out)
        failures = 0
        for step in steps:
            why = self._stop_reason(out, step.concurrency)
            if why:
                out.stopped = why
                break
            if self.progress:
                self.progress(out.requests_sent, out.requests_planned, step.label)
            started = self.clock() - self._t0
            try:
                run = self._batch(step) if step.scenario == "concurrency" else self._single(step)
                failures = 0
            except BenchError as exc:
                out.requests_sent += step.concurrency
                if exc.kind == "timeout" and self.remaining_s() <= 0:
                    out.stopped = f"time limit of {self.s.time_limit_s:g} s reached"
                    break
                run = self._record(step, Prompt("", step.context, 0, False), started)
                run.error = str(exc)
                out.runs.append(run)
                failures += 1
                if exc.kind == "connect" or failures >= MAX_CONSECUTIVE_FAILURES:
                    out.stopped = f"stopped after {failures} failed run(s): {exc}"
                    break
                continue
            out.requests_sent += step.concurrency
            out.runs.append(run)
            generated = run.counters.get("generation_tokens")
            if generated is not None and generated > (run.completion_tokens or 0):
                out.foreign_runs += 1
        if out.foreign_runs:
            out.warnings.append(
                f"during {out.foreign_runs} run(s) the server generated more tokens than this "
                "benchmark received: another client used it, and the MTP figures include its "
                "traffic"
            )
        if self.progress:
            self.progress(out.requests_sent, out.requests_planned, "done")
        if self.metrics and self.metrics.error:
            out.warnings.append(f"/metrics not read for some runs: {self.metrics.error}")
        prefill = [
            (float(r.prompt_tokens), r.ttft_s)
            for r in out.runs
            if r.scenario == "prefill" and r.prompt_tokens and r.ttft_s is not None
        ]
        out.prefill_fit = fit_prefill(prefill)
        out.duration_s = self.clock() - self._t0
        return out
