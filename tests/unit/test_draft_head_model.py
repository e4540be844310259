"""bench/draft_head_model.py: the draft head's shapes, bytes and cost model (no GPU needed).

The shapes must be the presets' and the head arithmetic rule `plugin`'s (the bench imports
vfleet.engine.draft_prune, stdlib only, from src/); the product's fixed cost must be what these
results measured; the byte counts and the cost model are checked against hand-computed figures.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from tests.conftest import REPO
from vfleet.engine import draft_prune


def _load() -> ModuleType:
    path = REPO / "bench" / "draft_head_model.py"
    spec = importlib.util.spec_from_file_location("draft_head_model", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["draft_head_model"] = mod
    spec.loader.exec_module(mod)
    return mod


m = _load()


def test_k_is_rule_plugins() -> None:
    assert m.DRAFT_VOCAB_TOP == draft_prune.DRAFT_VOCAB_TOP
    assert [m.SHAPES[s].k for s in ("qwen", "mid", "tiny")] == [65_536, 16_384, 512]


@pytest.mark.parametrize(
    ("shape", "preset"),
    [
        ("qwen", "qwen3.8-27b-awq-mtp"),
        ("qwen", "qwen3.6-27b-fp8"),
        ("mid", "mid-hybrid-mtp"),
        ("tiny", "tiny-hybrid-mtp"),
    ],
)
def test_shapes_are_the_presets(shape: str, preset: str) -> None:
    arch = yaml.safe_load((REPO / "profiles" / "models" / f"{preset}.yaml").read_text())["arch"]
    s = m.SHAPES[shape]
    assert (s.hidden, s.vocab) == (arch["hidden_size"], arch["vocab_size"])


def test_bytes_per_call() -> None:
    q = m.SHAPES["qwen"]
    assert q.bytes_full() == 248_320 * 5120 * 2 == 2_542_796_800
    assert q.bytes_pruned() == 65_536 * 5120 * 2
    # TP=2: a rank reads half the padded vocabulary and every second of the K rows
    assert q.bytes_full(2) == 124_160 * 5120 * 2
    assert q.rows_pruned(2) == 32_768
    # vLLM pads the vocabulary to 64 rows; an odd K gives rank 0 the extra row
    odd = m.Shape("odd", 8, 1001)
    assert odd.rows_full() == 1024 and odd.k == 500 and odd.rows_pruned(3) == 167


def test_fixed_cost_takes_the_bytes_out() -> None:
    # 2 GB in 1.0 ms and 0.5 GB in 0.3 ms at 4,000 GB/s: 0.5 and 0.125 ms of bytes, so
    # 0.5 ms and 0.175 ms beyond them: the pruned head costs 175 - 500 = -325 us more
    assert m.fixed_cost_us(1000.0, 300.0, 2_000_000_000, 500_000_000, 4000.0) == pytest.approx(
        -325.0
    )
    assert m.fraction_of_bound(4_000_000_000, 1.0, 4000.0) == pytest.approx(1.0)


def test_prediction_at_the_seeds_card() -> None:
    # 2080 Ti, TP 2: a rank's full head 1.27 GB at 616 GB/s = 2,064 us; K/2 rows 336 MB = 545 us
    p = m.predict(m.SHAPES["qwen"], m.Card("2080ti", 616.0, 2, "seed 000"), 10.0)
    assert (p.full_us, p.pruned_us, p.saved_us) == (2064.0, 544.7, 1519.2)
    assert p.net_us == 1509.2 and p.net_step_ms == pytest.approx(4.528)
    # the tiny head saves a fraction of a microsecond: a fixed cost makes it a loss
    t = m.predict(m.SHAPES["tiny"], m.Card("h200", 4300.0, 1, "measured"), 3.0)
    assert t.saved_us == 0.1 and t.net_us < 0


def test_step_saving_from_a_speed_up() -> None:
    # 69 -> 107 tok/s at 1 token per step: 14.49 - 9.35 = 5.15 ms per step
    assert m.step_saving_ms(1.0, 69.0, 107.0) == pytest.approx(5.147, abs=1e-3)
    assert m.step_saving_ms(4.0, 69.0, 107.0) == pytest.approx(4 * 5.147, abs=4e-3)


def test_the_table_from_the_h200_results(capsys: pytest.CaptureFixture[str]) -> None:
    runs = sorted((REPO / "bench" / "results" / "h200").glob("draft-head-run*.json"))
    assert len(runs) == 2
    measured = m.read_results(runs)
    assert 4000 < measured.copy_gbs < 4500 and 0 < measured.fixed_us < 20
    rows = {(p.card, p.shape): p for p in m.table(measured)}
    # the 27B head pays on every card; the tiny head's 0.26 MB saves less than the fixed cost
    assert all(rows[(c.name, "qwen")].net_us > 400 for c in m.CARDS)
    assert all(rows[(c.name, "tiny")].net_us < 0 for c in m.CARDS)
    assert m.main([str(p) for p in runs]) == 0
    assert "2080 Ti      qwen   2   2064.0" in capsys.readouterr().out


def test_bad_results_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "draft_head.json"
    bad.write_text('{"rows": []}')
    assert m.main([str(bad)]) == 2
    assert "draft_head.json" in capsys.readouterr().err


def test_the_products_fixed_cost_and_h200_bandwidth_are_the_measured_ones() -> None:
    """Rule `plugin` decides with constants; they must be what the H200 results say."""
    runs = sorted((REPO / "bench" / "results" / "h200").glob("draft-head-run*.json"))
    assert len(runs) == 2
    measured = m.read_results(runs)
    assert round(measured.fixed_us, 1) == draft_prune.FIXED_COST_US
    assert round(measured.copy_gbs) == draft_prune.BANDWIDTH["NVIDIA H200"].gbs
