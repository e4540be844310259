"""The warmup set is derived from the rendered configuration (src/vfleet/engine/warmup.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vfleet_healthcheck import probe
from vfleet_healthcheck.probe import warmup_prompt

from tests.conftest import PROFILES
from vfleet.engine.compile import resolve
from vfleet.engine.warmup import SAMPLING, warmup_plan
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


def test_sampled_requests_reach_the_samplers_other_path() -> None:
    """Greedy requests never compile the sampler's top-k/top-p path nor rejection sampling's
    random path: a sampled request alone, and beside a greedy one where two sequences run."""
    steps = warmup_plan(resolve("cpu", "tiny-hybrid-mtp"))["steps"]
    sampled = [s for s in steps if s.get("sampled")]
    assert [(s["concurrency"], s["sampled"]) for s in sampled] == [(1, 1), (4, 3)]  # 4 seqs
    assert all(s["sampling"] == SAMPLING and s["max_tokens"] > 1 for s in sampled)
    one_seq = warmup_plan(
        resolve(None, None, deployment=PROFILES / "deployments" / "seed-001-a100-pm2.yaml")
    )
    assert [s["concurrency"] for s in one_seq["steps"] if s.get("sampled")] == [1]


def test_the_probe_sends_what_each_step_asks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The bodies the probe composes, captured before they leave (a real vLLM takes them in the
    # CPU deploy tests, whose readiness runs this warmup).
    bodies: list[dict[str, Any]] = []

    def answer(
        t: probe.Target, path: str, body: Any = None, timeout: Any = None
    ) -> tuple[int, bytes]:
        if path == "/v1/chat/completions":
            bodies.append(body)
            return 200, json.dumps({"usage": {"completion_tokens": 1}}).encode()
        return 404, b""

    monkeypatch.setattr(probe, "_request", answer)
    steps = [
        {"concurrency": 2, "prompt_tokens": 8, "max_tokens": 4, "sampled": 1, "sampling": SAMPLING}
    ]
    t = probe.Target("http://127.0.0.1:1", "m", warmup_steps=steps, state_dir=tmp_path)
    assert probe.run_warmup(t, progress=False)[0]
    temps = sorted((b["temperature"], b.get("top_k")) for b in bodies)
    assert temps == [(0, None), (SAMPLING["temperature"], SAMPLING["top_k"])]
    for bad in ({"temperature": "hot"}, {"seed": 1}, {"top_k": True}):
        t.warmup_steps = [{**steps[0], "sampling": bad}]
        with pytest.raises(probe.ProbeError, match="warmup step sampling"):
            probe.run_warmup(t, progress=False)
