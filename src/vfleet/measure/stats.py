"""The few statistics a benchmark needs: a line fit, percentiles, noise, A/B comparison."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Line:
    """y = intercept + slope * x, fitted by least squares."""

    intercept: float
    slope: float
    r2: float | None  # None when y does not vary (nothing to explain)
    n: int


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Line:
    if len(xs) != len(ys):
        raise ValueError("xs and ys differ in length")
    n = len(xs)
    if n < 2:
        raise ValueError("a line needs at least two points")
    mx, my = math.fsum(xs) / n, math.fsum(ys) / n
    sxx = math.fsum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("all points have the same x: the slope is undefined")
    sxy = math.fsum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = math.fsum((y - my) ** 2 for y in ys)
    ss_res = math.fsum((y - intercept - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else None
    return Line(intercept, slope, r2, n)


@dataclass(frozen=True)
class PrefillFit:
    """TTFT = fixed + tokens / rate (seed 004's method)."""

    fixed_s: float
    rate_tps: float | None  # None when the slope is not positive (TTFT did not grow with N)
    r2: float | None
    n: int  # points used
    dropped: int  # leading points left out


def fit_prefill(points: Sequence[tuple[float, float]], drop_first: int = 1) -> PrefillFit | None:
    """Fit (prompt tokens, TTFT s) points in the order measured; None with too few points.

    The first point is dropped by default: seed 004 found it can hit the prefix cache (a
    warm-up that reused its prompt), and it also pays for kernels compiled on first use.
    """
    used = list(points[drop_first:])
    if len(used) < 2 or len({x for x, _ in used}) < 2:
        return None
    line = fit_line([x for x, _ in used], [y for _, y in used])
    rate = 1.0 / line.slope if line.slope > 0 else None
    return PrefillFit(line.intercept, rate, line.r2, line.n, min(drop_first, len(points)))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values)


def stdev(values: Sequence[float]) -> float | None:
    """Sample standard deviation; None for fewer than two values."""
    return statistics.stdev(values) if len(values) >= 2 else None


def noise(values: Sequence[float]) -> float | None:
    """Relative spread of repeats, (max - min) / |mean|; None without repeats.

    The spread rather than the stdev: with the 2-3 repeats a benchmark affords, the stdev
    estimate is itself too noisy to trust, and the spread is what an operator can check.
    """
    if len(values) < 2:
        return None
    m = mean(values)
    return (max(values) - min(values)) / abs(m) if m else None


@dataclass(frozen=True)
class Comparison:
    metric: str
    a: float  # mean of A's samples
    b: float
    ratio: float | None  # b / a; None when a is 0
    noise: float | None  # the larger relative spread of A's and B's repeats
    exceeds_noise: bool | None  # None when neither side has repeats: unknowable
    higher_is_better: bool

    @property
    def verdict(self) -> str:
        if self.ratio is None or self.exceeds_noise is None:
            return "no repeats" if self.ratio is not None else "-"
        if not self.exceeds_noise:
            return "within noise"
        better = (self.ratio > 1) == self.higher_is_better
        return "better" if better else "worse"


def lower_is_better(metric: str) -> bool:
    return metric.endswith(("_s", "ttft", "latency"))


def compare(
    a: Mapping[str, Sequence[float]], b: Mapping[str, Sequence[float]], min_noise: float = 0.0
) -> list[Comparison]:
    """Per metric both sides have: the ratio of means b/a and whether it leaves the noise.

    A change counts when |ratio - 1| exceeds the larger relative spread of either side's
    repeats (and ``min_noise``): a difference smaller than what repeats of one setup already
    show is not evidence (seed 002's "60K 仅 2 次采样，方差大，不具统计显著性").
    """
    out: list[Comparison] = []
    for metric in sorted(set(a) & set(b)):
        va, vb = list(a[metric]), list(b[metric])
        if not va or not vb:
            continue
        ma, mb = mean(va), mean(vb)
        ratio = mb / ma if ma else None
        spreads = [s for s in (noise(va), noise(vb)) if s is not None]
        # A declared floor also judges figures without repeats (e.g. the prefill fit).
        level = max([*spreads, min_noise]) if spreads or min_noise > 0 else None
        exceeds = abs(ratio - 1) > level if ratio is not None and level is not None else None
        out.append(Comparison(metric, ma, mb, ratio, level, exceeds, not lower_is_better(metric)))
    return out
