#!/usr/bin/env python3
"""Model switch on one GPU: two resident vLLM engines, sleep one, wake the other, under load.

Issue 32's GPU measurement (docs/GPU.md, section 8). Two of vfleet's rendered releases share one
GPU: engine A (default: tiny-hybrid-mtp, port 8001) and engine B (mid-hybrid-mtp, port 8002),
each with sleep mode on (the lane's ``sleep`` settings: --enable-sleep-mode,
VLLM_SERVER_DEV_MODE=1, bf16 KV) and a gpu-memory-utilization that lets B start beside an
active A (default 0.45 each). Both use the same instance caches (one cache folder), so the second
start reuses what the first compiled where the two models share kernels.

  up      build the models (no downloads), render both, start A, warm it (first request, then
          the greedy prompts: the reference texts and MTP acceptance before any sleep), start B
          beside it, warm it the same way, put B to sleep (level 1). The servers run in their
          own sessions and outlive the command; the state goes to BASE/switch-state.json.
  switch  the switches, each under a bounded load of --streams concurrent streamed requests
          (--max-tokens each): the load runs on the active engine for --pre-s, then the switch:
          the client's target becomes the other engine's port (there is no nginx on the GPU
          machine: the client switches its target at the switch moment; the queueing is
          vLLM's: a sleeping engine queues new requests and its wake flushes them,
          v1/engine/core.py pause_scheduler / wake_up), the active engine gets
          ``POST /sleep?level=L&mode=wait`` (its in-flight requests finish first), then the
          sleeper is woken (level 1: ``/wake_up``; level 2: ``/wake_up?tags=weights``,
          ``/collective_rpc reload_weights``, [the drafter reload], ``/wake_up?tags=kv_cache``);
          the load goes on for --post-s on the new engine. Per switch: time from the switch's
          start to the first token of the new engine's model, every request's outcome (failed:
          an HTTP error, no token, a finish other than length/stop, or no answer within
          --request-timeout-s), the sleeper's GPU memory per process (nvidia-smi) and host RSS,
          and the woken engine's MTP acceptance (``/metrics`` deltas over the greedy prompts)
          against its acceptance before any sleep. Sequence: A->B level 1, B->A level 1,
          A->B level 2 (A sleeps at level 2), B->A level 2 (A's level 2 wake with
          reload_weights only: acceptance; then ``vfleet_reload_drafter`` on A: acceptance
          again), A->B level 2 with the drafter reload inside B's wake. Then, side by side, a
          full restart of A (stop, start, /health, first token).
  down    stop both servers (their process groups).
  report  RESULT.json -> the markdown table (no GPU needed).

The drafter reload is bench/switch_ext.py, loaded as vLLM's worker extension
(``--worker-extension-cls``, not part of the compile hash). Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_lane as lane

REPO = lane.REPO
EXT = "switch_ext.DrafterReload"
STATE = "switch-state.json"


@dataclass
class Engine:
    """One resident vLLM server: its release, port and process group."""

    name: str
    model: str
    port: int
    release: str
    pgid: int = 0
    level: int = 0  # 0 awake, else the level it sleeps at
    log: str = ""


# --------------------------------------------------------------------------- HTTP helpers


def post(
    port: int, path: str, body: dict[str, Any] | None = None, timeout: float = 300
) -> dict[str, Any]:
    t0 = time.perf_counter()
    status, raw = lane.http(path, body if body is not None else {}, timeout=timeout, port=port)
    out: dict[str, Any] = {"path": path, "status": status, "s": round(time.perf_counter() - t0, 3)}
    if status != 200:
        out["error"] = raw[:300].decode("utf-8", "replace")
    else:
        txt = raw[:2000].decode("utf-8", "replace").strip()
        if txt:
            out["body"] = txt
    return out


def stream_chat(
    port: int, model: str, prompt: str, max_tokens: int, timeout: float, t_ref: float
) -> dict[str, Any]:
    """One streamed chat request; times relative to t_ref (perf_counter)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"port": port, "t0": round(t0 - t_ref, 4), "ok": False}
    first: float | None = None
    finish = None
    tokens = None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            rec["status"] = int(resp.status)
            for line in resp:
                if not line.startswith(b"data: ") or b"[DONE]" in line:
                    continue
                msg = json.loads(line[6:])
                if msg.get("error"):
                    rec["error"] = str(msg["error"])[:300]
                for ch in msg.get("choices") or []:
                    delta = ch.get("delta") or {}
                    text = (
                        delta.get("content")
                        or delta.get("reasoning_content")
                        or delta.get("reasoning")
                    )
                    if text and first is None:
                        first = time.perf_counter()
                    if ch.get("finish_reason"):
                        finish = ch["finish_reason"]
                if msg.get("usage"):
                    tokens = msg["usage"].get("completion_tokens")
    except urllib.error.HTTPError as exc:
        rec["status"] = exc.code
        rec["error"] = (exc.read() if exc.fp else b"")[:300].decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    end = time.perf_counter()
    rec["t_first"] = round(first - t_ref, 4) if first is not None else None
    rec["t_end"] = round(end - t_ref, 4)
    rec["finish"] = finish
    rec["tokens"] = tokens
    rec["ok"] = first is not None and finish in ("length", "stop") and "error" not in rec
    return rec


