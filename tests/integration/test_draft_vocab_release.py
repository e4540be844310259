"""The SM75 plugin's draft vocabulary travels from the model preset into each release."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO, Result, require_tools, tree_digest
from tests.support.vllm_server import vllm_venv
from vfleet.config.profiles import load_model
from vfleet.engine.rules import DraftVocabBuild
from vfleet.paths import hostside_script
from vfleet.render.plan import Plan
from vfleet.render.plan import plan as deploy_plan

SHIPPED = REPO / "profiles" / "models" / "tiny-hybrid-mtp.draft-vocab.json"


def _render(cli: Callable[..., Result], out: Path, *args: str) -> Result:
    return cli("render", "-p", "cpu", "-m", "tiny-hybrid-mtp", "--out", str(out), *args)


def test_a_stack_with_the_plugin_ships_the_table_and_points_the_plugin_at_it(
    cli: Callable[..., Result], tmp_path: Path
) -> None:
    r = _render(cli, tmp_path / "out", "--base-dir", "/srv/vf")
    assert r.rc == 0, r.err
    assert (tmp_path / "out" / "draft-vocab.json").read_bytes() == SHIPPED.read_bytes()
    env = (tmp_path / "out" / "vllm.env").read_text()
    assert "VFLEET_SM75='auto'" in env
    assert "VFLEET_SM75_DRAFT_VOCAB='/srv/vf/instances/main/current/draft-vocab.json'" in env
    release = json.loads((tmp_path / "out" / "release.json").read_text())
    assert "draft-vocab.json" in json.dumps(release)  # hashed like every other file


def test_a_stack_without_the_plugin_gets_neither(
    cli: Callable[..., Result], tmp_path: Path
) -> None:
    r = _render(cli, tmp_path / "out", "--set", "stack=vllm-cpu-0.27.1")
    assert r.rc == 0, r.err
    assert not (tmp_path / "out" / "draft-vocab.json").exists()
    assert "VFLEET_SM75" not in (tmp_path / "out" / "vllm.env").read_text()


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda doc: {**doc, "token_ids": [5000]}, "token id 5000 is outside the vocabulary"),
        (
            lambda doc: {**doc, "vocab_size": 2048},
            "is for a vocabulary of 2048, the model has 1024",
        ),
    ],
)
def test_a_bad_table_stops_the_render_naming_preset_key_and_fix(
    cli: Callable[..., Result],
    profiles_copy: Path,
    tmp_path: Path,
    breakage: Callable[[dict[str, object]], dict[str, object]],
    message: str,
) -> None:
    table = profiles_copy / "models" / "tiny-hybrid-mtp.draft-vocab.json"
    table.write_text(json.dumps(breakage(json.loads(table.read_text()))))
    out = tmp_path / "out"
    out.mkdir()
    before = tree_digest(out)
    r = _render(cli, out, "--profiles-dir", str(profiles_copy))
    assert r.rc == 2
    assert message in r.err
    assert f"{profiles_copy / 'models' / 'tiny-hybrid-mtp.yaml'}" in r.err
    assert "draft_vocab" in r.err and "vocab build" in r.err
    assert tree_digest(out) == before  # nothing written


def test_a_missing_table_is_named(
    cli: Callable[..., Result], profiles_copy: Path, tmp_path: Path
) -> None:
    (profiles_copy / "models" / "tiny-hybrid-mtp.draft-vocab.json").unlink()
    r = _render(cli, tmp_path / "out", "--profiles-dir", str(profiles_copy))
    assert r.rc == 2
    assert "tiny-hybrid-mtp.draft-vocab.json: cannot read the draft vocabulary" in r.err


# ------------------------------------------------------------------------------------------
# built on the host: the role's task (tasks/draft_vocab.yml) runs the plugin's real builder


VENV32 = vllm_venv()


def _host(tmp_path: Path) -> tuple[Path, Path]:
    """A host's base dir with the tiny model generated as the role generates it, and the
    stack's venv. The venv is the one stand-in: the pinned vllm-cpu venv (its tokenizers) with
    the plugin's source on the path, where a deploy pip-installs the plugin's wheel."""
    python = VENV32 / "bin" / "python"
    if not python.exists():
        if require_tools():
            pytest.fail(f"{python} missing: run `make tools`")
        pytest.skip(f"{python} missing (make tools)")
    base = tmp_path / "vf"
    model = base / "models" / "tiny-hybrid-mtp"
    arch = tmp_path / "arch.json"
    arch.write_text(json.dumps(load_model("tiny-hybrid-mtp").arch.model_dump()))
    argv = [str(python), str(hostside_script("tinymodels")), "tiny-hybrid-mtp"]
    subprocess.run([*argv, str(model), "--arch-json", str(arch)], check=True, capture_output=True)
    venv_bin = base / "venvs" / VENV32.name / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(
        f'#!/bin/sh\nPYTHONPATH={REPO / "plugin" / "src"} exec {python} "$@"\n'
    )
    (venv_bin / "python").chmod(0o755)
    return base, model


def _role_task(tmp_path: Path, plan: Plan) -> str:
    """tasks/draft_vocab.yml of the real role, run by ansible-playbook against this machine."""
    (tmp_path / "plan.json").write_text(
        json.dumps({"_vfleet_plan": plan.as_dict(), "_vfleet_pm": "pm2"})
    )
    (tmp_path / "play.yml").write_text(
        "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
        "    - ansible.builtin.include_role: {name: vfleet, tasks_from: draft_vocab}\n"
    )
    r = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            "-i",
            "localhost,",
            "-e",
            f"@{tmp_path / 'plan.json'}",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            str(tmp_path / "play.yml"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "ANSIBLE_ROLES_PATH": str(REPO / "ansible" / "roles")},
        timeout=600,
        check=False,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return r.stdout


def _recap(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("localhost "))


@pytest.mark.vllm
def test_the_deploy_builds_the_table_from_the_models_tokenizer_and_the_default_corpus(
    profiles_copy: Path, tmp_path: Path
) -> None:
    """A preset without a table of its own (as the Qwen presets): the plan asks for one built on
    the host from the plugin's default corpus, and VFLEET_SM75_DRAFT_VOCAB names it."""
    from vfleet_sm75 import draft_vocab

    preset = profiles_copy / "models" / "tiny-hybrid-mtp.yaml"
    preset.write_text(
        "\n".join(ln for ln in preset.read_text().splitlines() if "draft_vocab:" not in ln)
    )
    base, model = _host(tmp_path)
    p = deploy_plan("cpu", "tiny-hybrid-mtp", base_dir=str(base), profiles_dir=str(profiles_copy))
    out = f"{base}/instances/main/state/draft-vocab.json"
    assert p.model.draft_vocab_build == DraftVocabBuild(out=out, corpus=None, top=512)
    env = p.file("vllm.env")
    assert f"VFLEET_SM75_DRAFT_VOCAB='{out}'" in env
    assert "changed=1" in _recap(_role_task(tmp_path, p))
    table = draft_vocab.load(out)  # the plugin's own reader, as at vLLM start
    assert len(table.token_ids) == 512 and table.vocab_size == 1024
    assert table.tokenizer_sha256 == draft_vocab.file_sha256(model / "tokenizer.json")
    (used,) = table.source["corpus"]
    assert used["file"] == "draft-corpus.txt"
    assert used["sha256"] == draft_vocab.file_sha256(draft_vocab.DEFAULT_CORPUS)
    assert used["tokens"] > 1000
    # A redeploy with the same tokenizer, corpus and K leaves it alone.
    assert "changed=0" in _recap(_role_task(tmp_path, p))


