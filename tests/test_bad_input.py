"""Bad input exits 2, names the file, key or rule and the fix, and writes nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from .conftest import Result, tree_digest


def _render(cli: Callable[..., Result], out: Path, *args: str) -> Result:
    return cli("render", *args, "--out", str(out))


@pytest.fixture
def out_with_previous(tmp_path: Path, cli: Callable[..., Result]) -> Path:
    """An --out folder that holds a good earlier render: bad input must leave it as it was."""
    out = tmp_path / "out"
    assert _render(cli, out, "-p", "cpu", "-m", "tiny-dense").rc == 0
    return out


def _assert_untouched(out: Path, before: dict[str, str]) -> None:
    assert tree_digest(out) == before
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert leftovers == []


def test_malformed_yaml_names_file_and_line(
    cli: Callable[..., Result], profiles_copy: Path, out_with_previous: Path
) -> None:
    bad = profiles_copy / "hardware" / "cpu.yaml"
    bad.write_text(bad.read_text() + "defaults: [unclosed\n")
    before = tree_digest(out_with_previous)
    r = _render(
        cli,
        out_with_previous,
        "--profiles-dir",
        str(profiles_copy),
        "-p",
        "cpu",
        "-m",
        "tiny-dense",
    )
    assert r.rc == 2
    assert f"{bad}:" in r.err and "malformed YAML" in r.err and "fix:" in r.err
    _assert_untouched(out_with_previous, before)


def test_unknown_key_names_file_key_and_suggestion(
    cli: Callable[..., Result], profiles_copy: Path, out_with_previous: Path
) -> None:
    f = profiles_copy / "models" / "tiny-dense.yaml"
    f.write_text(f.read_text().replace("  head_dim: 64", "  head_dims: 64"))
    before = tree_digest(out_with_previous)
    r = _render(
        cli,
        out_with_previous,
        "--profiles-dir",
        str(profiles_copy),
        "-p",
        "cpu",
        "-m",
        "tiny-dense",
    )
    assert r.rc == 2
    assert str(f) in r.err and "arch.head_dims" in r.err and "unknown key" in r.err
    assert "did you mean 'head_dim'" in r.err
    _assert_untouched(out_with_previous, before)


def test_unknown_key_in_deployment_settings(cli: Callable[..., Result], tmp_path: Path) -> None:
    dep = tmp_path / "dep.yaml"
    dep.write_text("profile: cpu\nmodel: tiny-dense\nsettings:\n  max_num_seq: 2\n")
    r = cli("explain", "-d", str(dep))
    assert r.rc == 2
    assert str(dep) in r.err and "settings.max_num_seq" in r.err and "'max_num_seqs'" in r.err


def test_unknown_profile_and_model_list_what_exists(cli: Callable[..., Result]) -> None:
    r = cli("explain", "-p", "2x2080ti", "-m", "tiny-dense")
    assert r.rc == 2 and "unknown hardware" in r.err and "2x2080ti-22g" in r.err
    r = cli("explain", "-p", "cpu", "-m", "qwen9")
    assert r.rc == 2 and "unknown model" in r.err and "tiny-hybrid-mtp" in r.err


def test_bad_set_value_and_key(cli: Callable[..., Result]) -> None:
    r = cli("explain", "-p", "cpu", "-m", "tiny-dense", "--set", "max_num_seqs=lots")
    assert r.rc == 2 and "--set" in r.err and "max_num_seqs" in r.err
    r = cli("explain", "-p", "cpu", "-m", "tiny-dense", "--set", "maxmodellen=5")
    assert r.rc == 2 and "unknown key" in r.err
    r = cli("explain", "-p", "cpu", "-m", "tiny-dense", "--set", "novalue")
    assert r.rc == 2 and "key=value" in r.err


def test_unknown_stack(cli: Callable[..., Result]) -> None:
    r = cli("explain", "-p", "2x2080ti-22g", "-m", "qwen3.6-27b-fp8", "--set", "stack=vllm-0.24")
    assert r.rc == 2 and "unknown stack" in r.err and "vllm-0.24.0-flashinfer-sm75" in r.err


@pytest.mark.parametrize(
    ("args", "rule", "words"),
    [
        (
            [
                "-p",
                "2x2080ti-22g",
                "-m",
                "qwen3.6-27b-fp8",
                "--set",
                "attention_backend=TRITON_ATTN",
                "--set",
                "kv_cache_dtype=fp8",
            ],
            "attention-backend",
            "SM89",
        ),
        (
            [
                "-p",
                "2x2080ti-22g",
                "-m",
                "qwen3.6-27b-fp8",
                "--set",
                "attention_backend=FLASH_ATTN",
            ],
            "attention-backend",
            "SM80",
        ),
        (
            ["-p", "a100-32g", "-m", "qwen3.8-27b-awq-mtp", "--set", "max_num_seqs=2"],
            "speculative",
            "32 GB",
        ),
        (
            ["-p", "2x2080ti-22g", "-m", "qwen3.6-27b-fp8", "--set", "dtype=bfloat16"],
            "dtype-half-sm75",
            "bfloat16",
        ),
        (
            ["-p", "2x2080ti-22g", "-m", "qwen3.6-27b-fp8", "--set", "tensor_parallel_size=4"],
            "device-fits-profile",
            "exceeds",
        ),
        (
            ["-p", "cpu", "-m", "tiny-hybrid-mtp", "--set", "prefix_caching=true"],
            "prefix-caching",
            "CPU backend",
        ),
        (
            ["-p", "cpu", "-m", "tiny-dense", "--set", "max_model_len=100000"],
            "context-and-batch",
            "native window",
        ),
        (
            ["-p", "cpu", "-m", "tiny-dense", "--set", "speculative.method=mtp"],
            "speculative",
            "no MTP layers",
        ),
        (
            ["-p", "cpu", "-m", "tiny-dense", "--set", "attention_backend=FLASHINFER"],
            "device-fits-profile",
            "GPU backend",
        ),
    ],
)
def test_refusals_name_rule_reason_and_fix(
    cli: Callable[..., Result], out_with_previous: Path, args: list[str], rule: str, words: str
) -> None:
    before = tree_digest(out_with_previous)
    r = _render(cli, out_with_previous, *args)
    assert r.rc == 2, r.out
    assert f"rule {rule}" in r.err and words in r.err and "fix:" in r.err and "source:" in r.err
    _assert_untouched(out_with_previous, before)


def test_out_folder_with_foreign_files_is_refused(
    cli: Callable[..., Result], tmp_path: Path
) -> None:
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("operator's file")
    r = _render(cli, out, "-p", "cpu", "-m", "tiny-dense")
    assert r.rc == 2 and "not rendered by vfleet" in r.err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_rerender_replaces_only_vfleet_output(cli: Callable[..., Result], tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert _render(cli, out, "-p", "cpu", "-m", "tiny-dense").rc == 0
    assert _render(cli, out, "-p", "cpu", "-m", "tiny-hybrid-mtp").rc == 0
    assert "tiny-hybrid-mtp" in (out / "vllm.yaml").read_text()


def test_model_make_rejects_a_downloaded_preset(cli: Callable[..., Result], tmp_path: Path) -> None:
    r = cli("model", "make", "qwen3.6-27b-fp8", str(tmp_path / "m"))
    assert r.rc == 2 and "not a generated model" in r.err
