"""Two engines resident on the same GPUs, one serving and one asleep (issue 32, docs/PLANNER.md).

A switch between them (docs/SWAP.md) sleeps one and wakes the other, so at every moment one
engine holds its whole budget and the other what vLLM's sleep mode leaves on the card. Each
order must fit: A awake beside B asleep, and B awake beside A asleep. What a sleeper keeps is
measured, not derived: vLLM's CuMem allocator releases the weights (level 1: copied to pinned
host memory; level 2: dropped) and the KV cache, and the rest stays (the CUDA context, what was
allocated outside the pool).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from vfleet.engine.planner import Plan

MIB = 1 << 20

# nvidia-smi per process, engines asleep at level 1 or 2 (the same either way): 1,768-1,797 MiB
# (tiny hybrid MTP model) and 2,200-2,217 MiB (mid, 4.15 GiB of weights), H200, vLLM 0.24.0,
# bench/results/h200/switch-run*.json (docs/GPU.md, section 8); 1,802 / 2,210 MiB for the same
# on an H100 (section 12) and 2,010-2,012 MiB for a 27B AWQ engine on an H100 (section 14). What
# a sleeper keeps does not grow with the model or the card: planned at the largest seen.
SLEEPER_GPU_BYTES = 2217 * MIB
SLEEPER_GPU_UNCERTAINTY_BYTES = 512 * MIB
SLEEPER_GPU_KNOWN = (
    "measured on an H200 and an H100 (vLLM 0.24.0, tiny, mid and 27B AWQ models): 1,768-2,217 MiB"
)
# Host memory of one engine's processes (API server, engine core) besides a level-1 weight
# copy: RSS 3.1-3.6 GB for the tiny and mid models on the H200; 3,962-4,160 MiB for the 27B AWQ
# presets on an H100 before any sleep (docs/GPU.md section 14). Planned at the largest.
ENGINE_HOST_BYTES = 4200 * MIB
# A level-1 sleep copies the weights to pinned host memory, and that memory stays with the
# engine after it wakes (its RSS did not come back down): measured for the 27B AWQ engines on
# an H100, 17.91 GiB of weights, the engine core's RSS from 2,553-2,713 MiB before the first
# sleep to 30,719-30,926 MiB asleep and 30,780-30,926 MiB awake again: 28,167-28,227 MiB, 1.54x the
# weights (section 14; the mid model's 4.15 GiB took about 1.0x, section 12). Most likely
# torch's caching host allocator, which keeps freed pinned blocks for reuse and sizes them up;
# not read in torch's source here. Planned at the largest ratio seen.
PINNED_COPY_RATIO = 1.54
LEVELS = (1, 2)


@dataclass(frozen=True)
class Order:
    """One engine awake on the GPUs beside the other asleep."""

    awake: str
    asleep: str
    headroom_bytes: int  # what the awake engine's plan leaves on each GPU
    fits: bool


@dataclass(frozen=True)
class PairPlan:
    """Both orders, what the sleeper holds and where, and the verdict."""

    active: Plan
    standby: Plan
    level: int
    sleeper_gpu_bytes: int
    sleeper_gpu_uncertainty_bytes: int
    # per engine, once it has slept: its host memory (processes + the pinned level-1 copy,
    # which it keeps awake too)
    host_bytes: dict[str, int]
    orders: list[Order]
    fits: bool
    # Both budgets (and what each holds outside its budget) fit on the card at once: the
    # switch may wake the standby before the active one has drained and slept
    # (`vfleet switch to --wake-first`, docs/SWAP.md); otherwise it must sleep first.
    awake_together: bool = False
    # What the two need awake at once, per GPU: both budgets and what each holds outside it.
    awake_bytes: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def host_bytes_asleep(plan: Plan, level: int) -> int:
    """An engine's host memory once it has slept: its processes, plus at level 1 the pinned
    copy of every rank's weights (kept after the wake too, so asleep or awake)."""
    weights = plan.gpu.weights_bytes * plan.tp if plan.gpu is not None and level == 1 else 0
    return ENGINE_HOST_BYTES + math.ceil(weights * PINNED_COPY_RATIO)