@pytest.mark.vllm
def test_the_operators_corpus_builds_the_table_and_a_new_corpus_rebuilds_it(
    tmp_path: Path,
) -> None:
    from vfleet_sm75 import draft_vocab

    base, _ = _host(tmp_path)
    corpus = tmp_path / "answers.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog.\n" * 20, encoding="utf-8")
    sets = [f"draft_vocab_corpus={corpus}", "draft_vocab_top=64"]
    p = deploy_plan("cpu", "tiny-hybrid-mtp", base_dir=str(base), sets=sets)
    out = f"{base}/instances/main/state/draft-vocab.json"
    assert p.model.draft_vocab_build == DraftVocabBuild(out=out, corpus=str(corpus), top=64)
    assert "changed=1" in _recap(_role_task(tmp_path, p))
    first = draft_vocab.load(out)
    assert len(first.token_ids) == 64 and first.source["corpus"][0]["file"] == "answers.txt"
    assert first.source["coverage_all"] == 1.0  # every token of the corpus is in the table
    assert "changed=0" in _recap(_role_task(tmp_path, p))
    corpus.write_text("今天天气很好，我们去公园散步吧。\n" * 20, encoding="utf-8")
    assert "changed=1" in _recap(_role_task(tmp_path, p))
    assert draft_vocab.load(out).token_ids != first.token_ids


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["draft_vocab_top=2048"], "draft_vocab_top sets K of a table built on the host"),
        (
            ["draft_vocab_corpus=/srv/c.txt", "draft_vocab_top=2048"],
            "draft_vocab_top 2048 must be below the model's vocabulary (1024)",
        ),
        (
            ["stack=vllm-cpu-0.27.1", "draft_vocab_corpus=/srv/c.txt"],
            "draft_vocab_corpus: stack vllm-cpu-0.27.1 does not carry the SM75 plugin",
        ),
    ],
)
def test_draft_vocab_settings_that_cannot_apply_are_refused(
    cli: Callable[..., Result], tmp_path: Path, sets: list[str], message: str
) -> None:
    args = [a for s in sets for a in ("--set", s)]
    r = _render(cli, tmp_path / "out", *args)
    assert r.rc == 2 and message in r.err
    assert not (tmp_path / "out").exists()


def test_the_operators_prebuilt_table_is_named_as_is(
    cli: Callable[..., Result], tmp_path: Path
) -> None:
    r = _render(cli, tmp_path / "out", "--set", "draft_vocab_file=/srv/tables/qwen.json")
    assert r.rc == 0, r.err
    env = (tmp_path / "out" / "vllm.env").read_text()
    assert "VFLEET_SM75_DRAFT_VOCAB='/srv/tables/qwen.json'" in env
