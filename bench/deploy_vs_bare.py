"""Deploy-to-ready with vfleet vs a bare vLLM start of the same model, side by side.

    .venv/bin/python bench/deploy_vs_bare.py --base-dir /var/tmp/vfleet-bench --rounds 2

Needs a previous `make deploy BASE_DIR=<base-dir>` (the venv and the tiny model exist; this
measures starting, not installing). Alternates the two methods so both see the same machine
load, on loopback ports only, and stops every server it starts.

- vfleet: `make deploy` wall time until it returns (preflight, render, release, pm2 start,
  probe: live, model listed, a real completion, warmup set).
- bare:  `python -m <vLLM server module> --config <the same rendered vllm.yaml>` with the same
  env file, timed until /health answers 200 and one chat completion succeeded.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make(base: Path, *args: str) -> float:
    t0 = time.monotonic()
    r = subprocess.run(
        ["make", "--no-print-directory", *args, f"BASE_DIR={base}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        sys.exit(f"make {' '.join(args)} failed:\n{r.stdout[-3000:]}")
    return time.monotonic() - t0


def ready(port: int, model: str, deadline: float) -> bool:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        time.sleep(0.5)
    else:
        return False
    body = json.dumps(
        {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Say OK."}]}
    ).encode()
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status == 200


def bare(base: Path, port: int) -> float:
    release = base / "instances" / "main" / "current"
    cfg = (release / "vllm.yaml").read_text()
    tmp = base / "bench-bare.yaml"
    lines = [ln for ln in cfg.splitlines() if not ln.startswith("port:")]
    tmp.write_text("\n".join([*lines, f"port: {port}", ""]))
    env = dict(os.environ)
    for line in (release / "vllm.env").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            k, v = line.split("=", 1)
            env[k] = v.strip("'")
    launch = (release / "launch.sh").read_text()
    python, module = launch.split("exec ", 1)[1].split(" --config")[0].split(" -m ")
    model = json.loads((release / "probe.json").read_text())["served_model_name"]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [python, "-m", module, "--config", str(tmp)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        if not ready(port, model, t0 + 600):
            sys.exit("bare vLLM did not become ready in 600 s")
        return time.monotonic() - t0
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        tmp.unlink(missing_ok=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--base-dir", type=Path, default=Path("/var/tmp/vfleet-bench"))
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    base = a.base_dir.resolve()
    port = free_port()
    deploy_s: list[float] = []
    bare_s: list[float] = []
    for i in range(a.rounds):
        make(base, "stop")
        deploy_s.append(make(base, "deploy", f"SET=port={port}"))
        make(base, "stop")
        bare_s.append(bare(base, free_port()))
        print(
            f"round {i + 1}: vfleet deploy-to-ready {deploy_s[-1]:.1f} s, "
            f"bare vLLM start-to-first-completion {bare_s[-1]:.1f} s",
            flush=True,
        )
    d, b = statistics.median(deploy_s), statistics.median(bare_s)
    print(
        json.dumps(
            {
                "vfleet_deploy_s": deploy_s,
                "bare_start_s": bare_s,
                "median_vfleet_s": round(d, 1),
                "median_bare_s": round(b, 1),
                "ratio": round(d / b, 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
