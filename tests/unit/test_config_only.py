"""Config-only folders of the real-size presets (issue 31): the config.json vLLM's
--load-format dummy builds the architecture from, with the quantisation config its loader
reads, and a tokenizer of the model's vocabulary size (no weights)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import REPO
from vfleet.checks.vllm_check import model_config_json, sixteen_bit_modules
from vfleet.config.profiles import load_model
from vfleet.engine.gpu_memory import param_counts
from vfleet.hostside import tinymodels


def preset(name: str):  # type: ignore[no-untyped-def]
    return load_model(name, REPO / "profiles")


def test_fp8_keeps_the_planners_16_bit_layers_by_their_checkpoint_names() -> None:
    p = preset("qwen3.6-27b-fp8")
    q = model_config_json(p)["quantization_config"]
    assert (q["quant_method"], q["weight_block_size"], q["activation_scheme"]) == (
        "fp8",
        [128, 128],
        "dynamic",
    )
    names = q["modules_to_not_convert"]
    assert names == sixteen_bit_modules(p)
    # in_proj_a / in_proj_b of every GDN layer (48 of 64: every 4th layer is attention), by the
    # multimodal checkpoint's names (vLLM maps model.language_model. onto its own)
    gdn = [n for n in names if ".linear_attn." in n]
    assert len(gdn) == 2 * 48 and len(set(gdn)) == len(gdn)
    assert "model.language_model.layers.0.linear_attn.in_proj_a" in gdn
    assert not any(n.startswith("model.language_model.layers.3.") for n in gdn)
    # the MTP layer's every linear (the fused qkv / gate_up by all their shards) and mtp.fc
    mtp = [n for n in names if n.startswith("mtp.")]
    assert len(mtp) == 8 and "mtp.fc" in mtp and "mtp.layers.0.self_attn.q_proj" in mtp
    # what the planner counts in 16 bits: the GDN layers' small projections and the MTP module
    assert {"gdn_small", "mtp"} <= set(param_counts(p.arch))


@pytest.mark.parametrize("name", ["qwen3.6-27b-awq-int4", "qwen3.8-27b-awq-mtp"])
def test_awq_names_its_16_bit_layers_as_substrings(name: str) -> None:
    q = model_config_json(preset(name))["quantization_config"]
    assert (q["quant_method"], q["bits"], q["group_size"], q["zero_point"]) == (
        "awq",
        4,
        128,
        True,
    )
    # non-empty: vLLM 0.24.0's AWQ loader reads the folder's safetensors dtypes otherwise
    assert q["modules_to_not_convert"] == [
        "linear_attn.in_proj_a",
        "linear_attn.in_proj_b",
        "mtp.",
        "visual.",
    ]


needs_tokenizers = pytest.mark.skipif(
    importlib.util.find_spec("tokenizers") is None
    or importlib.util.find_spec("transformers") is None,
    reason="needs tokenizers and transformers (a vLLM venv has them)",
)


@needs_tokenizers
def test_a_config_only_folder_has_the_config_and_a_full_size_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    config = model_config_json(preset("qwen3.6-27b-fp8"))
    ids = tinymodels.build_config_only(config, tmp_path / "m")
    files = {p.name for p in (tmp_path / "m").iterdir()}
    assert "config.json" in files and not any(f.endswith(".safetensors") for f in files)
    written = json.loads((tmp_path / "m" / "config.json").read_text())
    assert written["quantization_config"] == config["quantization_config"]
    assert written["text_config"]["eos_token_id"] == ids[tinymodels.IM_END]
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "m"))
    assert len(tok) == 248_320  # every id the model can emit decodes
    assert tok.convert_ids_to_tokens(248_319) == "</tool_call>"
    assert tok.decode([200_000]) == f"<|vfleet_fill_{200_000}|>"
    manifest = json.loads((tmp_path / "m" / tinymodels.MANIFEST_NAME).read_text())
    assert manifest["generator"] == tinymodels.CONFIG_ONLY


def test_config_only_refuses_a_config_without_architectures(tmp_path: Path) -> None:
    with pytest.raises(tinymodels.TinyModelError, match="architectures"):
        tinymodels.build_config_only({"vocab_size": 1000}, tmp_path / "m")
    assert tinymodels.main(["config-only", str(tmp_path / "m")]) == 2
