"""What `vfleet tune` may try on a host: the search space, what fits, and the order of trying.

The space is built from the host's own launch (its profile, model and settings as a deploy
renders them), so it holds only settings the profile uses: the MTP depth where the model has
MTP layers, the prefill chunk (max_num_batched_tokens) around the rendered one, on GPU profiles
the CUDA graph mode and async scheduling, on the cpu profile the engine's core binding.
Capture sizes are not a dimension of their own: the cudagraphs rule derives them from the
depth and max_num_seqs (every n x (1 + k) decode shape), so each depth brings its own.

Each candidate is checked before anything is deployed: the rules must accept it (a refusal is
skipped with the rule's message) and the planner must say it fits (src/vfleet/engine/planner.py; a
plan that does not fit is skipped with its problems). That is the level this check reaches:
vLLM's own engine check (`vfleet check-args`) is not run per candidate; a candidate that vLLM
refuses at start fails its swap's gates, is rolled back and recorded as failed.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from vfleet.engine.compile import Launch
from vfleet.engine.planner import plan_launch
from vfleet.errors import VfleetError

DEPTHS = (0, 1, 2, 3, 4)
Search = Literal["climb", "grid"]
SEARCHES: tuple[Search, ...] = ("climb", "grid")


@dataclass(frozen=True)
class Choice:
    label: str  # what the report shows: "2", "4096", "PIECEWISE"
    sets: tuple[str, ...]  # the `--set` items that give it


@dataclass(frozen=True)
class Dimension:
    name: str  # what the operator names in --sweep
    choices: tuple[Choice, ...]
    start: int  # the choice the host runs now (the others are tried against it)
    # Ordered values (a depth, a size): the climb search stops going up past a peak.
    ordered: bool
    why: str


@dataclass(frozen=True)
class Candidate:
    picks: tuple[tuple[str, str], ...]  # (dimension, choice label), in dimension order
    sets: tuple[str, ...]

    @property
    def key(self) -> str:
        """The candidate's name in the state file and the report: `depth=2 batched-tokens=4096`."""
        return " ".join(f"{d}={v}" for d, v in self.picks)

    def pick(self, dimension: str) -> str | None:
        return dict(self.picks).get(dimension)


def _depth(launch: Launch, depths: Sequence[int]) -> Dimension | str:
    if not launch.model.arch.mtp_layers:
        return f"{launch.model.name} has no MTP layers: no speculative depth to choose"
    choices = tuple(
        Choice(str(k), ("speculative.method=none",))
        if k == 0
        else Choice(str(k), ("speculative.method=mtp", f"speculative.num_speculative_tokens={k}"))
        for k in depths
    )
    now = launch.decisions.spec_k if launch.decisions.spec_method == "mtp" else 0
    start = [int(c.label) for c in choices].index(now) if now in depths else 0
    return Dimension(
        "depth",
        choices,
        start,
        ordered=True,
        why="num_speculative_tokens (0: speculation off): more drafts per step pay only while "
        "the later positions are still accepted often enough to cover the longer step",
    )


