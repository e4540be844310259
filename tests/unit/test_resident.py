"""A resident pair (issue 32): two engines on the same GPUs, one awake and one asleep, planned
in both orders with what a sleeper keeps (engine/resident.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.conftest import Result
from vfleet.engine.compile import resolve
from vfleet.engine.planner import Plan, plan_launch
from vfleet.engine.resident import (
    ENGINE_HOST_BYTES,
    PINNED_COPY_RATIO,
    SLEEPER_GPU_BYTES,
    SLEEPER_GPU_UNCERTAINTY_BYTES,
    plan_pair,
)

GIB = 1 << 30


def plan(profile: str, model: str, *sets: str) -> Plan:
    return plan_launch(resolve(profile, model, sets=list(sets), strict_memory=False))


def test_the_measured_pair_fits_in_both_orders() -> None:
    """The H200 pair of docs/GPU.md section 8 (0.45 of the card each): fits either way."""
    mid = plan("h200-141g", "mid-hybrid-mtp", "max_model_len=4096", "gpu_memory_utilization=0.45")
    tiny = plan("h200-141g", "tiny-hybrid-mtp", "max_model_len=4096", "gpu_memory_utilization=0.45")
    pair = plan_pair(mid, tiny, level=1)
    assert pair.fits and not pair.problems, pair.problems
    assert [(o.awake, o.asleep, o.fits) for o in pair.orders] == [
        ("mid-hybrid-mtp", "tiny-hybrid-mtp", True),
        ("tiny-hybrid-mtp", "mid-hybrid-mtp", True),
    ]
    # 0.45 + 0.45 of the card: both can be awake at once, so the switch may wake first
    assert pair.awake_together and len(pair.notes) == 1, pair.notes
    assert "fit awake together" in pair.notes[0] and "--wake-first" in pair.notes[0]
    assert mid.gpu is not None and 0 < pair.awake_bytes <= mid.gpu.total_bytes
    assert f"({pair.awake_bytes / (1 << 20):,.0f} of" in pair.notes[0]
    # Level 1 keeps the sleeper's weights in pinned host memory, sized up as measured.
    assert mid.gpu is not None
    pinned = -(-mid.gpu.weights_bytes * PINNED_COPY_RATIO // 1)
    assert pair.host_bytes["mid-hybrid-mtp"] == ENGINE_HOST_BYTES + pinned


def test_a_pair_with_no_room_for_the_sleeper_is_refused_with_the_utilisation_that_fits() -> None:
    """27B AWQ on two 2080 Ti at the profile's utilisation leaves 670 MiB a card: no room for a
    sleeper's ~2.2 GiB. The refusal names the numbers and the utilisation that fits, and that
    utilisation does fit."""
    big = plan("2x2080ti-22g", "qwen3.6-27b-awq-int4")
    pair = plan_pair(big, big, level=1)
    assert not pair.fits and not any(o.fits for o in pair.orders)
    problem = pair.problems[0]
    assert "awake beside" in problem and "the sleeper 2,217 +/- 512" in problem, problem
    util = float(problem.rsplit("at most ", 1)[1].split()[0])
    smaller = plan("2x2080ti-22g", "qwen3.6-27b-awq-int4", f"gpu_memory_utilization={util}")
    assert plan_pair(smaller, smaller, level=1).fits
    # Their budgets do not fit awake at once: the note says in which order to start them.
    assert pair.notes and "start the standby while the active engine sleeps" in pair.notes[0]
    assert not pair.awake_together and "sleeps first" in pair.notes[0]
    assert big.gpu is not None and pair.awake_bytes > big.gpu.total_bytes
    assert not plan_pair(smaller, smaller, level=1).awake_together


def test_level_2_keeps_no_weights_in_host_memory() -> None:
    mid = plan("h200-141g", "mid-hybrid-mtp", "max_model_len=4096", "gpu_memory_utilization=0.45")
    tiny = plan("h200-141g", "tiny-hybrid-mtp", "max_model_len=4096", "gpu_memory_utilization=0.45")
    ram = 10 * GIB  # two processes fit; with the pinned copies of level 1 they do not
    one = plan_pair(mid, tiny, level=1, host_ram_bytes=ram)
    assert not one.fits and "host memory" in one.problems[0] and "level 2" in one.problems[0]
    two = plan_pair(mid, tiny, level=2, host_ram_bytes=ram)
    assert two.fits and set(two.host_bytes.values()) == {ENGINE_HOST_BYTES}


def test_the_sleeper_is_planned_at_the_largest_measured_figure() -> None:
    assert SLEEPER_GPU_BYTES == 2217 << 20  # mid on the H200 (docs/GPU.md, section 8)
    assert SLEEPER_GPU_UNCERTAINTY_BYTES >= 400 << 20  # wider than the 1,768-2,217 spread


def test_the_cli_plans_a_pair_and_refuses_the_cpu(cli: Callable[..., Result]) -> None:
    r = cli("plan", "-p", "2x2080ti-22g", "-m", "qwen3.6-27b-awq-int4",
            "--standby-model", "qwen3.6-27b-awq-int4")  # fmt: skip
    assert r.rc == 1 and "DOES NOT FIT" in r.out and "gpu_memory_utilization at most" in r.out
    r = cli("plan", "-p", "cpu", "-m", "tiny-hybrid-mtp", "--standby-model", "tiny-dense")
    assert r.rc == 2 and "vLLM's CPU build has no sleep mode" in r.err, r.err
    r = cli("plan", "-p", "cpu", "-m", "tiny-hybrid-mtp", "--standby-model", "tiny-dense",
            "--layouts")  # fmt: skip
    assert r.rc == 2 and "--layouts and --standby-model" in r.err


@pytest.mark.parametrize("level", [1, 2])
def test_json_has_both_plans_and_the_orders(cli: Callable[..., Result], level: int) -> None:
    import json

    r = cli("plan", "-p", "h200-141g", "-m", "mid-hybrid-mtp", "--max-model-len", "4096",
            "--standby-model", "tiny-hybrid-mtp", "--standby-set", "max_model_len=4096",
            "--sleep-level", str(level), "--json")  # fmt: skip
    assert r.rc == 0, r.err
    doc = json.loads(r.out)
    assert doc["level"] == level and doc["fits"] is True
    assert (
        doc["active"]["model"] == "mid-hybrid-mtp" and doc["standby"]["model"] == "tiny-hybrid-mtp"
    )
    assert len(doc["orders"]) == 2


def test_the_27b_pair_is_planned_at_the_host_memory_it_held_on_an_h100() -> None:
    """docs/GPU.md section 14: the 27B AWQ pair at 0.45 each on an H100, sleep level 1. Each
    engine's processes held 32,116-32,361 MiB once it had slept (the pinned copy stays after
    the wake): 64,538 MiB for the pair, which the plan must not undercount, and a 64 GiB box is
    refused with level 2 as the way out."""
    sets = ("max_model_len=32768", "gpu_memory_utilization=0.45", "kv_cache_dtype=auto")
    a = plan("h200-141g", "qwen3.6-27b-awq-int4", *sets)  # host memory: the card does not matter
    b = plan("h200-141g", "qwen3.8-27b-awq-mtp", *sets)
    pair = plan_pair(a, b, level=1, host_ram_bytes=128 * GIB)
    measured_mib = 32361.0 + 32177.0
    planned_mib = sum(pair.host_bytes.values()) / (1 << 20)
    assert measured_mib <= planned_mib <= 1.1 * measured_mib, (planned_mib, measured_mib)
    assert pair.fits, pair.problems
    small = plan_pair(a, b, level=1, host_ram_bytes=64 * GIB)
    [problem] = [p for p in small.problems if p.startswith("host memory")]
    assert "keeps after it wakes too" in problem and "sleep at level 2" in problem, problem
    assert plan_pair(a, b, level=2, host_ram_bytes=64 * GIB).fits
