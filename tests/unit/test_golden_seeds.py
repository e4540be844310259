"""Every flag and env var of each seed's tested command line is reproduced, or listed as an
intentional difference (here and in docs/SEEDS.md) with its reason; and every flag vfleet renders
beyond the seed's is either behaviour-neutral (NEUTRAL below) or listed as an addition with its
reason, so that a rule stricter or looser than the seed cannot hide."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO
from vfleet.engine.compile import resolve

# Flags vfleet renders that the seeds did not pass but that leave vLLM doing what the seed's
# vLLM did (naming, where to listen, logging, shutdown, a default spelled out).
NEUTRAL = {
    "model": "the seed's positional model path, at vfleet's model folder",
    "served-model-name": "the API's model name",
    "host": "where the API listens",
    "port": "where the API listens",
    "disable-uvicorn-access-log": "access logging only",
    "enable-prompt-tokens-details": "usage reporting only (cached prompt tokens)",
    "shutdown-timeout": "SIGTERM only: drain in-flight requests",
    "enable-chunked-prefill": "vLLM's default for decoder models (is_chunked_prefill_supported)",
    "tensor-parallel-size": "spelled out where the seed relied on the default of 1",
}

GOLDEN = yaml.safe_load((REPO / "tests" / "golden" / "seeds.yaml").read_text())
DOC = (REPO / "docs" / "SEEDS.md").read_text()


def _subset(want: Any, got: Any) -> bool:
    """Seed values may be a subset of what vfleet renders for nested configs."""
    if isinstance(want, dict) and isinstance(got, dict):
        return all(k in got and _subset(v, got[k]) for k, v in want.items())
    if isinstance(want, float | int) and isinstance(got, float | int):
        return float(want) == float(got)
    return bool(str(want) == str(got))


@pytest.mark.parametrize("seed", sorted(GOLDEN))
def test_seed_command_line_is_reproduced(seed: str) -> None:
    g = GOLDEN[seed]
    launch = resolve("", "", deployment=REPO / "profiles" / "deployments" / f"{seed}.yaml")
    args = launch.config_values()
    env = {e.key: e.value for e in launch.env}
    diffs: dict[str, str] = g["differences"] or {}
    missing = []
    for flag, want in g["flags"].items():
        if flag in diffs:
            continue
        if flag not in args or not _subset(want, args[flag]):
            missing.append(f"--{flag}: seed {want!r}, vfleet {args.get(flag)!r}")
    for key, want in g["env"].items():
        if key in diffs:
            continue
        if env.get(key) != str(want):
            missing.append(f"{key}: seed {want!r}, vfleet {env.get(key)!r}")
    assert not missing, "\n".join(missing)
    # A listed difference must really be a difference (no stale entries).
    for key in diffs:
        in_flags = key in g["flags"]
        if in_flags:
            assert not (key in args and _subset(g["flags"][key], args[key])), (
                f"{key} is not different"
            )
        else:
            assert env.get(key) != str(g["env"][key]), f"{key} is not different"


@pytest.mark.parametrize("seed", sorted(GOLDEN))
def test_every_added_flag_is_accounted_for(seed: str) -> None:
    g = GOLDEN[seed]
    launch = resolve("", "", deployment=REPO / "profiles" / "deployments" / f"{seed}.yaml")
    args = launch.config_values()
    added: dict[str, str] = g["added"] or {}
    extra = {k for k in args if k not in g["flags"]}
    unaccounted = sorted(extra - set(NEUTRAL) - set(added))
    assert not unaccounted, f"rendered beyond the seed, neither neutral nor listed: {unaccounted}"
    stale = sorted(set(added) - extra)
    assert not stale, f"listed as added but not rendered (or now the seed's own): {stale}"


@pytest.mark.parametrize("seed", sorted(GOLDEN))
def test_differences_are_documented(seed: str) -> None:
    section = DOC.split(f"## {seed}")[1].split("\n## ")[0] if f"## {seed}" in DOC else ""
    assert section, f"docs/SEEDS.md has no section for {seed}"
    for key in [*(GOLDEN[seed]["differences"] or {}), *(GOLDEN[seed]["added"] or {})]:
        assert f"`{key}`" in section, f"docs/SEEDS.md ({seed}) does not list {key}"


def test_every_seed_deployment_has_golden_data() -> None:
    deployments = {p.stem for p in (REPO / "profiles" / "deployments").glob("seed-*.yaml")}
    assert deployments == set(GOLDEN)


def test_golden_file_is_valid_yaml_mapping() -> None:
    for seed, g in GOLDEN.items():
        assert set(g) == {"flags", "env", "differences", "added"}, seed
        assert Path(REPO / "profiles" / "deployments" / f"{seed}.yaml").is_file()