def _batched_tokens(launch: Launch) -> Dimension | str:
    now = (
        launch.config_values().get("max-num-batched-tokens")
        or launch.settings.max_num_batched_tokens
    )
    if not isinstance(now, int):
        return "max_num_batched_tokens is not rendered for this launch: nothing to sweep around"
    # Half, the rendered value, double: the prefill chunk trades TTFT of long prompts against
    # the decode steps that wait behind a chunk. Bounded by the schema's own limits.
    values = sorted({v for v in (now // 2, now, now * 2) if 16 <= v <= 1_048_576})
    return Dimension(
        "batched-tokens",
        tuple(Choice(str(v), (f"max_num_batched_tokens={v}",)) for v in values),
        values.index(now),
        ordered=True,
        why="max_num_batched_tokens (the prefill chunk), half and double the rendered value",
    )


def _cudagraph_mode(launch: Launch) -> Dimension | str:
    if launch.profile.accelerator.kind == "cpu":
        return "no CUDA graphs on the cpu profile"
    conf = launch.config_values().get("compilation-config")
    now = conf.get("cudagraph_mode") if isinstance(conf, dict) else None
    modes = ("PIECEWISE", "FULL_AND_PIECEWISE")
    return Dimension(
        "cudagraph-mode",
        tuple(Choice(m, (f"cudagraph_mode={m}",)) for m in modes),
        modes.index(now) if now in modes else 0,
        ordered=False,
        why="cudagraph_mode: PIECEWISE (the rules' default with speculative decoding) or full "
        "graphs where the attention backend allows them (the capture sizes follow the depth)",
    )


def _async_scheduling(launch: Launch) -> Dimension | str:
    if launch.profile.accelerator.kind == "cpu":
        return "async scheduling is not swept on the cpu profile (not checked there)"
    now = launch.config_values().get("async-scheduling")
    choices = (
        Choice("auto", ()),  # unset: vLLM decides (on for MTP in 0.24.0 and later)
        Choice("on", ("async_scheduling=true",)),
        Choice("off", ("async_scheduling=false",)),
    )
    start = {None: 0, True: 1, False: 2}.get(now if isinstance(now, bool) else None, 0)
    return Dimension(
        "async-scheduling",
        choices,
        start,
        ordered=False,
        why="async_scheduling: vLLM's choice, on or off (seed 002 saw no gain at one sequence)",
    )


def parse_cores(text: str) -> list[int]:
    cores: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cores += range(int(lo), int(hi or lo) + 1)
    return cores


def _cpu_threads(launch: Launch) -> Dimension | str:
    if launch.profile.accelerator.kind != "cpu":
        return "the core binding is a cpu-profile setting"
    if launch.settings.cpu_cores is None:
        return "no cpu_cores binding set: vLLM binds by itself; set cpu_cores to sweep it"
    cores = parse_cores(launch.settings.cpu_cores)
    # The engine's threads on the first 1, half, or all of the instance's own cores: more
    # threads help a larger model and hurt when another process spins on the same cores.
    counts = sorted({1, max(1, len(cores) // 2), len(cores)})
    choices = tuple(
        Choice(f"{n}", (f"cpu_cores={_cores_text(cores[:n])}", f"omp_num_threads={n}"))
        for n in counts
    )
    return Dimension(
        "cpu-threads",
        choices,
        len(choices) - 1,
        ordered=True,
        why=f"engine threads on the first N of the instance's cores ({launch.settings.cpu_cores})",
    )


def _cores_text(cores: list[int]) -> str:
    return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])


BUILDERS: dict[str, Callable[[Launch], Dimension | str]] = {
    "depth": lambda launch: _depth(launch, DEPTHS),
    "batched-tokens": _batched_tokens,
    "cudagraph-mode": _cudagraph_mode,
    "async-scheduling": _async_scheduling,
    "cpu-threads": _cpu_threads,
}


def parse_depths(text: str) -> tuple[int, ...]:
    try:
        depths = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        depths = ()
    if not depths or not all(0 <= k <= 4 for k in depths):
        raise VfleetError(
            f"--depths {text!r} is not a list of depths 0..4",
            key="--depths",
            fix="e.g. --depths 0,1,2,3,4 (0: speculation off)",
        )
    return depths


def build_space(
    launch: Launch, names: Sequence[str], depths: Sequence[int] = DEPTHS
) -> tuple[list[Dimension], dict[str, str]]:
    """The dimensions named (in order) that apply to this launch, and why the others do not."""
    unknown = [n for n in names if n not in BUILDERS]
    if unknown or not names:
        raise VfleetError(
            f"unknown dimension(s) for --sweep: {', '.join(unknown) or '(none given)'}",
            key="--sweep",
            fix=f"comma-separated, from: {', '.join(BUILDERS)}",
        )
    dims: list[Dimension] = []
    left_out: dict[str, str] = {}
    for name in names:
        got = _depth(launch, depths) if name == "depth" else BUILDERS[name](launch)
        if isinstance(got, str):
            left_out[name] = got
        elif len(got.choices) > 1:
            dims.append(got)
        else:
            left_out[name] = f"one value only ({got.choices[0].label}): nothing to compare"
    return dims, left_out


def candidate(dims: Sequence[Dimension], picks: Mapping[str, int]) -> Candidate:
    chosen = [(d, d.choices[picks[d.name]]) for d in dims]
    return Candidate(
        tuple((d.name, c.label) for d, c in chosen),
        tuple(s for _, c in chosen for s in c.sets),
    )


# --------------------------------------------------------------------------- the order of trying

Scores = Mapping[str, float | None]  # candidate key -> objective (None: skipped, failed, over SLO)


def next_candidate(
    dims: Sequence[Dimension], scores: Scores, search: Search, margin: float
) -> Candidate | None:
    """The next candidate to measure, given what has been measured; None when done.

    A pure function of the scores so far, so a re-run with the state file continues where the
    last one stopped. grid: every combination. climb: one dimension at a time, the others at
    the best found so far (or at what the host runs), keeping the best value of each. An
    unordered dimension is tried whole. Along an ordered one the climb starts at what the host
    runs and walks down, then up, one value at a time, and stops walking a way once the last
    value there scored worse than the best so far by more than `margin` (a fraction), or
    failed: past a peak a deeper draft only adds a draft step that is rejected, and a larger
    chunk only delays decode steps further.
    """
    if search == "grid":
        for idx in itertools.product(*(range(len(d.choices)) for d in dims)):
            c = candidate(dims, {d.name: i for d, i in zip(dims, idx, strict=True)})
            if c.key not in scores:
                return c
        return None
    fixed = {d.name: d.start for d in dims}
    for d in dims:
        nxt = _climb(dims, d, fixed, scores, margin)
        if isinstance(nxt, Candidate):
            return nxt
        if nxt is not None:
            fixed[d.name] = nxt
    return None


def _climb(
    dims: Sequence[Dimension],
    d: Dimension,
    fixed: Mapping[str, int],
    scores: Scores,
    margin: float,
) -> Candidate | int | None:
    """The next candidate along `d`, or (when `d` is done) its best index, None if none scored."""
    measured: dict[int, float | None] = {}

    def at(i: int) -> Candidate | None:
        c = candidate(dims, {**fixed, d.name: i})
        if c.key not in scores:
            return c
        measured[i] = scores[c.key]
        return None

    def best() -> float | None:
        got = [s for s in measured.values() if s is not None]
        return max(got) if got else None

    if not d.ordered:
        for i in range(len(d.choices)):
            if (c := at(i)) is not None:
                return c
    else:
        if (c := at(d.start)) is not None:
            return c
        for step in (-1, 1):
            last, i = measured[d.start], d.start + step
            while 0 <= i < len(d.choices):
                top = best()
                if (c := at(i)) is not None:
                    if top is not None and (last is None or last < top * (1 - margin)):
                        break  # past the peak this way
                    return c
                last, i = measured[i], i + step
    ranked = [(s, i) for i, s in measured.items() if s is not None]
    return max(ranked)[1] if ranked else None


def all_candidates(dims: Sequence[Dimension]) -> int:
    n = 1
    for d in dims:
        n *= len(d.choices)
    return n


def infeasible(resolve_with: Callable[[Sequence[str]], Launch], c: Candidate) -> str | None:
    """Why the candidate cannot be deployed (the rules refuse it, or the plan does not fit);
    None when it may be. `resolve_with(sets)` resolves the host's launch with more settings."""

    try:
        launch = resolve_with(c.sets)
    except VfleetError as exc:
        return f"refused: {exc.message}" + (f" (fix: {exc.fix})" if exc.fix else "")
    plan = plan_launch(launch)
    if not plan.fits:
        return "does not fit (planner): " + "; ".join(plan.problems)
    return None