class Load:
    """`streams` threads, each sending one streamed request after another to the current
    target; bounded by `max_requests` and by stop()."""

    def __init__(
        self, streams: int, max_tokens: int, timeout: float, max_requests: int, t_ref: float
    ) -> None:
        self.streams, self.max_tokens, self.timeout = streams, max_tokens, timeout
        self.max_requests, self.t_ref = max_requests, t_ref
        self.target: tuple[int, str] = (0, "")
        self.lock = threading.Lock()
        self.stop_ev = threading.Event()
        self.records: list[dict[str, Any]] = []
        self.inflight: dict[int, dict[str, Any]] = {}
        self.started = 0
        self.threads: list[threading.Thread] = []

    def set_target(self, port: int, model: str) -> None:
        with self.lock:
            self.target = (port, model)

    def _worker(self, i: int) -> None:
        n = 0
        while not self.stop_ev.is_set():
            with self.lock:
                if self.started >= self.max_requests:
                    return
                self.started += 1
                port, model = self.target
                self.inflight[i] = {"port": port, "t0": round(time.perf_counter() - self.t_ref, 4)}
            rec = stream_chat(
                port,
                model,
                f"[load {i}.{n}] Tell me about the quick brown fox.",
                self.max_tokens,
                self.timeout,
                self.t_ref,
            )
            rec["stream"] = i
            with self.lock:
                self.records.append(rec)
                self.inflight.pop(i, None)
            n += 1

    def start(self) -> None:
        for i in range(self.streams):
            t = threading.Thread(target=self._worker, args=(i,), daemon=True)
            t.start()
            self.threads.append(t)

    def stop(self, join_s: float) -> list[dict[str, Any]]:
        """Stop issuing; wait up to join_s for the requests in flight; return the ones still
        unanswered then (stuck)."""
        self.stop_ev.set()
        deadline = time.monotonic() + join_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self.lock:
            return list(self.inflight.values())


# --------------------------------------------------------------------------- process facts


def pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def group_pids(pgid: int) -> list[int]:
    pids = []
    for d in os.listdir("/proc"):
        if d.isdigit() and pgid_of(int(d)) == pgid:
            pids.append(int(d))
    return pids


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