def plan_pair(
    active: Plan, standby: Plan, level: int, host_ram_bytes: int | None = None
) -> PairPlan:
    """Whether ``active`` and ``standby`` can take turns on the same GPUs at sleep ``level``."""
    if level not in LEVELS:
        raise ValueError(f"sleep level {level}: 1 or 2")
    if active.gpu is None or standby.gpu is None:
        raise ValueError("a resident pair needs GPUs: vLLM's CPU build has no sleep mode")
    worst = SLEEPER_GPU_BYTES + SLEEPER_GPU_UNCERTAINTY_BYTES
    problems = [f"{p.model}: {why}" for p in (active, standby) for why in p.problems]
    if active.tp != standby.tp:
        problems.append(
            f"tensor parallel {active.tp} and {standby.tp}: both engines must use the same GPUs"
        )
    orders = []
    for awake, asleep in ((active, standby), (standby, active)):
        g = awake.gpu
        assert g is not None
        ok = g.headroom_bytes - g.headroom_uncertainty_bytes >= worst
        orders.append(Order(awake.model, asleep.model, g.headroom_bytes, ok))
        if not ok:
            need = g.budget_bytes + g.outside_budget_bytes + worst
            room = g.total_bytes - g.outside_budget_bytes - worst - g.headroom_uncertainty_bytes
            util = math.floor(100 * room / g.total_bytes) / 100  # down: the figure must fit
            problems.append(
                f"{awake.model} awake beside {asleep.model} asleep: "
                f"{need / MIB:,.0f} MiB per GPU (its budget {g.budget_bytes / MIB:,.0f}, "
                f"outside it {g.outside_budget_bytes / MIB:,.0f}, the sleeper "
                f"{SLEEPER_GPU_BYTES / MIB:,.0f} +/- {SLEEPER_GPU_UNCERTAINTY_BYTES / MIB:,.0f}) "
                f"of {g.total_bytes / MIB:,.0f}: set gpu_memory_utilization at most "
                f"{max(util, 0.0):.2f} for {awake.model}"
            )
    host = {p.model: host_bytes_asleep(p, level) for p in (active, standby)}
    notes = []
    # Both at once: after the first switch each engine has slept, and a level-1 engine keeps
    # its pinned copy awake (27B AWQ on an H100: 32,361 + 32,177 MiB for the pair).
    need_host = sum(host.values())
    if host_ram_bytes is not None and need_host > host_ram_bytes:
        problems.append(
            f"host memory: {need_host / (1 << 30):.1f} GiB for the two engines (each its "
            "processes"
            + (
                f" and its pinned weight copy, {PINNED_COPY_RATIO}x its weights, which it keeps "
                "after it wakes too"
                if level == 1
                else ""
            )
            + f") of {host_ram_bytes / (1 << 30):.1f}"
            + (": sleep at level 2 (weights reloaded from disk at the wake)" if level == 1 else "")
        )
    first = active.gpu
    both = (
        first.budget_bytes
        + first.outside_budget_bytes
        + standby.gpu.budget_bytes
        + standby.gpu.outside_budget_bytes
    )
    awake_together = both <= first.total_bytes
    if not awake_together:
        notes.append(
            "the two budgets do not fit awake together "
            f"({both / MIB:,.0f} of {first.total_bytes / MIB:,.0f} MiB per GPU): start the "
            "standby while the active engine sleeps, or before it starts, and put it to sleep "
            "before the other is woken; `vfleet switch to` sleeps first (its default)"
        )
    else:
        notes.append(
            "the two budgets fit awake together "
            f"({both / MIB:,.0f} of {first.total_bytes / MIB:,.0f} MiB per GPU): "
            "`vfleet switch to --wake-first` may wake the standby while the active engine "
            "finishes its requests, which takes the drain and the sleep out of the wait for "
            "the first token (docs/SWAP.md)"
        )
    return PairPlan(
        active=active,
        standby=standby,
        level=level,
        sleeper_gpu_bytes=SLEEPER_GPU_BYTES,
        sleeper_gpu_uncertainty_bytes=SLEEPER_GPU_UNCERTAINTY_BYTES,
        host_bytes=host,
        orders=orders,
        fits=not problems,
        awake_together=awake_together,
        awake_bytes=both,
        problems=problems,
        notes=notes,
    )
