"""Bad input exits 2, names the file, key or rule and the fix, and writes nothing."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import Result, tree_digest
from vfleet.engine.compile import resolve
from vfleet.errors import VfleetError


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
    assert r.rc == 2 and "unknown stack" in r.err and "vllm-0.24.0" in r.err


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


# --------------------------------------------------------------------------- hostile values
# Values that reach a shell (launch.sh sources vllm.env as root), a systemd unit or pm2's JS
# file are refused by their grammar before any template sees them (issue: a `;` in an
# extra_env name ran a command when the env file was sourced).


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("extra_env.X;touch /tmp/vfleet-pwned=1", "extra_env name"),
        ("extra_env.lower=1", "extra_env name"),
        ("host=127.0.0.1\nExecStartPre=/bin/true", "host"),
        ("host=127.0.0.1 --foo", "host"),
        ("host=%n", "host"),
        ("model_dir=/srv/models/%n", "model_dir"),
        ("model_dir=relative/model", "model_dir"),
        ("model_dir=/srv/../etc", "model_dir"),
        ("served_model_name=a b", "served_model_name"),
        ("instance=" + "a" * 300, "instance"),
        ("max_num_seqs=1000000000000", "max_num_seqs"),
        ("kv_space_gib=100000000", "kv_space_gib"),
        ("shutdown_timeout_s=100000000000", "shutdown_timeout_s"),
        ("extra_args.api-key=sk-plain", "api-key"),
        ("reasoning_parser=qwen3;id", "reasoning_parser"),
    ],
)
def test_hostile_settings_are_refused(
    cli: Callable[..., Result], out_with_previous: Path, setting: str, words: str
) -> None:
    before = tree_digest(out_with_previous)
    r = _render(cli, out_with_previous, "-p", "cpu", "-m", "tiny-dense", "--set", setting)
    assert r.rc == 2, r.err
    assert words in r.err and "fix:" in r.err and "Traceback" not in r.err
    _assert_untouched(out_with_previous, before)


@pytest.mark.parametrize(
    "base_dir", ["opt/vfleet", "/opt/%n", "$HOME/vfleet", "/opt/a b", "/opt/../x"]
)
def test_hostile_base_dir_is_refused(
    cli: Callable[..., Result], out_with_previous: Path, base_dir: str
) -> None:
    before = tree_digest(out_with_previous)
    r = _render(cli, out_with_previous, "-p", "cpu", "-m", "tiny-dense", "--base-dir", base_dir)
    assert r.rc == 2 and "base_dir" in r.err and "Traceback" not in r.err
    _assert_untouched(out_with_previous, before)


def test_env_values_round_trip_through_sh(cli: Callable[..., Result], tmp_path: Path) -> None:
    # What launch.sh does: source the env file with sh. A value full of shell syntax must come
    # back byte for byte, and run nothing.
    canary = tmp_path / "ran"
    value = f'$(touch {canary}); `touch {canary}` & | > < * ? [a] {{b}} ~ # %n %% "q"'
    out = tmp_path / "out"
    r = _render(cli, out, "-p", "cpu", "-m", "tiny-dense", "--set", f"extra_env.VFLEET_T={value}")
    assert r.rc == 0, r.err
    got = subprocess.run(
        ["sh", "-c", '. "$1" && printf %s "$VFLEET_T"', "sh", str(out / "vllm.env")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert got == value
    assert not canary.exists()


# --------------------------------------------------------------------------- --set typing


def _env_file(cli: Callable[..., Result], tmp_path: Path, *sets: str) -> str:
    out = tmp_path / "out"
    args = [a for s in sets for a in ("--set", s)]
    r = _render(cli, out, "-p", "cpu", "-m", "tiny-dense", *args)
    assert r.rc == 0, r.err
    return (out / "vllm.env").read_text()


def test_set_values_are_text_unless_the_schema_says_otherwise(
    cli: Callable[..., Result], tmp_path: Path
) -> None:
    # YAML would drop "#prod" as a comment: the value is the whole text.
    assert "VFLEET_T='s3cr3t #prod'" in _env_file(cli, tmp_path, "extra_env.VFLEET_T=s3cr3t #prod")
    # YAML reads 12:30 as 750 (base 60) and 010 as 8: text stays text.
    assert "VFLEET_T='12:30'" in _env_file(cli, tmp_path, "extra_env.VFLEET_T=12:30")
    assert "VFLEET_T='010'" in _env_file(cli, tmp_path, "extra_env.VFLEET_T=010")


@pytest.mark.parametrize("setting", ["api_key=null", "api_key="])
def test_a_key_from_the_inventory_must_have_a_value(setting: str) -> None:
    """The inventory's vfleet_set (a file, maybe a vault) may hold api_key; null or empty is
    refused, not read as "no key". (On a command line it is refused outright, below.)"""
    with pytest.raises(VfleetError, match="a value is required"):
        resolve("cpu", "tiny-dense", sets=[setting])


@pytest.mark.parametrize("command", ["render", "explain", "plan"])
def test_a_key_on_the_command_line_is_refused(
    cli: Callable[..., Result], tmp_path: Path, command: str
) -> None:
    """Issue 22, finding 2: a key in argv is readable by every local user while it runs."""
    args = ["--out", str(tmp_path / "out")] if command == "render" else []
    r = cli(command, "-p", "cpu", "-m", "tiny-dense", "--set", "api_key=sk-argv-1", *args)
    assert r.rc == 2 and "--set api_key" in r.err and "sk-argv-1" not in r.err, r.err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("setting", "fix"),
    [
        ("port=010", "whole number in decimal"),
        ("prefix_caching=on", "true or false"),
        ("gpu_memory_utilization=9e", "decimal number"),
    ],
)
def test_set_values_the_schema_refuses(
    cli: Callable[..., Result], out_with_previous: Path, setting: str, fix: str
) -> None:
    before = tree_digest(out_with_previous)
    r = _render(cli, out_with_previous, "-p", "cpu", "-m", "tiny-dense", "--set", setting)
    assert r.rc == 2 and fix in r.err and f"--set {setting}" in r.err, r.err
    _assert_untouched(out_with_previous, before)


# --------------------------------------------------------------------------- YAML files


def _dep(tmp_path: Path, body: str | bytes) -> Path:
    dep = tmp_path / "dep.yaml"
    if isinstance(body, bytes):
        dep.write_bytes(body)
    else:
        dep.write_text(body)
    return dep


def test_yaml_alias_bomb_is_refused_at_once(cli: Callable[..., Result], tmp_path: Path) -> None:
    lines = ["profile: cpu", "model: tiny-dense", 'a0: &a0 ["x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    r = cli("explain", "-d", str(_dep(tmp_path, "\n".join(lines) + "\n")))
    assert r.rc == 2 and "aliases" in r.err and "dep.yaml:4:" in r.err


def test_duplicate_yaml_keys_are_refused(cli: Callable[..., Result], tmp_path: Path) -> None:
    dep = _dep(tmp_path, "profile: cpu\nmodel: tiny-dense\nsettings:\n  port: 8001\n  port: 8002\n")
    r = cli("explain", "-d", str(dep))
    assert r.rc == 2 and "duplicate key 'port'" in r.err and "dep.yaml:5:" in r.err


@pytest.mark.parametrize("kind", ["binary", "latin-1", "folder"])
def test_deployment_that_is_not_a_yaml_file(
    cli: Callable[..., Result], tmp_path: Path, kind: str
) -> None:
    if kind == "folder":
        path = tmp_path
    else:
        path = _dep(tmp_path, b"\x00\x01\x02\xff" if kind == "binary" else b"profile: caf\xe9\n")
    r = cli("explain", "-d", str(path))
    assert r.rc == 2 and str(path) in r.err and "fix:" in r.err


def test_model_make_with_a_missing_python(cli: Callable[..., Result], tmp_path: Path) -> None:
    r = cli("model", "make", "tiny-dense", str(tmp_path / "m"), "--python", "/nonexistent/python")
    assert r.rc == 2 and "--python" in r.err and "fix:" in r.err
