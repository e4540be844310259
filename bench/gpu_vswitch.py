#!/usr/bin/env python3
"""`vfleet switch` itself on one GPU: two resident engines behind the balancer's nginx (issue 32).

bench/gpu_switch.py measured the sleep/wake primitive with its own client-side routing; this
runs the product's command on the same pair (docs/GPU.md section 8, docs/SWAP.md "Resident
models"): an inventory of two `ansible_connection: local` hosts on this machine (instance `a`:
tiny-hybrid-mtp on port 8001, instance `b`: mid-hybrid-mtp on port 8002, both served as `chat`,
`gpu_memory_utilization` 0.45 each so that b starts beside an awake a, bf16 KV, MTP 3, the SM75
plugin's drafter-reload on: `extra_env.VFLEET_SM75=drafter-reload`), each release rendered by the
inventory's plan (`host_plan`, as `make deploy` plans it and as tests/integration/test_switch.py
lays it out), started by its own launch.sh; `vfleet balancer render --replica-header` +
`start` (nginx) as the front; `vfleet balancer drain a`, `vfleet switch admit a` (its reference
on the idle engine), `vfleet balancer drain b`, `vfleet switch standby b --perf-gate`, then a
sequence of `vfleet switch to` under a bounded load through the front:

  S1 a->b   a sleeps at level 1, b woken from level 1
  S2 b->a   b sleeps at level 1, a woken from level 1
  (inventory: a's sleep_level 2, while a serves)
  S3 a->b   a sleeps at level 2, b woken from level 1
  (inventory: b's sleep_level 2, while b serves)
  S4 b->a   b sleeps at level 2, a woken from level 2 (reload_weights + the plugin's drafter)
  S5 a->b   a sleeps at level 2, b woken from level 2 (the same for the mid model; with
            --plugin-b off, b has no drafter reload: the acceptance gate must roll it back)

The 27B pair (`up --pair 27b-awq`: random weights) switches five times at level 1 (SEQUENCE_L1):
a level 2 wake needs a checkpoint to reload. With `switch --order alternate` either pair switches
eight times at level 1, each direction twice in each order (wake-first, sleep-first,
sleep-first, wake-first, ...), so that `--wake-first` is measured beside the default on the
same warm pair.

`vfleet switch` reads an instance's level from the inventory's plan (VFLEET_SLEEP_LEVEL in its
vllm.env): levels 1 and 2 render the same vllm.yaml and differ in that one variable, which
vLLM does not read, so the level is changed in the inventory without a restart, and only for an
instance that serves (it then sleeps and wakes at the new level).

The load: --streams threads, each sending one streamed chat request after another (64 tokens,
temperature 0, --request-timeout-s client timeout) to the front, for the whole sequence; nginx's
X-Vfleet-Replica header says which engine answered. Per switch: the command's report (`--json`:
its steps, gates, duration and the first token through the front after the flip), the load's
requests in the switch's window and those that failed, the first token a load request got from
the other engine after the command started, GPU and host memory per engine after it.

  up      build the models, render, start a, then b (while a answers its first request), both
          warmed (the first request, then the greedy prompts), nginx, admit a, standby b
  switch  the sequence above under load
  down    stop nginx and both engines
  report  RESULT.json -> markdown

Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_switch as gs

lane = gs.lane
REPO = lane.REPO
STATE = "vswitch-state.json"
SERVED = "chat"
FRONT_PORT = 8080
# The pairs `up --pair` sets up (instance -> model). tiny-mid: the generated models (real
# text, MTP accepts). 27b-awq: the two AWQ 27B presets at their own size with random weights
# (the lane's --dummy-weights: a config-only folder each), the same architecture under two
# names, each with its own torch.compile cache: a switch at real scale (18 GB of weights a side
# backed up and restored at level 1), outputs noise and MTP acceptance 0 (issue 32's real scale).
PAIRS = {
    "tiny-mid": {"a": "tiny-hybrid-mtp", "b": "mid-hybrid-mtp"},
    "27b-awq": {"a": "qwen3.6-27b-awq-int4", "b": "qwen3.8-27b-awq-mtp"},
}
# The pairs served from config-only folders with random weights (the one fact the window, the
# model build and the switch sequence follow).
RANDOM_WEIGHTS = frozenset({"27b-awq"})
MODELS = PAIRS["tiny-mid"]  # the instance names (a, b) and the default pair
# The window of a pair at real scale: two engines at 0.45 of the card each, bf16 KV (fp8 KV's
# wake fails on 0.24.0), leave each ~14 GiB of KV on an 80 GB card, below the preset's 262,144
# tokens (64 KiB a token); 32,768 is what the first look served.
REAL_WINDOW = "max_model_len=32768"
PORTS = {"a": 8001, "b": 8002}


def vfleet_env(pythonpath: str) -> dict[str, str]:
    env = dict(os.environ)
    parts = [str(REPO / "src"), str(REPO / "healthcheck/src"), *filter(None, [pythonpath])]
    env["PYTHONPATH"] = os.pathsep.join([*parts, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def vfleet(pythonpath: str, *args: str, timeout: float = 600) -> dict[str, Any]:
    """One `vfleet` command (this checkout's CLI); its output and time."""
    t0 = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "vfleet.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=vfleet_env(pythonpath),
        check=False,
    )
    out = {
        "argv": ["vfleet", *args],
        "rc": r.returncode,
        "s": round(time.monotonic() - t0, 3),
        "stdout": r.stdout[-20000:],
        "stderr": r.stderr[-20000:],
    }
    print(f"$ vfleet {' '.join(args)}  -> rc {r.returncode} in {out['s']} s", flush=True)
    print((r.stdout + r.stderr)[-3000:], flush=True)
    return out


