"""The planner's card lookup: a profile's calibrated total must not discard a known card's
measured CUDA context (issue 31: h200-141g's calibration made `vfleet plan` show the default
384 +/- 128 MiB "unverified" instead of the H200's measured 527 MiB)."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.conftest import REPO
from vfleet.config.profiles import load_profile
from vfleet.engine.compile import resolve
from vfleet.engine.gpu_memory import CARDS, MIB, card_memory
from vfleet.engine.planner import plan_launch

H200 = CARDS[("NVIDIA H200", 0)]


def _context(launch_profile: str, root: Path | None = None) -> tuple[int, int, str]:
    plan = plan_launch(
        resolve(launch_profile, "tiny-hybrid-mtp", sets=["max_model_len=4096"], root=root)
    )
    assert plan.gpu is not None
    (term,) = [t for t in plan.gpu.terms if t.name == "CUDA context"]
    return term.bytes, term.uncertainty, term.known


def test_the_h200_profile_plans_with_the_measured_card() -> None:
    assert _context("h200-141g") == (527 * MIB, 16 * MIB, "measured")
    card = card_memory(load_profile("h200-141g"))
    assert card == H200 and card.known == "measured"


def test_a_calibrated_total_keeps_the_cards_measured_context(tmp_path: Path) -> None:
    root = tmp_path / "profiles"
    shutil.copytree(REPO / "profiles", root)
    hw = root / "hardware" / "h200-141g.yaml"
    hw.write_text(
        hw.read_text().replace(
            "calibration:\n",
            'calibration:\n  torch_total_mib: 140000\n  torch_total_source: "operator"\n',
        )
    )
    assert _context("h200-141g", root) == (527 * MIB, 16 * MIB, "measured")
    card = card_memory(load_profile("h200-141g", root))
    assert card.total_bytes == 140000 * MIB and card.known == "unverified"