def gpu_apps() -> dict[int, int]:
    """nvidia-smi's compute processes: pid -> used MiB."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    apps: dict[int, int] = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            apps[int(parts[0])] = int(parts[1])
    return apps


def asleep(port: int, timeout: float = 5.0) -> bool | None:
    """vLLM's /is_sleeping on loopback (sleep mode's development route); None: no answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/is_sleeping", timeout=timeout) as r:
            return bool(json.loads(r.read())["is_sleeping"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def memory(engines: list[Engine]) -> dict[str, Any]:
    """GPU MiB (nvidia-smi, per process of each engine's group) and host RSS MiB per engine,
    and whether it sleeps as the reading is taken (`level` is the level it sleeps at when it
    does, not its state: a reader of section 14's raw files took it for the state)."""
    apps = gpu_apps()
    out: dict[str, Any] = {"gpu_used_total_mib": lane.gpu_used_mib(), "apps": apps}
    for e in engines:
        pids = group_pids(e.pgid) if e.pgid else []
        out[e.name] = {
            "level": e.level,
            "asleep": asleep(e.port),
            "gpu_mib": sum(apps.get(p, 0) for p in pids),
            "gpu_pids": {str(p): apps[p] for p in pids if p in apps},
            "rss_mib": round(sum(rss_mib(p) for p in pids), 1),
            "rss_by_pid": {str(p): rss_mib(p) for p in pids},
        }
    return out


# --------------------------------------------------------------------------- engines


def host_for(a: argparse.Namespace, model: str) -> lane.Host:
    ns = argparse.Namespace(**vars(a))
    ns.model = model
    ns.model_dir = str(Path(a.models_dir).expanduser() / model)
    ns.sets = []
    ns.repeats = 1
    return lane.make_host(ns)


def render(host: lane.Host, e: Engine, util: float) -> Path:
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.config.schema import HostVars
    from vfleet.engine.compile import resolve
    from vfleet.render.release import render_files, write_atomic

    sets = [
        *lane.BASE_SETS,
        *lane.SLEEP_SETS,
        f"port={e.port}",
        f"gpu_memory_utilization={util}",
        f"extra_args.worker-extension-cls={EXT}",
    ]
    launch = resolve(
        host.profile,
        e.model,
        sets=sets,
        host=HostVars(base_dir=str(host.base), cuda_home=host.cuda_home),
    )
    inst = host.base / "instances" / "main"
    rel = inst / "releases" / f"switch-{e.name}"
    write_atomic(render_files(launch), rel)
    (inst / "home").mkdir(parents=True, exist_ok=True)
    return rel


def start(e: Engine, logdir: Path) -> None:
    log = logdir / f"engine-{e.name}.log"
    e.log = str(log)
    with log.open("ab") as fh:
        proc = subprocess.Popen(
            ["sh", str(Path(e.release) / "launch.sh")],
            stdout=fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    e.pgid = proc.pid
    e.level = 0


def healthy(e: Engine) -> bool:
    return lane.http("/health", timeout=5, port=e.port)[0] == 200


def wait_ready(e: Engine, timeout: float) -> float | None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if e.pgid and not group_pids(e.pgid):
            return None
        if healthy(e):
            return round(time.monotonic() - t0, 2)
        time.sleep(0.5)
    return None


def stop(e: Engine) -> None:
    if not e.pgid:
        return
    try:
        os.killpg(e.pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(60):
        if not group_pids(e.pgid):
            return
        time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(e.pgid, signal.SIGKILL)
    time.sleep(2)


PROMPTS = lane.GREEDY_PROMPTS


def probe(e: Engine) -> dict[str, Any]:
    """The greedy prompts (96 tokens each, one at a time): texts and MTP acceptance from the
    /metrics counter deltas."""
    before = lane.counter_sums(lane.scrape(e.port))
    t0 = time.monotonic()
    texts: list[Any] = []
    for p in PROMPTS:
        body = {
            "model": e.model,
            "messages": [{"role": "user", "content": p}],
            "max_tokens": 96,
            "temperature": 0,
        }
        status, raw = lane.http("/v1/chat/completions", body, timeout=120, port=e.port)
        if status != 200:
            texts.append({"error": status, "body": raw[:200].decode("utf-8", "replace")})
            continue
        msg = json.loads(raw)["choices"][0]["message"]
        texts.append([msg.get("reasoning_content") or msg.get("reasoning"), msg.get("content")])
    delta = lane.spec_delta(before, lane.counter_sums(lane.scrape(e.port)), time.monotonic() - t0)
    return {
        "texts": texts,
        "acceptance": delta.acceptance,
        "mean_acceptance_length": delta.mean_acceptance_length,
        "draft_tokens": delta.draft_tokens,
        "accepted": delta.accepted,
        "per_position": delta.per_position,
        "seconds": delta.seconds,
    }


def first_request(e: Engine) -> dict[str, Any]:
    t = time.perf_counter()
    return stream_chat(e.port, e.model, "[first] " + PROMPTS[1], 32, 300, t)


def save_state(base: Path, engines: list[Engine], extra: dict[str, Any]) -> None:
    data = {"engines": [asdict(e) for e in engines], **extra}
    (base / STATE).write_text(json.dumps(data, indent=1), encoding="utf-8")


def load_state(base: Path) -> tuple[list[Engine], dict[str, Any]]:
    data = json.loads((base / STATE).read_text(encoding="utf-8"))
    engines = [Engine(**e) for e in data.pop("engines")]
    return engines, data


def write(out: Path, name: str, result: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(result, indent=1), encoding="utf-8")


# --------------------------------------------------------------------------- up


def cmd_up(a: argparse.Namespace) -> int:
    out = Path(a.out)
    base = Path(a.base_dir).expanduser()
    base.mkdir(parents=True, exist_ok=True)
    logdir = base / "logs"
    logdir.mkdir(exist_ok=True)
    result: dict[str, Any] = {"step": "up", "util": a.util, "phases": {}}
    t_all = time.monotonic()
    # The mid model builds (CPU, ~45 s on 16 cores) while A starts.
    pool = ThreadPoolExecutor(1)
    fut_b = pool.submit(host_for, a, a.model_b)
    host_a = host_for(a, a.model_a)
    result["machine"] = lane.machine_facts(a.python, host_a.env())
    eng_a = Engine("a", a.model_a, a.port_a, "")
    eng_a.release = str(render(host_a, eng_a, a.util))
    eng_b = Engine("b", a.model_b, a.port_b, "")
    engines = [eng_a, eng_b]
    # A second `up` (the first ran out of its call's time) keeps a server that is up.
    before: dict[str, Engine] = {}
    if (base / STATE).exists():
        before = {e.name: e for e in load_state(base)[0]}
    for e in engines:
        if e.name == "b":
            host_b = fut_b.result()
            e.release = str(render(host_b, e, a.util))
        ph: dict[str, Any] = {}
        result["phases"][e.name] = ph
        t0 = time.monotonic()
        old = before.get(e.name)
        if old and old.pgid and group_pids(old.pgid) and healthy(e):
            e.pgid, e.log = old.pgid, old.log
            ph["resumed"] = "already up (an earlier `up`): its start is not timed here"
        else:
            start(e, logdir)
        save_state(base, engines, {})
        ph["ready_s"] = wait_ready(e, a.start_timeout)
        print(f"== {e.name} ({e.model}) ready {ph['ready_s']} s", flush=True)
        if ph["ready_s"] is None:
            ph["error"] = "no /health"
            write(out, "up.json", result)
            return 1
        ph["first_request"] = first_request(e)
        ph["start_to_first_token_s"] = round(time.monotonic() - t0, 2)
        ph["probe_before"] = probe(e)
        ph["memory_awake"] = memory(engines)
        print(
            f"   first request {ph['first_request'].get('t_first')} s, acceptance "
            f"{ph['probe_before']['acceptance']}",
            flush=True,
        )
        save_state(
            base,
            engines,
            {"refs": {x: result["phases"][x]["probe_before"]["texts"] for x in result["phases"]}},
        )
        write(out, "up.json", result)
    # B sleeps (level 1) beside the active A.
    result["b_sleep"] = post(eng_b.port, "/sleep?level=1")
    eng_b.level = 1
    time.sleep(1)
    result["memory_b_asleep_l1"] = memory(engines)
    refs = {x: result["phases"][x]["probe_before"]["texts"] for x in result["phases"]}
    acc = {x: result["phases"][x]["probe_before"]["acceptance"] for x in result["phases"]}
    save_state(base, engines, {"refs": refs, "acceptance_before": acc})
    result["seconds"] = round(time.monotonic() - t_all, 1)
    write(out, "up.json", result)
    print(f"up in {result['seconds']} s; B asleep: {json.dumps(result['memory_b_asleep_l1'])}")
    return 0


# --------------------------------------------------------------------------- switch


def wake(e: Engine, drafter: bool) -> list[dict[str, Any]]:
    if e.level == 2:
        steps = [post(e.port, "/wake_up?tags=weights")]
        steps.append(post(e.port, "/collective_rpc", {"method": "reload_weights"}))
        if drafter:
            steps.append(post(e.port, "/collective_rpc", {"method": "vfleet_reload_drafter"}))
        steps.append(post(e.port, "/wake_up?tags=kv_cache"))
    else:
        steps = [post(e.port, "/wake_up")]
    e.level = 0
    return steps


def one_switch(
    a: argparse.Namespace,
    src: Engine,
    dst: Engine,
    level: int,
    drafter: bool,
    engines: list[Engine],
) -> dict[str, Any]:
    t_ref = time.perf_counter()
    load = Load(a.streams, a.max_tokens, a.request_timeout_s, a.max_requests, t_ref)
    load.set_target(src.port, src.model)
    rec: dict[str, Any] = {
        "from": src.name,
        "to": dst.name,
        "level": level,
        "dst_was_asleep_at": dst.level,
        "drafter_reload_in_wake": drafter and dst.level == 2,
    }
    load.start()
    time.sleep(a.pre_s)
    t_sw = time.perf_counter() - t_ref
    rec["t_switch"] = round(t_sw, 4)
    load.set_target(dst.port, dst.model)
    rec["sleep"] = post(src.port, f"/sleep?level={level}&mode=wait")
    src.level = level
    rec["t_sleep_done"] = round(time.perf_counter() - t_ref - t_sw, 4)
    rec["wake"] = wake(dst, drafter)
    rec["t_wake_done"] = round(time.perf_counter() - t_ref - t_sw, 4)
    # Keep the load on the new engine for post_s after its first token (or give up after 30 s).
    t_wait = time.monotonic()
    while time.monotonic() - t_wait < 30:
        with load.lock:
            got = any(r["port"] == dst.port and r.get("t_first") for r in load.records)
        if got:
            break
        time.sleep(0.05)
    time.sleep(a.post_s)
    stuck = load.stop(a.request_timeout_s)
    recs = sorted(load.records, key=lambda r: r["t0"])
    firsts = [r["t_first"] for r in recs if r["port"] == dst.port and r.get("t_first")]
    rec["to_first_token_s"] = round(min(firsts) - t_sw, 4) if firsts else None
    rec["requests"] = len(recs)
    rec["failed"] = [r for r in recs if not r["ok"]]
    rec["n_failed"] = len(rec["failed"]) + len(stuck)
    rec["stuck"] = stuck
    rec["drained_on_src"] = sum(
        1 for r in recs if r["port"] == src.port and r["t0"] < t_sw and r["t_end"] > t_sw
    )
    queued = [r for r in recs if r["port"] == dst.port and r["t0"] < t_sw + rec["t_wake_done"]]
    rec["queued_on_dst"] = len(queued)
    rec["queued_ttft_max_s"] = (
        round(max(r["t_first"] - r["t0"] for r in queued if r.get("t_first")), 4)
        if any(r.get("t_first") for r in queued)
        else None
    )
    rec["records"] = recs
    time.sleep(0.5)
    rec["memory"] = memory(engines)
    rec["probe_after"] = probe(dst)
    return rec


def cmd_switch(a: argparse.Namespace) -> int:
    out = Path(a.out)
    base = Path(a.base_dir).expanduser()
    engines, state = load_state(base)
    by = {e.name: e for e in engines}
    eng_a, eng_b = by["a"], by["b"]
    result: dict[str, Any] = {
        "step": "switch",
        "streams": a.streams,
        "max_tokens": a.max_tokens,
        "pre_s": a.pre_s,
        "post_s": a.post_s,
        "acceptance_before": state.get("acceptance_before"),
        "routing": "client-side: the load's target port switches at the switch's start (no nginx)",
        "switches": [],
    }
    refs: dict[str, Any] = state.get("refs", {})
    t_all = time.monotonic()
    plan = [
        (eng_a, eng_b, 1, False),
        (eng_b, eng_a, 1, False),
        (eng_a, eng_b, 2, False),
        (eng_b, eng_a, 2, False),
        (eng_a, eng_b, 2, True),
    ]
    for src, dst, level, drafter in plan:
        if a.budget_s and time.monotonic() - t_all > a.budget_s:
            result["switches"].append({"skipped": f"{src.name}->{dst.name} L{level}: --budget-s"})
            continue
        print(f"== {src.name} -> {dst.name}, level {level}, dst asleep at {dst.level}", flush=True)
        rec = one_switch(a, src, dst, level, drafter, engines)
        rec["greedy_same_as_before"] = rec["probe_after"]["texts"] == refs.get(dst.name)
        if level == 2 and rec["dst_was_asleep_at"] == 2 and not drafter:
            # The workaround on the same engine, side by side: reload the drafter, probe again.
            rec["drafter_reload_after"] = post(
                dst.port, "/collective_rpc", {"method": "vfleet_reload_drafter"}
            )
            rec["probe_after_drafter_reload"] = probe(dst)
            rec["greedy_same_after_drafter_reload"] = rec["probe_after_drafter_reload"][
                "texts"
            ] == refs.get(dst.name)
        result["switches"].append(rec)
        print(
            f"   first token of {dst.model} {rec['to_first_token_s']} s after the switch; "
            f"{rec['requests']} requests, {rec['n_failed']} failed; acceptance after "
            f"{rec['probe_after']['acceptance']}"
            + (
                f", after the drafter reload {rec['probe_after_drafter_reload']['acceptance']}"
                if "probe_after_drafter_reload" in rec
                else ""
            )
            + f"; sleeper {src.name}: GPU {rec['memory'][src.name]['gpu_mib']} MiB, RSS "
            f"{rec['memory'][src.name]['rss_mib']} MiB",
            flush=True,
        )
        write(out, "switch.json", result)
        save_state(base, engines, state)
        if rec["to_first_token_s"] is None:
            break
    if a.restart and not (a.budget_s and time.monotonic() - t_all > a.budget_s):
        # Side by side: a full restart of A (asleep now) with warm caches, to its first token.
        t0 = time.monotonic()
        stop(eng_a)
        stopped = round(time.monotonic() - t0, 2)
        start(eng_a, base / "logs")
        ready = wait_ready(eng_a, a.start_timeout)
        rs: dict[str, Any] = {"stop_s": stopped, "ready_s": ready}
        if ready is not None:
            rs["first_request"] = first_request(eng_a)
        rs["to_first_token_s"] = round(time.monotonic() - t0, 2)
        result["restart_a"] = rs
        save_state(base, engines, state)
        print(f"== restart of A: {rs['to_first_token_s']} s to the first token", flush=True)
    result["seconds"] = round(time.monotonic() - t_all, 1)
    write(out, "switch.json", result)
    print(report_md(result))
    return 0


def cmd_down(a: argparse.Namespace) -> int:
    base = Path(a.base_dir).expanduser()
    engines, _ = load_state(base)
    for e in engines:
        stop(e)
    return 0


# --------------------------------------------------------------------------- report


def _f(x: Any, nd: int = 2) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def report_md(result: dict[str, Any]) -> str:
    lines = [
        "| switch | level | woken from | first token of the new model s | sleep (drain) s | "
        "wake s | requests | failed | sleeper GPU MiB | sleeper RSS MiB | acceptance after "
        "| greedy same |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in result.get("switches", []):
        if "skipped" in s:
            lines.append(f"| {s['skipped']} | | | | | | | | | | | |")
            continue
        mem = s["memory"][s["from"]]
        woken = f"L{s['dst_was_asleep_at']}" + (" + drafter" if s["drafter_reload_in_wake"] else "")
        acc = _f(s["probe_after"]["acceptance"], 3)
        if "probe_after_drafter_reload" in s:
            acc += f" -> {_f(s['probe_after_drafter_reload']['acceptance'], 3)} (drafter reloaded)"
        lines.append(
            f"| {s['from']} -> {s['to']} | {s['level']} | {woken} | {_f(s['to_first_token_s'])} | "
            f"{_f(s['sleep']['s'])} | {_f(s['t_wake_done'] - s['t_sleep_done'])} | "
            f"{s['requests']} | {s['n_failed']} | {mem['gpu_mib']} | {mem['rss_mib']} | {acc} | "
            f"{s['greedy_same_as_before']} |"
        )
    if result.get("acceptance_before"):
        lines.append("")
        lines.append(f"acceptance before any sleep: {json.dumps(result['acceptance_before'])}")
    if "restart_a" in result:
        lines.append(
            f"full restart of A to its first token: {result['restart_a']['to_first_token_s']} s"
        )
    return "\n".join(lines)


def cmd_report(a: argparse.Namespace) -> int:
    result = json.loads(Path(a.result).read_text(encoding="utf-8"))
    print(report_md(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_switch.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", default="out/switch", help="folder for up.json / switch.json")
        p.add_argument("--base-dir", default="~/vfleet-switch", help="vfleet base folder")

    u = sub.add_parser("up", help="start A, then B beside it; B sleeps at level 1 (GPU)")
    common(u)
    u.add_argument("--profile", default=lane.DEFAULT_PROFILE)
    u.add_argument("--model-a", default="tiny-hybrid-mtp")
    u.add_argument("--model-b", default="mid-hybrid-mtp")
    u.add_argument("--port-a", type=int, default=8001)
    u.add_argument("--port-b", type=int, default=8002)
    u.add_argument("--util", type=float, default=0.45, help="gpu-memory-utilization of each")
    u.add_argument("--models-dir", default="~/models", help="where the models are built")
    u.add_argument("--python", default=sys.executable, help="the python that imports vLLM")
    u.add_argument(
        "--pythonpath", help="prepended to PYTHONPATH for vLLM (add bench/ for the extension)"
    )
    u.add_argument("--cuda-home")
    u.add_argument("--start-timeout", type=float, default=420)
    u.set_defaults(fn=cmd_up)
    s = sub.add_parser("switch", help="the switches under load, then a restart of A (GPU)")
    common(s)
    s.add_argument("--streams", type=int, default=4)
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--pre-s", type=float, default=2.0)
    s.add_argument("--post-s", type=float, default=2.0)
    s.add_argument("--request-timeout-s", type=float, default=30.0)
    s.add_argument("--max-requests", type=int, default=400, help="per switch")
    s.add_argument("--budget-s", type=float, default=0)
    s.add_argument("--start-timeout", type=float, default=300)
    s.add_argument("--restart", action="store_true", help="then a full restart of A")
    s.set_defaults(fn=cmd_switch)
    d = sub.add_parser("down", help="stop both servers")
    common(d)
    d.set_defaults(fn=cmd_down)
    r = sub.add_parser("report", help="switch.json -> markdown table")
    r.add_argument("result")
    r.set_defaults(fn=cmd_report)
    a = ap.parse_args(argv)
    rc: int = a.fn(a)
    return rc


if __name__ == "__main__":
    sys.exit(main())