def plugin_of(a: argparse.Namespace, inst: str) -> str:
    """VFLEET_SM75 of an instance: --plugin, or for b --plugin-b where given (b without the
    drafter-reload is the hook-off control: its level 2 wake must fail the acceptance gate)."""
    if inst == "b" and a.plugin_b is not None:
        return str(a.plugin_b)
    return str(a.plugin)


def pair_sets(pair: str, model: str) -> list[str]:
    """The lane's settings for `model` in `pair`: the generated models' window, or the dummy
    weights' settings and REAL_WINDOW for a pair at real scale."""
    if pair not in RANDOM_WEIGHTS:
        return list(lane.BASE_SETS)
    return [*lane.dummy_base_sets(model), REAL_WINDOW]


def inventory(a: argparse.Namespace, base: Path, levels: dict[str, int]) -> dict[str, Any]:
    hosts = {}
    for inst, model in PAIRS[a.pair].items():
        sets = [
            *pair_sets(a.pair, model),
            f"port={PORTS[inst]}",
            f"served_model_name={SERVED}",
            f"model_dir={Path(a.models_dir).expanduser() / model}",
            f"sleep_level={levels[inst]}",
            f"gpu_memory_utilization={a.util}",
            "kv_cache_dtype=auto",  # fp8 KV + hybrid: vLLM 0.24.0's wake fails (gpu_lane.py)
            *([f"extra_env.VFLEET_SM75={plugin}"] if (plugin := plugin_of(a, inst)) else []),
            *(getattr(a, "set", None) or []),
        ]
        hosts[inst] = {
            "ansible_connection": "local",
            "vfleet_instance": inst,
            "vfleet_model": model,
            "vfleet_profile": a.profile,
            "vfleet_base_dir": str(base),
            "vfleet_python": sys.executable,
            "vfleet_set": sets,
        }
    return {"all": {"children": {"pair": {"hosts": hosts}}}}


def write_inventory(path: Path, inv: dict[str, Any]) -> None:
    import yaml

    path.write_text(yaml.safe_dump(inv), encoding="utf-8")


def set_level(base: Path, inst: str, level: int) -> None:
    import yaml

    path = base / "inv.yml"
    inv = yaml.safe_load(path.read_text(encoding="utf-8"))
    h = inv["all"]["children"]["pair"]["hosts"][inst]
    h["vfleet_set"] = [s for s in h["vfleet_set"] if not s.startswith("sleep_level=")] + [
        f"sleep_level={level}"
    ]
    write_inventory(path, inv)


