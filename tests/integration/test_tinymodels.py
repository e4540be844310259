"""src/vfleet/hostside/tinymodels.py builds the tiny test models deterministically, as files vLLM
loads.

The builds run `python src/vfleet/hostside/tinymodels.py ...` with the interpreter in
VFLEET_VLLM_PY (a
vLLM virtualenv's python: it has torch, transformers, tokenizers and safetensors), exactly as a
deploy runs the copied script on a host. No vLLM server here: serving is tested elsewhere.
The bad-input tests need no such interpreter: the script checks its input before importing torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from tests.support import vllm_server
from vfleet.paths import hostside_script

SCRIPT = hostside_script("tinymodels")
#: Smallest logit margin the wide model must keep (measured 14.1 in replies, 12.7 in drafts;
#: 0.1-0.4 and 0.03 before issue 19's scaling, where the head missed drafts).
MARGIN = 8.0
GENERATORS = ("tiny-dense", "tiny-hybrid-mtp")
MTP_HEAD_KEYS = {
    "mtp.fc.weight",
    "mtp.norm.weight",
    "mtp.pre_fc_norm_hidden.weight",
    "mtp.pre_fc_norm_embedding.weight",
}


def profile_arch(generator: str) -> dict[str, Any]:
    data = yaml.safe_load((REPO / "profiles" / "models" / f"{generator}.yaml").read_text())
    arch: dict[str, Any] = data["arch"]
    return arch


def run_script(
    python: str, *args: str | os.PathLike[str], umask: int | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, str(SCRIPT), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={**os.environ, "PYTHONHASHSEED": "random"},
        preexec_fn=None if umask is None else lambda: os.umask(umask),
    )


def safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a .safetensors file: 8-byte little-endian length, then JSON."""
    with path.open("rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header: dict[str, Any] = json.loads(fh.read(length))
    return header


def tree(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


# --------------------------------------------------------------------------------------------
# builds (need the vLLM virtualenv's python)


@pytest.fixture(scope="module")
def vllm_python() -> str:
    default = vllm_server.vllm_python()
    python = os.environ.get("VFLEET_VLLM_PY") or (str(default) if default.exists() else "")
    if not python:
        message = (
            "no vLLM virtualenv: run `make tools`, or set VFLEET_VLLM_PY to the python of a "
            "vLLM virtualenv (torch + transformers + tokenizers + safetensors)"
        )
        if os.environ.get("VFLEET_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    if not Path(python).exists():
        pytest.fail(f"VFLEET_VLLM_PY={python} does not exist")
    return python


@pytest.fixture(scope="module")
def builds(vllm_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """Each generator built twice (same seed) into different folders."""
    out: dict[str, list[Path]] = {}
    for generator in GENERATORS:
        arch_file = tmp_path_factory.mktemp("arch") / f"{generator}.json"
        arch_file.write_text(json.dumps(profile_arch(generator)))
        for run in ("first", "second"):
            dest = tmp_path_factory.mktemp(run) / generator
            proc = run_script(vllm_python, generator, dest, "--arch-json", arch_file, "--seed", "0")
            assert proc.returncode == 0, proc.stderr[-4000:]
            assert "training tokenizer..." in proc.stderr
            assert "building weights..." in proc.stderr
            assert f"done: {dest} (" in proc.stderr
            out.setdefault(generator, []).append(dest)
    return out


needs_vllm_py = pytest.mark.vllm


@needs_vllm_py
@pytest.mark.parametrize("generator", GENERATORS)
def test_config_matches_profile(builds: dict[str, list[Path]], generator: str) -> None:
    model = builds[generator][0]
    arch = profile_arch(generator)
    config = json.loads((model / "config.json").read_text())
    assert config["architectures"] == [arch["architecture"]]
    assert config["model_type"] == arch["model_type"]
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
    ):
        assert config[key] == arch[key], key
    assert config["torch_dtype"] == config["dtype"] in ("bfloat16", "float32")
    if generator == "tiny-hybrid-mtp":
        assert config["mtp_num_hidden_layers"] == arch["mtp_layers"]
        assert config["num_experts"] == arch["num_experts"]
        assert config["full_attention_interval"] == arch["full_attention_interval"]
        expected = [
            "full_attention"
            if (i + 1) % arch["full_attention_interval"] == 0
            else "linear_attention"
            for i in range(arch["num_hidden_layers"])
        ]
        assert config["layer_types"] == expected
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (model / name).is_file(), name


@needs_vllm_py
@pytest.mark.parametrize("generator", GENERATORS)
def test_tokenizer_fits_vocab(builds: dict[str, list[Path]], generator: str) -> None:
    model = builds[generator][0]
    vocab_size = json.loads((model / "config.json").read_text())["vocab_size"]
    tok = json.loads((model / "tokenizer.json").read_text())
    ids = set(tok["model"]["vocab"].values()) | {t["id"] for t in tok["added_tokens"]}
    assert max(ids) < vocab_size
    assert len(ids) <= vocab_size
    added = {t["content"]: t for t in tok["added_tokens"]}
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert added[special]["special"] is True, special
    for plain in ("<think>", "</think>"):
        assert added[plain]["special"] is False, plain
    tok_config = json.loads((model / "tokenizer_config.json").read_text())
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["pad_token"] == "<|endoftext|>"
    template = (model / "chat_template.jinja").read_text()
    assert "enable_thinking" in template
    assert "<think>\\n\\n</think>\\n\\n" in template


@needs_vllm_py
def test_hybrid_has_mtp_weights(builds: dict[str, list[Path]]) -> None:
    model = builds["tiny-hybrid-mtp"][0]
    arch = profile_arch("tiny-hybrid-mtp")
    hidden = arch["hidden_size"]
    header = safetensors_header(model / "model.safetensors")
    assert header["__metadata__"] == {"format": "pt"}
    keys = set(header) - {"__metadata__"}
    assert keys >= MTP_HEAD_KEYS
    assert header["mtp.fc.weight"]["shape"] == [hidden, 2 * hidden]
    # mtp.layers.0 is shaped like the model's full-attention layer, MoE MLP included.
    full = arch["full_attention_interval"] - 1
    attn_layer = {k.split(".", 3)[3] for k in keys if k.startswith(f"model.layers.{full}.")}
    mtp_layer = {k.split(".", 3)[3] for k in keys if k.startswith("mtp.layers.0.")}
    assert "self_attn.q_proj.weight" in mtp_layer
    assert "mlp.experts.0.gate_proj.weight" in mtp_layer
    assert mtp_layer == attn_layer
    for name in attn_layer:
        assert (
            header[f"mtp.layers.0.{name}"]["shape"]
            == header[f"model.layers.{full}.{name}"]["shape"]
        )
    # No stray extra decoder layer and no mtp weights in the dense model.
    assert not any(k.startswith(f"model.layers.{arch['num_hidden_layers']}.") for k in keys)
    dense = safetensors_header(builds["tiny-dense"][0] / "model.safetensors")
    assert not any(k.startswith("mtp.") for k in dense)


@needs_vllm_py
@pytest.mark.parametrize("generator", GENERATORS)
def test_manifest_hashes(builds: dict[str, list[Path]], generator: str) -> None:
    model = builds[generator][0]
    manifest = json.loads((model / "vfleet-model.json").read_text())
    assert manifest["generator"] == generator
    assert manifest["seed"] == 0
    assert manifest["arch"] == profile_arch(generator)
    files = {p.name for p in model.iterdir() if p.is_file()} - {"vfleet-model.json"}
    assert set(manifest["files"]) == files
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((model / name).read_bytes()).hexdigest() == digest, name


@needs_vllm_py
@pytest.mark.parametrize("generator", GENERATORS)
def test_builds_are_byte_identical(builds: dict[str, list[Path]], generator: str) -> None:
    first, second = builds[generator]
    assert tree(first) == tree(second)
    assert not list(first.parent.glob(".*")), "temporary build folders left behind"


@needs_vllm_py
def test_manifest_matches(builds: dict[str, list[Path]]) -> None:
    from vfleet.hostside.tinymodels import manifest_matches

    model = builds["tiny-dense"][0]
    arch = profile_arch("tiny-dense")
    assert manifest_matches(model, "tiny-dense", arch, 0)
    assert not manifest_matches(model, "tiny-dense", arch, 1)
    assert not manifest_matches(model, "tiny-dense", {**arch, "hidden_size": 512}, 0)


@needs_vllm_py
def test_force_replaces_existing(vllm_python: str, tmp_path: Path) -> None:
    arch_file = tmp_path / "arch.json"
    arch_file.write_text(json.dumps(profile_arch("tiny-dense")))
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "stale.txt").write_text("old")
    proc = run_script(vllm_python, "tiny-dense", dest, "--arch-json", arch_file)
    assert proc.returncode == 2
    assert (dest / "stale.txt").exists()
    # Under a hardened root umask (077), as the deploy builds it as root: the service user
    # reads the model, so the build gives the folder and files 0755 / 0644 itself.
    proc = run_script(
        vllm_python, "tiny-dense", dest, "--arch-json", arch_file, "--force", umask=0o077
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert not (dest / "stale.txt").exists()
    assert (dest / "vfleet-model.json").is_file()
    for f in [dest, *dest.rglob("*")]:
        assert f.stat().st_mode & 0o055 == (0o055 if f.is_dir() else 0o044), (
            f,
            oct(f.stat().st_mode),
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["arch.json", "model"]


@needs_vllm_py
def test_a_wide_model_still_answers_its_script(vllm_python: str, tmp_path: Path) -> None:
    """Issue 19: at mid-hybrid-mtp's width (hidden 4096; 2 layers here, one GDN and one attention,
    for time) the random layers, scaled by residual_scale, leave the wiring in charge: the greedy
    chat replies follow the script and the MTP head, run as vLLM runs it, drafts every next token
    at the first two draft positions, each with a wide logit margin. Unscaled, this 2-layer
    model's head missed 3-5 of 23 drafts and the 8-layer mid model answered reserved tokens
    (docs/GPU.md section 2b)."""
    arch = {**profile_arch("mid-hybrid-mtp"), "num_hidden_layers": 2, "full_attention_interval": 2}
    arch_file = tmp_path / "arch.json"
    arch_file.write_text(json.dumps(arch))
    model = tmp_path / "model"
    try:
        proc = run_script(vllm_python, "tiny-hybrid-mtp", model, "--arch-json", arch_file)
        assert proc.returncode == 0, proc.stderr[-4000:]
        check = subprocess.run(
            [vllm_python, str(REPO / "tests" / "support" / "wiring_check.py"), str(model), "24"],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
    finally:
        shutil.rmtree(model, ignore_errors=True)  # 1.9 GB
    assert check.returncode == 0, check.stderr[-4000:]
    result = json.loads(check.stdout)
    script = "<think> Random weights, no real thoughts</think>\n\n The quick brown fox jumps over"
    for reply in result["replies"]:
        assert reply["reply"].startswith(script), reply
        assert reply["margin"] > MARGIN, reply
    for mtp in result["mtp"]:
        assert mtp["accepted"] == mtp["drafts"] == 23, mtp
        assert mtp["margin"] > MARGIN, mtp
    for mtp in result["mtp2"]:  # the second draft position: the head fed its own output
        assert mtp["accepted"] == mtp["drafts"] == 22, mtp
        assert mtp["margin"] > MARGIN, mtp


# --------------------------------------------------------------------------------------------
# bad input (any python: checked before torch is imported)


def test_module_imports_without_torch() -> None:
    code = "import sys, vfleet.hostside.tinymodels; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["tiny-sparse", "{dest}", "--arch-json", "{arch}"], "invalid choice"),
        (["tiny-dense", "{dest}", "--arch-json", "{tmp}/missing.json"], "cannot read"),
        (["tiny-dense", "{dest}", "--arch-json", "{bad_json}"], "not valid JSON"),
        (["tiny-hybrid-mtp", "{dest}", "--arch-json", "{arch}"], "builds Qwen3NextForCausalLM"),
        (["tiny-dense", "{full}", "--arch-json", "{arch}"], "is not empty"),
        (["tiny-dense", "{dest}", "--arch-json", "{no_hidden}"], "arch.hidden_size"),
        (["tiny-dense", "{dest}", "--arch-json", "{arch}", "--seed", "-1"], "seed"),
    ],
)
def test_bad_input_exits_2(tmp_path: Path, args: list[str], message: str) -> None:
    arch = profile_arch("tiny-dense")
    (tmp_path / "arch.json").write_text(json.dumps(arch))
    (tmp_path / "bad.json").write_text("{not json")
    no_hidden = {k: v for k, v in arch.items() if k != "hidden_size"}
    (tmp_path / "no_hidden.json").write_text(json.dumps(no_hidden))
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    values = {
        "dest": str(tmp_path / "out"),
        "arch": str(tmp_path / "arch.json"),
        "tmp": str(tmp_path),
        "bad_json": str(tmp_path / "bad.json"),
        "no_hidden": str(tmp_path / "no_hidden.json"),
        "full": str(full),
    }
    proc = run_script(sys.executable, *(a.format(**values) for a in args))
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
    assert (full / "x").read_text() == "x"
