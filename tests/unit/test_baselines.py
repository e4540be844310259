"""Baselines (profiles/baselines/): what speed is normal, where alerts and status get it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import PROFILES
from vfleet.config.profiles import find_baseline, load_baselines, load_profile
from vfleet.engine.compile import resolve
from vfleet.errors import VfleetError
from vfleet.measure.baseline import baseline_from, save
from vfleet.render.monitoring import effective_alerts, scrape_target


def test_shipped_baselines_name_real_profiles_models_and_stacks() -> None:
    found = load_baselines()
    assert len(found) >= 4
    models = {p.stem for p in (PROFILES / "models").glob("*.yaml")}
    for path, b in found:
        profile = load_profile(b.profile)
        assert b.model in models, path
        assert b.stack is None or b.stack in profile.stacks, path
        assert path.stem == f"{b.profile}--{b.model}", "file name = PROFILE--MODEL"


def test_decode_floor_comes_from_the_baseline_unless_set() -> None:
    launch = resolve(None, None, deployment=PROFILES / "deployments/seed-001-a100-pm2.yaml")
    assert launch.baseline is not None and launch.baseline.decode_tokens_per_second is not None
    assert launch.baseline.decode_tokens_per_second.low == 62  # seed 001
    assert effective_alerts(launch).stream_decode_tokens_per_second_floor == pytest.approx(49.6)
    assert scrape_target(launch)["alerts"]["stream_decode_tokens_per_second_floor"] == 49.6
    own = resolve(
        None,
        None,
        deployment=PROFILES / "deployments/seed-001-a100-pm2.yaml",
        sets=["alerts.stream_decode_tokens_per_second_floor=40"],
    )
    assert effective_alerts(own).stream_decode_tokens_per_second_floor == 40
    # No baseline on the CPU profile: no decode alert at all rather than a made-up floor.
    cpu = resolve("cpu", "tiny-hybrid-mtp")
    assert cpu.baseline is None
    assert effective_alerts(cpu).stream_decode_tokens_per_second_floor is None


def test_the_stack_specific_and_the_operators_own_baseline_win(profiles_copy: Path) -> None:
    folder = profiles_copy / "baselines"
    generic = {"profile": "a100-32g", "model": "qwen3.8-27b-awq-mtp", "source": "generic"}
    (folder / "generic.yaml").write_text(
        yaml.safe_dump({**generic, "decode_tokens_per_second": {"low": 1}})
    )
    found = find_baseline("a100-32g", "qwen3.8-27b-awq-mtp", "vllm-0.27.1", profiles_copy)
    assert found is not None
    assert found[1].source.startswith("seed 001")  # same stack beats no stack
    (folder / "local").mkdir()
    mine = {**generic, "stack": "vllm-0.27.1", "source": "mine"}
    (folder / "local" / "a100-32g--qwen3.8-27b-awq-mtp.yaml").write_text(
        yaml.safe_dump({**mine, "decode_tokens_per_second": {"low": 58}})
    )
    found = find_baseline("a100-32g", "qwen3.8-27b-awq-mtp", "vllm-0.27.1", profiles_copy)
    assert found is not None and found[1].source == "mine"
    # Another stack of the same profile: only the generic one applies.
    found = find_baseline("a100-32g", "qwen3.8-27b-awq-mtp", "other", profiles_copy)
    assert found is not None and found[1].source == "generic"


def test_a_bad_baseline_file_names_file_and_key(profiles_copy: Path) -> None:
    bad = profiles_copy / "baselines" / "a100-32g--qwen3.8-27b-awq-mtp.yaml"
    bad.write_text(bad.read_text().replace("high: 70", "high: 7"))
    with pytest.raises(VfleetError) as err:
        load_baselines(profiles_copy)
    text = err.value.render()
    assert str(bad) in text and "high must not be below low" in text


def _doc(release: dict[str, str] | None) -> dict[str, object]:
    run = {
        "scenario": "decode",
        "max_tokens": 800,
        "decode_tps": 64.0,
        "acceptance_rate": 0.5,
        "error": None,
    }
    return {
        "target": {"url": "http://127.0.0.1:8000"},
        "started_at": "2026-11-29T12:00:00+00:00",
        "runs": [run, {**run, "decode_tps": 70.5, "acceptance_rate": 0.52}],
        "fits": {"prefill": {"rate_tps": 1234.4, "r2": 0.99, "fixed_s": 0.5}},
        "deployment": {"source": "release.json", "release": release} if release else None,
    }


def test_save_baseline_from_a_bench_result(tmp_path: Path) -> None:
    release = {"profile": "a100-32g", "model": "qwen3.8-27b-awq-mtp", "stack": "vllm-0.27.1"}
    b = baseline_from(_doc(release))
    assert b.decode_tokens_per_second is not None
    assert (b.decode_tokens_per_second.low, b.decode_tokens_per_second.high) == (64.0, 70.5)
    assert b.prefill_tokens_per_second is not None and b.prefill_tokens_per_second.low == 1234
    root = tmp_path / "profiles"
    shutil.copytree(PROFILES, root)
    out = root / "baselines" / "local" / "a100-32g--qwen3.8-27b-awq-mtp.yaml"
    save(b, out)
    found = find_baseline("a100-32g", "qwen3.8-27b-awq-mtp", "vllm-0.27.1", root)
    assert found is not None and found[0] == out and found[1] == b
    launch = resolve(
        None,
        None,
        deployment=PROFILES / "deployments/seed-001-a100-pm2.yaml",
        root=root,
    )
    assert effective_alerts(launch).stream_decode_tokens_per_second_floor == pytest.approx(51.2)


def test_save_baseline_needs_the_deployment() -> None:
    with pytest.raises(VfleetError, match="no deployment profile, model, stack"):
        baseline_from(_doc(None))
