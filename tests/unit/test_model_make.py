"""`vfleet model make` needs a python with torch; without one it says which to use."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Result
from vfleet.config.pins import pins, venv_name


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="this venv has torch")
def test_model_make_without_torch_names_the_fix(cli: Callable[..., Result], tmp_path: Path) -> None:
    r = cli("model", "make", "tiny-dense", str(tmp_path / "m"))
    venv = venv_name(pins().host)
    assert r.rc == 2 and "--python" in r.err and f"venvs/{venv}/bin/python" in r.err
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize(
    "args", [("tiny-dense",), ("qwen3.6-27b-fp8", "--config-only")], ids=["model", "config-only"]
)
def test_model_make_refuses_a_non_empty_folder(
    cli: Callable[..., Result], tmp_path: Path, args: tuple[str, ...]
) -> None:
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "keep.txt").write_text("mine")
    r = cli("model", "make", args[0], str(dest), *args[1:], "--python", "/bin/false")
    assert r.rc == 2 and "not empty" in r.err and "--force" in r.err
    assert (dest / "keep.txt").read_text() == "mine"


def test_model_make_help_lists_every_generated_preset(
    cli: Callable[..., Result], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # issue 31: the help named only the tiny models, though mid-hybrid-mtp is built the same way
    with pytest.raises(SystemExit) as done:
        cli("model", "make", "--help")
    out = " ".join(capsys.readouterr().out.split()).replace("- ", "-")
    assert done.value.code == 0
    for name in ("tiny-dense", "tiny-hybrid-mtp", "mid-hybrid-mtp"):
        assert name in out
    # the real checkpoints only as config-only folders (--config-only, for --load-format dummy)
    assert "--config-only, any preset (qwen3.6-27b-awq-int4, qwen3.6-27b-fp8" in out
    r = cli("model", "make", "qwen3.6-27b-fp8", str(tmp_path / "m"))
    assert r.rc == 2 and "mid-hybrid-mtp" in r.err and "--config-only" in r.err


def test_model_make_config_only_writes_the_presets_config(
    cli: Callable[..., Result], tmp_path: Path
) -> None:
    # the config-only folder is written by tinymodels.py (tokenizers + transformers); a python
    # that fails stands in for it here: the config it was handed is what matters
    seen = tmp_path / "seen.json"
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'while [ $# -gt 0 ]; do [ "$1" = --config-json ] && cp "$2" '
        + str(seen)
        + "; shift; done\n"
        "exit 0\n"
    )
    fake.chmod(0o755)
    r = cli(
        "model",
        "make",
        "qwen3.6-27b-awq-int4",
        str(tmp_path / "m"),
        "--config-only",
        "--python",
        str(fake),
    )
    assert r.rc == 0, r.err
    cfg = json.loads(seen.read_text())
    assert cfg["architectures"] == ["Qwen3_5ForConditionalGeneration"]
    assert cfg["text_config"]["vocab_size"] == 248_320
    q = cfg["quantization_config"]
    assert q["quant_method"] == "awq" and q["group_size"] == 128 and q["bits"] == 4
    assert q["modules_to_not_convert"]  # an empty list makes vLLM read the (absent) weights
    r = cli("model", "make", "qwen3.6-27b-fp8", str(tmp_path / "n"), "--config-only", "--unwired")
    assert r.rc == 2 and "no weights" in r.err