def render_release(base: Path, inst: str) -> Path:
    """The release the inventory's plan renders for `inst`, laid out as a deploy does."""
    sys.path[:0] = [str(REPO / "src")]
    from vfleet.fleet.inventory import host_namespace, host_plan, host_vars

    inv = str(base / "inv.yml")
    plan, _ = host_plan(host_namespace(inv, inst, None, None), host_vars(inv, inst))
    d = base / "instances" / inst
    for sub in ("state", "home"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    rel = d / "releases" / "r1"
    for f in plan.files:
        path = rel / f.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f.content)
        path.chmod(int(f.mode, 8))
    cur = d / "current"
    if cur.is_symlink() or cur.exists():
        cur.unlink()
    cur.symlink_to(rel)
    return rel


# --------------------------------------------------------------------------- the load


def stream(
    front: int, prompt: str, max_tokens: int, timeout: float, t_ref: float
) -> dict[str, Any]:
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        f"http://127.0.0.1:{front}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"t0": round(t0 - t_ref, 4), "ok": False, "replica": None}
    first: float | None = None
    finish = None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            rec["status"] = int(resp.status)
            rec["replica"] = resp.headers.get("X-Vfleet-Replica")
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
    except urllib.error.HTTPError as exc:
        rec["status"] = exc.code
        rec["replica"] = exc.headers.get("X-Vfleet-Replica")
        rec["error"] = (exc.read() if exc.fp else b"")[:300].decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:300]
    rec["t_first"] = round(first - t_ref, 4) if first is not None else None
    rec["t_end"] = round(time.perf_counter() - t_ref, 4)
    rec["finish"] = finish
    rec["ok"] = first is not None and finish in ("length", "stop") and "error" not in rec
    return rec


class Load:
    def __init__(self, a: argparse.Namespace, t_ref: float) -> None:
        self.a, self.t_ref = a, t_ref
        self.lock = threading.Lock()
        self.stop_ev = threading.Event()
        self.records: list[dict[str, Any]] = []
        self.inflight: dict[int, float] = {}
        self.started = 0
        self.threads: list[threading.Thread] = []

    def _worker(self, i: int) -> None:
        n = 0
        while not self.stop_ev.is_set():
            with self.lock:
                if self.started >= self.a.max_requests:
                    return
                self.started += 1
                self.inflight[i] = round(time.perf_counter() - self.t_ref, 4)
            rec = stream(FRONT_PORT, f"[load {i}.{n}] Tell me about the quick brown fox.",
                         self.a.max_tokens, self.a.request_timeout_s, self.t_ref)  # fmt: skip
            rec["stream"] = i
            with self.lock:
                self.records.append(rec)
                self.inflight.pop(i, None)
            n += 1

    def start(self) -> None:
        for i in range(self.a.streams):
            t = threading.Thread(target=self._worker, args=(i,), daemon=True)
            t.start()
            self.threads.append(t)

    def now(self) -> float:
        return time.perf_counter() - self.t_ref

    def stop(self, join_s: float) -> list[float]:
        self.stop_ev.set()
        deadline = time.monotonic() + join_s
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with self.lock:
            return list(self.inflight.values())


# --------------------------------------------------------------------------- up / down


def engines(base: Path) -> list[gs.Engine]:
    out = []
    for inst in MODELS:
        rel = base / "instances" / inst / "current"
        out.append(gs.Engine(inst, SERVED, PORTS[inst], str(rel)))
    return out


def save(base: Path, engs: list[gs.Engine], extra: dict[str, Any]) -> None:
    gs.save_state(base, engs, extra)
    (base / gs.STATE).rename(base / STATE)


def load_engines(base: Path) -> tuple[list[gs.Engine], dict[str, Any]]:
    data = json.loads((base / STATE).read_text(encoding="utf-8"))
    return [gs.Engine(**e) for e in data.pop("engines")], data


