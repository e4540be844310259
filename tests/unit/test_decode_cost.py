"""The decode cost model: what a decode step reads per GPU (vfleet.engine.decode_cost), how the
sidecar models another depth's step from a measured one (vfleet_healthcheck.depth.StepCost),
and the committed check against every measured pair (bench/decode_cost_check.py)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from vfleet_healthcheck.depth import StepCost, StepTimesError

from vfleet.engine.compile import resolve
from vfleet.engine.decode_cost import decode_cost
from vfleet.engine.draft_prune import rows_full
from vfleet.errors import VfleetError

REPO = Path(__file__).resolve().parents[2]
GB = 1e9


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location(
        "decode_cost_check", REPO / "bench/decode_cost_check.py"
    )
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["decode_cost_check"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_the_27b_awq_step_on_the_h200() -> None:
    # docs/GPU.md 11b: 15.83 GB a step without MTP (the weights and the GDN state).
    dc = decode_cost(resolve("h200-141g", "qwen3.6-27b-awq-int4", strict_memory=False))
    assert dc.step_bytes(0) / GB == pytest.approx(15.83, abs=0.005)
    # 48 GDN layers x 48 value heads x 128 x 128 x 4 B (float32 SSM) = 150,994,944 per depth
    assert dc.verify_state_bytes == 48 * 48 * 128 * 128 * 4
    assert dc.head_rows == rows_full(248_320, 1) and dc.draft_layers == 1
    assert dc.bandwidth is not None and dc.bandwidth.gbs == 4232.0
    floor = dc.floor_s(3)
    assert floor is not None
    assert floor == pytest.approx(dc.step_bytes(3) / 4232e9)


def test_the_head_a_draft_reads_on_the_seeds_card() -> None:
    # Seed 000 (2x 2080 Ti, TP 2): vLLM's head reads 124,160 rows a rank (1.27 GB), the pruned
    # one every second of 65,536 (0.34 GB).
    full = decode_cost(
        resolve(
            "2x2080ti-22g", "qwen3.8-27b-awq-mtp", sets=["draft_prune=false"], strict_memory=False
        )
    )
    pruned = decode_cost(
        resolve(
            "2x2080ti-22g", "qwen3.8-27b-awq-mtp", sets=["draft_prune=true"], strict_memory=False
        )
    )
    assert (full.head_rows, pruned.head_rows) == (124_160, 32_768)
    assert round(full.head_bytes / GB, 2) == 1.27 and round(pruned.head_bytes / GB, 2) == 0.34
    assert full.weights_bytes == pruned.weights_bytes
    assert full.per_depth_bytes - pruned.per_depth_bytes == (124_160 - 32_768) * 5120 * 2


def test_without_mtp_a_depth_adds_nothing() -> None:
    dc = decode_cost(
        resolve(
            "h200-141g",
            "qwen3.6-27b-awq-int4",
            sets=["speculative.method=none"],
            strict_memory=False,
        )
    )
    assert (dc.per_depth_bytes, dc.draft_layers, dc.head_rows) == (0, 0, 0)
    doc = dc.sidecar()
    assert doc is not None and doc["per_depth_bytes"] == 0
    assert dc.graph_mode == "FULL_AND_PIECEWISE"  # rule cudagraphs without speculation
    cost = StepCost.from_json(doc, "t")
    assert list(cost.depths(0)) == [0]


def test_a_stated_bandwidth_wins_and_none_means_no_floor(tmp_path: Path) -> None:
    cpu = decode_cost(resolve("cpu", "tiny-hybrid-mtp", strict_memory=False))
    assert cpu.bandwidth is None and cpu.floor_s(1) is None and cpu.sidecar() is None
    assert "set accelerator.memory_bandwidth_gbs" in cpu.summary(1, "CPU worker")
    root = tmp_path / "profiles"
    import shutil

    shutil.copytree(REPO / "profiles", root)
    hw = root / "hardware" / "cpu.yaml"
    hw.write_text(
        hw.read_text(encoding="utf-8").replace(
            "kind: cpu", "kind: cpu\n  memory_bandwidth_gbs: 20", 1
        ),
        encoding="utf-8",
    )
    stated = decode_cost(resolve("cpu", "tiny-hybrid-mtp", root=root, strict_memory=False))
    assert stated.bandwidth is not None and stated.bandwidth.gbs == 20.0
    assert "accelerator.memory_bandwidth_gbs" in stated.bandwidth.source
    hw.write_text(
        hw.read_text(encoding="utf-8").replace(
            "memory_bandwidth_gbs: 20", "memory_bandwidth_gbs: 0"
        ),
        encoding="utf-8",
    )
    with pytest.raises(VfleetError) as err:
        resolve("cpu", "tiny-hybrid-mtp", root=root, strict_memory=False)
    assert "memory_bandwidth_gbs" in str(err.value)


def _cost(mode: str = "FULL_AND_PIECEWISE") -> StepCost:
    return StepCost(
        base_bytes=10 * 10**9,
        per_depth_bytes=2 * 10**9,
        target_layers=64,
        draft_layers=1,
        bandwidth_gbs=1000.0,
        graph_mode=mode,
    )


def test_the_model_returns_the_measured_step_and_spreads_the_rest_per_layer() -> None:
    c = _cost()
    # at depth 3: floor 16 ms; measured 23.4 ms leaves 7.4 ms over 67 layers
    assert c.step_s(0.0234, 3, 3) == pytest.approx(0.0234)
    per_layer = (0.0234 - 0.016) / 67
    assert c.per_layer_s(0.0234, 3) == pytest.approx(per_layer)
    assert c.step_s(0.0234, 3, 0) == pytest.approx(0.010 + 64 * per_layer)
    assert c.step_s(0.0234, 3, 5) == pytest.approx(0.020 + 69 * per_layer)
    # a step faster than its floor (a wrong bandwidth) leaves nothing per layer, never less
    assert c.per_layer_s(0.001, 3) == 0.0


@pytest.mark.parametrize("mode", ["FULL_AND_PIECEWISE", "PIECEWISE", "NONE"])
def test_no_depth_deeper_than_the_running_one_is_modelled(mode: str) -> None:
    # the model under-costs a depth in every measured pair (docs/TUNE.md, The cost model)
    table = _cost(mode).table(0.0234, 3, concurrency=2)
    assert sorted(table.seconds_per_step) == [0, 1, 2, 3]
    assert table.concurrency == 2
    assert table.method.startswith("modelled from the live step at MTP 3")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("base_bytes", 0),
        ("base_bytes", True),
        ("base_bytes", 1.5),
        ("per_depth_bytes", -1),
        ("target_layers", 0),
        ("bandwidth_gbs", 0),
        ("bandwidth_gbs", float("inf")),
        ("bandwidth_gbs", "4232"),
        ("graph_mode", "PIECE WISE"),
        ("graph_mode", "full"),
        ("graph_mode", None),
        ("draft_layers", 0),
    ],
)
def test_a_bad_decode_cost_names_its_key(key: str, value: Any) -> None:
    doc = {
        "base_bytes": 10,
        "per_depth_bytes": 2,
        "target_layers": 64,
        "draft_layers": 1,
        "bandwidth_gbs": 20.0,
        "graph_mode": "PIECEWISE",
        key: value,
    }
    with pytest.raises(StepTimesError, match=f"sidecar.json: decode_cost.{key}"):
        StepCost.from_json(doc, "sidecar.json")


def test_the_committed_check_is_what_the_script_prints() -> None:
    bench = _bench()
    rows = bench.h200_rows() + bench.seed_rows()
    committed = json.loads(
        (REPO / "bench/results/decode-cost/rows.json").read_text(encoding="utf-8")
    )
    from dataclasses import asdict

    assert [asdict(r) for r in rows] == committed
    full = [r for r in rows if r.pair == "H200 awq-int4, full graphs"]
    assert len(full) == 3 and all(abs(r.error_pct) < 10 for r in full)
    # the pair tells the model apart from a free depth and from one twice as costly
    assert all(r.free_error_pct is not None and r.free_error_pct < -20 for r in full)


def test_new_lane_runs_are_checked_as_the_committed_pairs() -> None:
    """`--lane` on two committed runs (MTP 3 and MTP off, full graphs) gives the committed
    row of that pair: depths from the rendered vllm.yaml, sets as each run recorded them."""
    bench = _bench()
    h200 = REPO / "bench/results/h200"
    [got] = bench.lane_rows(
        [
            h200 / "lane-graphs-2026-12-04c-awq-int4-mtp-triton-full.json",
            h200 / "lane-graphs-2026-12-04c-awq-int4-nomtp-full.json",
        ]
    )
    [want] = [r for r in bench.h200_rows() if r.predicted == "MTP off, full graphs (04c)"]
    assert (got.measured_tok_s, got.model_tok_s, got.error_pct) == (
        want.measured_tok_s,
        want.model_tok_s,
        want.error_pct,
    )
    assert got.given == "mtp-triton-full (MTP 3)" and got.predicted == "nomtp-full (MTP 0)"


def test_every_configuration_a_device_step_runs_is_in_the_lane_matrix() -> None:
    """bench/gpu_device_steps.sh names lane configurations as NAME:SECONDS after `lane_each`:
    a typo would cost a device hold its run."""
    spec = importlib.util.spec_from_file_location("gpu_lane", REPO / "bench/gpu_lane.py")
    assert spec and spec.loader
    lane = importlib.util.module_from_spec(spec)
    sys.modules["gpu_lane"] = lane
    spec.loader.exec_module(lane)
    known = {c.name for c in lane.MATRIX}
    text = (REPO / "bench/gpu_device_steps.sh").read_text(encoding="utf-8")
    # the configurations follow on the continuation lines (one or more, each ending in "\")
    calls = re.findall(r"lane_each (\w+) [^\n]*\\\n((?:[^\n]*\\\n)*[^\n]+)", text)
    steps = {
        step: [p.split(":")[0] for p in rest.replace("\\", " ").split()] for step, rest in calls
    }
    assert {"graphs", "variants", "depths", "prune"} <= set(steps)
    assert steps["prune"] == ["mtp-triton-full", "mtp-triton-full-pruned"] * 2  # interleaved
    assert steps["depths"] == [
        "nomtp-triton-full",
        "mtp1-triton-full",
        "mtp-triton-full",
        "mtp-triton-full-pruned",
    ]
    for step, names in steps.items():
        assert set(names) <= known, (step, set(names) - known)


def test_tunes_check_of_the_model_against_measured_depths() -> None:
    # 10 GB + 2 GB a depth at 1,000 GB/s over 64 + 1 layers; measured: MTP 3 23.4 ms (the
    # winner), MTP 0 17 ms, MTP 1 18 ms
    c = _cost()
    per_layer = (0.0234 - 0.016) / 67
    errors = c.errors({0: 0.017, 1: 0.018, 3: 0.0234}, 3)
    assert list(errors) == [0, 1]
    assert errors[0] == pytest.approx((0.010 + 64 * per_layer) / 0.017 - 1)
    assert errors[1] == pytest.approx((0.012 + 65 * per_layer) / 0.018 - 1)
