"""The warmup set is derived from the rendered configuration (src/vfleet/engine/warmup.py)."""

from __future__ import annotations

import json

import pytest
from vfleet_healthcheck.probe import warmup_prompt

from tests.conftest import PROFILES
from vfleet.engine.compile import resolve
from vfleet.engine.warmup import warmup_plan
from vfleet.render.release import render_files, unit_name


@pytest.mark.parametrize(
    ("profile", "model", "deployment", "sets"),
    [
        ("cpu", "tiny-hybrid-mtp", None, []),
        ("cpu", "tiny-dense", None, ["max_num_seqs=6", "max_num_batched_tokens=1000"]),
        (None, None, "seed-001-a100-pm2.yaml", []),
        (None, None, "seed-004-4x2080ti-turbo3.yaml", []),
    ],
)
def test_plan_covers_batch_sizes_prefill_chunks_and_a_decode(
    profile: str | None, model: str | None, deployment: str | None, sets: list[str]
) -> None:
    launch = resolve(
        profile,
        model,
        deployment=PROFILES / "deployments" / deployment if deployment else None,
        sets=sets,
    )
    d = launch.decisions
    steps = warmup_plan(launch)["steps"]
    widths = [s["concurrency"] for s in steps if s["max_tokens"] > 1 and s["concurrency"] > 1]
    # every power of two below max_num_seqs, and max_num_seqs itself
    seqs = d.max_num_seqs
    assert max(s["concurrency"] for s in steps) == seqs
    assert all(w & (w - 1) == 0 or w == seqs for w in widths)
    prefills = [s["prompt_tokens"] for s in steps if s["max_tokens"] == 1]
    chunk = d.max_num_batched_tokens or 8192
    assert prefills and max(prefills) <= chunk and prefills == sorted(prefills)
    for s in steps:
        assert s["prompt_tokens"] + s["max_tokens"] <= d.max_model_len
        assert s["why"]
    assert steps[-1]["max_tokens"] >= 128  # the long-ish decode
    k = d.spec_k
    assert f"{seqs * (1 + k)} tokens per step" in " ".join(s["why"] for s in steps)


def test_probe_json_carries_the_plan_and_the_unit_waits_for_it() -> None:
    files = {f.name: f.content for f in render_files(resolve("cpu", "tiny-hybrid-mtp"))}
    probe = json.loads(files["probe.json"])
    assert probe["warmup"]["steps"] == warmup_plan(resolve("cpu", "tiny-hybrid-mtp"))["steps"]
    assert "--warmup" in files[unit_name("main")].split("ExecStartPost=")[1].splitlines()[0]


def test_warmup_prompts_are_unique_and_sized() -> None:
    a, b = warmup_prompt(512, 10.0, 1), warmup_prompt(512, 10.0, 2)
    assert a != b  # new to the prefix cache each time
    assert a.count("fox") == 51


def test_plan_is_deterministic() -> None:
    # Same inputs, same probe.json: a redeploy changes nothing.
    one = render_files(resolve("cpu", "tiny-dense"))
    two = render_files(resolve("cpu", "tiny-dense"))
    assert [f.content for f in one] == [f.content for f in two]