def cmd_up(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(a.base_dir).expanduser()
    base.mkdir(parents=True, exist_ok=True)
    (base / "logs").mkdir(exist_ok=True)
    result: dict[str, Any] = {
        "step": "up",
        "util": a.util,
        "plugin": a.plugin,
        "plugin_b": plugin_of(a, "b"),
        "phases": {},
    }
    t_all = time.monotonic()
    # The models (no downloads) and the venv wrapper launch.sh execs (gpu_lane.prepare_host).
    sw = argparse.Namespace(
        base_dir=str(base), python=a.python, pythonpath=a.pythonpath, cuda_home=a.cuda_home,
        profile=a.profile, models_dir=a.models_dir, sets=[], dummy_weights=a.pair in RANDOM_WEIGHTS,
    )  # fmt: skip
    models = PAIRS[a.pair]
    result["pair"] = {"name": a.pair, **models}
    host_a = gs.host_for(sw, models["a"])
    result["machine"] = lane.machine_facts(a.python, host_a.env())
    write_inventory(base / "inv.yml", inventory(a, base, {"a": 1, "b": 1}))
    for inst in MODELS:
        render_release(base, inst)
    if a.shared_cache:
        # b's cache folder is a's (bytecode and Triton kernels reused; as section 8 did)
        (base / "cache").mkdir(exist_ok=True)
        (base / "cache" / "a").mkdir(exist_ok=True)
        link = base / "cache" / "b"
        if not link.exists() and not link.is_symlink():
            link.symlink_to(base / "cache" / "a")
        # and b's HOME caches are a's (FlashInfer's JIT objects and CUDA's compute cache live
        # under the instance HOME that launch.sh sets): the bf16-KV decode kernels a's first
        # request builds on a fresh host are not built a second time for b
        home_a = base / "instances" / "a" / "home" / ".cache"
        home_a.mkdir(parents=True, exist_ok=True)
        home_b = base / "instances" / "b" / "home" / ".cache"
        if not home_b.exists() and not home_b.is_symlink():
            home_b.symlink_to(home_a)
    engs = engines(base)
    ea, eb = engs
    # a first; b starts once a is ready (vLLM's memory profile must not see a start beside it),
    # while a answers its first request.
    t0 = time.monotonic()
    gs.start(ea, base / "logs")
    save(base, engs, {"pair": a.pair})
    # The mid model builds (CPU, ~45 s) while a starts.
    build_b = threading.Thread(target=gs.host_for, args=(sw, models["b"]), daemon=True)
    build_b.start()
    pa: dict[str, Any] = {}
    result["phases"]["a"] = pa
    pa["ready_s"] = gs.wait_ready(ea, a.start_timeout)
    print(f"== a ready {pa['ready_s']} s", flush=True)
    if pa["ready_s"] is None:
        result["error"] = "a: no /health"
        gs.write(out, "up.json", result)
        return 1
    # a alone on the card, before b starts: what it holds against its share (section 13)
    pa["memory_alone"] = gs.memory([ea])
    print(f"   a alone: {json.dumps(pa['memory_alone'])}", flush=True)
    gs.write(out, "up.json", result)
    first_a: dict[str, Any] = {}
    th = threading.Thread(target=lambda: first_a.update(gs.first_request(ea)), daemon=True)
    ta = time.monotonic()  # a's first request starts now; its t_first counts from here
    th.start()
    build_b.join()
    tb = time.monotonic()
    gs.start(eb, base / "logs")
    save(base, engs, {"pair": a.pair})
    pb: dict[str, Any] = {}
    result["phases"]["b"] = pb
    # From b's start, while a's first request runs beside it: b's readiness is polled before
    # that request is joined (the sixteenth-to-nineteenth sessions' figure waited for the join
    # first: b's "ready" then read a's first request's end, docs/GPU.md section 14).
    ready = gs.wait_ready(eb, a.start_timeout)
    pb["ready_s"] = None if ready is None else round(time.monotonic() - tb, 2)
    th.join(a.start_timeout)
    pa["first_request"] = first_a
    t_first = first_a.get("t_first")
    pa["start_to_first_token_s"] = (
        round(ta - t0 + float(t_first), 2) if isinstance(t_first, (int, float)) else None
    )
    print(f"== b ready {pb['ready_s']} s after its start", flush=True)
    if pb["ready_s"] is None:
        result["error"] = "b: no /health"
        gs.write(out, "up.json", result)
        return 1
    pb["first_request"] = gs.first_request(eb)
    pb["start_to_first_token_s"] = round(time.monotonic() - tb, 2)
    for e, ph in ((ea, pa), (eb, pb)):
        ph["probe_before"] = gs.probe(e)
        print(f"   {e.name}: acceptance {ph['probe_before']['acceptance']}", flush=True)
    result["memory_awake"] = gs.memory(engs)
    gs.write(out, "up.json", result)
    # The front, b drained and put to sleep as the standby (recorded, benched).
    lb = base / "lb"
    inv = str(base / "inv.yml")
    result["balancer_render"] = vfleet(a.pythonpath, "balancer", "render", "pair", "-i", inv,
                                       "--dir", str(lb), "--listen", f"127.0.0.1:{FRONT_PORT}",
                                       "--replica-header")  # fmt: skip
    result["balancer_start"] = vfleet(a.pythonpath, "balancer", "start", str(lb))
    # a's reference on its idle engine before it serves (b serves meanwhile, both awake and
    # not loaded yet), so the first switch keeps it instead of taking it while b's first
    # clients wait (1.85 s of the eleventh run's 3.72 s first switch, docs/GPU.md section 11).
    result["drain_a"] = vfleet(a.pythonpath, "balancer", "drain", str(lb), "a")
    result["admit_a"] = vfleet(a.pythonpath, "switch", "admit", str(lb), "a", "-i", inv,
                               timeout=300)  # fmt: skip
    result["drain_b"] = vfleet(a.pythonpath, "balancer", "drain", str(lb), "b")
    result["standby_b"] = vfleet(a.pythonpath, "switch", "standby", str(lb), "b", "-i", inv,
                                 "--perf-gate", timeout=300)  # fmt: skip
    eb.level = 1
    time.sleep(1)
    result["memory_b_asleep_l1"] = gs.memory(engs)
    save(base, engs, {"pair": a.pair})
    result["seconds"] = round(time.monotonic() - t_all, 1)
    gs.write(out, "up.json", result)
    ok = all(result[k]["rc"] == 0 for k in ("balancer_render", "balancer_start", "drain_a",
                                            "admit_a", "drain_b", "standby_b"))  # fmt: skip
    print(f"up in {result['seconds']} s, front ok: {ok}", flush=True)
    return 0 if ok else 1


def cmd_down(a: argparse.Namespace) -> int:
    base = Path(a.base_dir).expanduser()
    if (base / "lb" / "balancer.json").exists():
        vfleet(a.pythonpath, "balancer", "stop", str(base / "lb"))
    if (base / STATE).exists():
        for e in load_engines(base)[0]:
            gs.stop(e)
    return 0


# --------------------------------------------------------------------------- switch


SEQUENCE = (
    # (to, {instance: level set in the inventory before the switch})
    ("b", {}),
    ("a", {}),
    ("b", {"a": 2}),
    ("a", {"b": 2}),
    ("b", {}),
)
# A pair with random weights switches at level 1 only: a level 2 wake reloads the weights from
# the checkpoint, and vLLM 0.24.0's reload_weights raises NotImplementedError for
# `load-format: dummy` (its loader has no get_all_weights: v1/worker/gpu_model_runner.py).
SEQUENCE_L1 = (("b", {}), ("a", {}), ("b", {}), ("a", {}), ("b", {}))
# `--order alternate` (any pair): eight level-1 switches, each direction twice in each order,
# so that the two orders are compared in one run on one warm pair (ratios side by side).
SEQUENCE_L1_ALTERNATE = SEQUENCE_L1[:4] * 2
ORDERS = ("sleep-first", "wake-first", "alternate")


def sequence_of(pair: str, order: str) -> tuple[tuple[str, dict[str, int]], ...]:
    if order == "alternate":  # the orders compared at one level, whatever the pair
        return SEQUENCE_L1_ALTERNATE
    return SEQUENCE_L1 if pair in RANDOM_WEIGHTS else SEQUENCE


def order_of(order: str, index: int) -> str:
    """The order switch number `index` (from 0) runs in: alternate starts wake-first and then
    goes sleep-first, sleep-first, wake-first, ... (pairs a->b and b->a get both orders)."""
    if order != "alternate":
        return order
    return ("wake-first", "sleep-first", "sleep-first", "wake-first")[index % 4]


def cmd_switch(a: argparse.Namespace) -> int:
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = Path(a.base_dir).expanduser()
    engs, state = load_engines(base)
    pair = str(state.get("pair", "tiny-mid"))
    lb, inv = str(base / "lb"), str(base / "inv.yml")
    t_ref = time.perf_counter()
    load = Load(a, t_ref)
    result: dict[str, Any] = {
        "step": "switch",
        "pair": pair,
        "streams": a.streams,
        "max_tokens": a.max_tokens,
        "request_timeout_s": a.request_timeout_s,
        "routing": f"nginx (vfleet balancer) on 127.0.0.1:{FRONT_PORT}",
        "switches": [],
    }
    load.start()
    t_all = time.monotonic()
    levels_now = {"a": 1, "b": 1}  # the inventory's sleep_level per instance (up: 1 and 1)
    try:
        while sum(r["ok"] for r in load.records) < a.streams:
            if load.now() > 120:
                result["error"] = "the load got no answer in 120 s before the first switch"
                break
            time.sleep(0.2)
        for index, (to, levels) in enumerate(sequence_of(pair, a.order)):
            if "error" in result:
                break
            if a.budget_s and time.monotonic() - t_all > a.budget_s:
                result["switches"].append({"to": to, "skipped": "--budget-s"})
                continue
            lb_state = json.loads((base / "lb" / "balancer.json").read_text(encoding="utf-8"))
            if any(r["host"] == to and not r["down"] for r in lb_state["replicas"]):
                # The switch before rolled back: `switch to` would refuse (exit 2).
                result["switches"].append({"to": to, "skipped": f"{to} serves already"})
                continue
            for inst, lvl in levels.items():
                set_level(base, inst, lvl)
                levels_now[inst] = lvl
            frm = "a" if to == "b" else "b"
            time.sleep(a.pre_s)
            t_start = load.now()
            how = order_of(a.order, index)
            order = ["--wake-first"] if how == "wake-first" else []
            cmd = vfleet(a.pythonpath, "switch", "to", lb, to, "-i", inv, "--json", *order,
                         timeout=600)  # fmt: skip
            t_end = load.now()
            rec: dict[str, Any] = {"to": to, "frm": frm, "order": how, "levels_set": levels,
                                   "sleeps_at": levels_now[frm], "woken_from": levels_now[to],
                                   "t_start": round(t_start, 4), "t_end": round(t_end, 4),
                                   "command": cmd}  # fmt: skip
            try:
                rec["report"] = json.loads(cmd["stdout"])
            except ValueError:
                rec["report"] = None
            time.sleep(a.post_s)
            with load.lock:
                recs = list(load.records)
            port = f"127.0.0.1:{PORTS[to]}"
            after = [r for r in recs if r["t0"] >= t_start and r["replica"] == port]
            firsts = [r["t_first"] for r in after if r.get("t_first")]
            rec["load_first_token_of_new_s"] = round(min(firsts) - t_start, 4) if firsts else None
            window = [r for r in recs if r["t_end"] >= t_start and r["t0"] <= t_end]
            rec["load_requests_in_window"] = len(window)
            rec["load_failed_in_window"] = [r for r in window if not r["ok"]]
            rec["memory"] = gs.memory(engs)
            result["switches"].append(rec)
            rep = rec["report"] or {}
            print(
                f"== switch to {to}: {rep.get('outcome')} in {rep.get('seconds')} s, first token "
                f"through the front {rep.get('first_token_s')} s after the flip, load's first "
                f"token of {to} {rec['load_first_token_of_new_s']} s after the command; "
                f"{len(window)} requests in the window, {len(rec['load_failed_in_window'])} "
                f"failed; gates: "
                + "; ".join(f"{g['name']} {g['ok']} {g['detail']}" for g in rep.get("gates", [])),
                flush=True,
            )
            gs.write(out, "switch.json", result)
    finally:
        stuck = load.stop(a.request_timeout_s + 5)
    result["stuck"] = stuck
    result["records"] = sorted(load.records, key=lambda r: r["t0"])
    result["load_total"] = len(result["records"])
    result["load_failed"] = [r for r in result["records"] if not r["ok"]]
    result["show"] = vfleet(a.pythonpath, "switch", "show", lb)
    result["seconds"] = round(time.monotonic() - t_all, 1)
    gs.write(out, "switch.json", result)
    print(report_md(result), flush=True)
    return 0


_f = gs._f  # one cell format for both switch benches' tables


def report_md(result: dict[str, Any]) -> str:
    lines = [
        "| switch | order | sleeps at / woken from | outcome | switch s (flip to last gate) | old "
        "workers s | sleep s | wake s | first token through the front after the flip s | "
        "load: first token of the new model after the command's start s | load requests in "
        "the window (failed) | gates |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in result.get("switches", []):
        if "skipped" in s:
            lines.append(f"| to {s['to']} | | skipped: {s['skipped']} | | | | | | | | | |")
            continue
        rep = s.get("report") or {}
        gates = "; ".join(
            f"{g['name']} {'ok' if g['ok'] else 'FAIL'}" for g in rep.get("gates", [])
        )
        levels = f"L{s.get('sleeps_at')} / L{s.get('woken_from')}"
        lines.append(
            f"| {s.get('frm', '?')} -> {s['to']} | {s.get('order', 'sleep-first')} | {levels} | "
            f"{rep.get('outcome', 'no report')} | "
            f"{_f(rep.get('seconds'))} | {_f(rep.get('drain_s'))} | {_f(rep.get('sleep_s'))} | "
            f"{_f(rep.get('wake_s'))} | {_f(rep.get('first_token_s'))} | "
            f"{_f(s.get('load_first_token_of_new_s'))} | {s.get('load_requests_in_window')} "
            f"({len(s.get('load_failed_in_window', []))}) | {gates} |"
        )
    lines.append("")
    lines.append(
        f"load: {result.get('load_total')} requests, {len(result.get('load_failed', []))} failed, "
        f"{len(result.get('stuck', []))} unanswered at the end"
    )
    return "\n".join(lines)


def cmd_report(a: argparse.Namespace) -> int:
    print(report_md(json.loads(Path(a.result).read_text(encoding="utf-8"))))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_vswitch.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", default="out/vswitch")
        p.add_argument("--base-dir", default="~/vfleet-vswitch", help="vfleet base folder")
        p.add_argument("--pythonpath", default="", help="vLLM's and vfleet's packages (~/site)")

    u = sub.add_parser("up")
    common(u)
    u.add_argument("--profile", default=lane.DEFAULT_PROFILE)
    u.add_argument(
        "--pair",
        choices=sorted(PAIRS),
        default="tiny-mid",
        help="the two models: tiny-mid (generated, real text) or 27b-awq (the AWQ presets at "
        "their own size with random weights, window 32,768)",
    )
    u.add_argument("--util", type=float, default=0.45)
    u.add_argument("--plugin", default="drafter-reload", help="VFLEET_SM75 ('' for none)")
    u.add_argument(
        "--plugin-b",
        help="b's VFLEET_SM75 where it differs from --plugin (off: the hook-off control)",
    )
    u.add_argument("--models-dir", default="~/models")
    u.add_argument("--python", default=sys.executable)
    u.add_argument("--cuda-home")
    u.add_argument("--start-timeout", type=float, default=420)
    u.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="a deployment setting for both engines, after the pair's own (repeatable; e.g. "
        "extra_args.enforce-eager=true for a start without compile or graphs)",
    )
    u.add_argument("--shared-cache", action="store_true", help="b's cache folder is a's")
    u.set_defaults(fn=cmd_up)
    s = sub.add_parser("switch")
    common(s)
    s.add_argument("--streams", type=int, default=4)
    s.add_argument("--max-tokens", type=int, default=64)
    s.add_argument("--pre-s", type=float, default=2.0)
    s.add_argument("--post-s", type=float, default=2.0)
    s.add_argument("--request-timeout-s", type=float, default=30.0)
    s.add_argument("--max-requests", type=int, default=3000)
    s.add_argument("--budget-s", type=float, default=0)
    s.add_argument(
        "--order",
        choices=ORDERS,
        default="sleep-first",
        help="wake-first: `vfleet switch to --wake-first` (the standby wakes while the active "
        "drains; the pair must fit awake at once, as the 27B pair at 0.45 each does); "
        "alternate: either pair switches eight times at level 1, four in each order (run it "
        "after `up`, which leaves both at level 1)",
    )
    s.add_argument(
        "--wake-first",
        dest="order",
        action="store_const",
        const="wake-first",
        help="the same as --order wake-first",
    )
    s.set_defaults(fn=cmd_switch)
    d = sub.add_parser("down")
    common(d)
    d.set_defaults(fn=cmd_down)
    r = sub.add_parser("report")
    r.add_argument("result")
    r.set_defaults(fn=cmd_report)
    a = ap.parse_args(argv)
    rc: int = a.fn(a)
    return rc


if __name__ == "__main__":
    sys.exit(main())
